"""Links as objects: switched Ethernet, a shared Wi-Fi medium, USB-Ethernet adapters.

The virtual clock charges each transfer to its link instead of to a per-device
bandwidth: a round's downloads and uploads share the server's switch port or the
Wi-Fi airtime (:func:`round_times`, the hook of the in-process engine:
:func:`charge_round`), and an all-reduce among ``n`` devices costs what the
ring algorithm costs on that network (:meth:`Network.allreduce_seconds`), so a
synchronous data-parallel step costs :func:`sync_step_seconds`.

**Ring all-reduce** (reduce-scatter then all-gather; Patarasuk and Yuan 2009;
Thakur, Rabenseifner, Gropp 2005; :func:`ring_allreduce_seconds`, whose one home
is :mod:`flowerbed.parallel.collectives`, shared with the fused-tile cost model):

    T = 2 (N - 1) / N * bytes / bandwidth + 2 (N - 1) * latency

``bandwidth`` being what each device can send while all send at once.

**Switched Ethernet** (:class:`SwitchedEthernet`): every port is full duplex at
its line rate; TCP carries ``1448`` payload bytes per ``1538`` bytes of wire
time on a 1500-byte MTU (IEEE 802.3: 8 preamble/SFD + 14 header + 4 FCS + 12
inter-frame gap bytes around the frame; RFC 791 IP header 20 bytes; RFC 793/7323
TCP header 20 + 12 timestamp bytes), i.e. 94.1% of the line rate. A switch's
backplane (switching capacity) bounds the sum of all flows; None means
non-blocking (ports x 2 x line rate). Phones reach the switch through a
:class:`UsbEthernetAdapter`, whose USB bus may be slower than its Ethernet side.
A round's transfers share the server's port (downloads its transmit side,
uploads its receive side) by max-min fairness, TCP's long-run share of a
bottleneck (Bertsekas and Gallager, "Data Networks", 2nd ed., Sec. 6.5.2).

**Shared Wi-Fi** (:class:`WifiMedium`): one channel whose airtime the stations
sending at once divide, with collisions and back-off costing airtime as in
Bianchi's model of the 802.11 DCF (G. Bianchi, "Performance analysis of the IEEE
802.11 distributed coordination function", IEEE JSAC 18(3), 2000, Eq. 7, 9, 13):
with ``k`` saturated stations, window ``W`` and ``m`` back-off stages, the
transmission probability ``tau`` solves

    tau = 2 / (1 + W + p W sum_{i<m} (2p)^i),   p = 1 - (1 - tau)^(k-1)

and the aggregate goodput is

    S(k) = P_s P_tr L / ((1 - P_tr) sigma + P_tr P_s T_s + P_tr (1 - P_s) T_c)

with ``P_tr = 1 - (1 - tau)^k``, ``P_s = k tau (1 - tau)^(k-1) / P_tr``, ``L``
the payload bits of one transmission, ``T_s = PPDU + SIFS + ACK + DIFS`` and
``T_c = PPDU + DIFS`` (basic access). DCF gives every station the same share of
transmissions, so each sender gets ``S(k) / k``. Defaults are 802.11ac on 5 GHz
(IEEE 802.11-2016, Sec. 21): slot 9 us, SIFS 16 us, DIFS 34 us, CWmin 15 (W = 16),
CWmax 1023 (m = 6); a 2x2 80 MHz MCS 9 short-GI PHY at 866.7 Mbit/s (a Galaxy
S10+'s radio class); the VHT preamble of two streams 44 us; an A-MPDU of 64
MPDUs (the block-ack window) of 1448 TCP payload bytes, each with 96 bytes of
TCP/IP, LLC, MAC header, FCS and delimiter; a compressed block ack at the 24
Mbit/s basic rate, 32 us. In a round the access point sends every download, so
it is one station however many phones it serves. For an all-reduce the stations
send to each other directly (ad hoc or Wi-Fi Direct); through an access point
every byte would cross the air twice, which only makes Wi-Fi worse.

Latencies are assumptions, labelled as such (:data:`WIRED_LATENCY_S`); for
Wi-Fi the per-message latency is one successful TXOP's airtime ``T_s``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from flowerbed import keys
from flowerbed.parallel.collectives import ring_allreduce_seconds
from flwr.app import Message, MessageType

SERVER = -1
"""Endpoint id of the server (the ServerApp's machine) in a transfer."""

TCP_PAYLOAD_BYTES = 1448
"""TCP payload per full-size segment on a 1500-byte MTU (1500 - 20 IP - 32 TCP)."""
ETHERNET_WIRE_BYTES = 1538
"""Wire bytes of that frame: 1500 + 14 header + 4 FCS + 8 preamble/SFD + 12 gap."""
USB_BULK_MBPS = {"2.0": 13 * 512 * 8 * 8000 / 1e6, "3.0": 4000.0}
"""Most payload a USB bus moves in bulk transfers, Mbit/s. USB 2.0: 13 bulk packets
of 512 bytes per 125 us microframe (USB 2.0 spec, Sec. 5.8.4, Table 5-10) = 426
Mbit/s; USB 3.0: 5 Gbit/s signalling with 8b/10b coding = 4 Gbit/s."""
WIRED_LATENCY_S = 100e-6
"""One-way latency of one message on a switched LAN, host stacks included
(assumption; 2 (N - 1) of them per all-reduce, 27 ms for 138 devices)."""


def ethernet_goodput_mbps(line_mbps: float) -> float:
    """TCP goodput of an Ethernet link: ``line x 1448 / 1538`` (module doc)."""
    return line_mbps * TCP_PAYLOAD_BYTES / ETHERNET_WIRE_BYTES


@dataclass(frozen=True)
class Flow:
    """One transfer in progress: ``src`` and ``dst`` are node ids or :data:`SERVER`."""

    src: int
    dst: int


class Network(Protocol):
    """What the virtual clock asks a network."""

    @property
    def name(self) -> str:
        """Short name (``wired``, ``wifi``)."""
        ...

    def rates_mbps(self, flows: Sequence[Flow]) -> list[float]:
        """Goodput of each of ``flows`` while exactly these are active."""
        ...

    def allreduce_seconds(self, n: int, num_bytes: float) -> float:
        """A ring all-reduce of ``num_bytes`` among ``n`` devices."""
        ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class UsbEthernetAdapter:
    """A phone's USB-to-Ethernet adapter: Ethernet line rate behind a USB bus.

    Goodput = min(Ethernet TCP goodput, USB bulk rate); a USB 3.0 gigabit
    adapter on a Galaxy S10+ (USB 3.1 Gen 1 port) is Ethernet-bound, a USB 2.0
    one bus-bound (:data:`USB_BULK_MBPS`).
    """

    usb: str = "3.0"
    line_mbps: float = 1000.0

    def __post_init__(self) -> None:
        if self.usb not in USB_BULK_MBPS:
            raise ValueError(
                f"USB version {self.usb!r}; valid choices: {', '.join(USB_BULK_MBPS)}"
            )
        if not self.line_mbps > 0:
            raise ValueError(f"line_mbps must be > 0, got {self.line_mbps}")

    @property
    def goodput_mbps(self) -> float:
        return min(ethernet_goodput_mbps(self.line_mbps), USB_BULK_MBPS[self.usb])


@dataclass(frozen=True)
class SwitchedEthernet:
    """Devices on one switch, full duplex per port (module doc).

    Attributes
    ----------
    port_mbps : float
        Line rate of the devices' ports (1000: gigabit).
    server_port_mbps : float
        Line rate of the server's port.
    backplane_gbps : float or None
        Switching capacity bounding the sum of all flows; None: non-blocking.
    adapter : UsbEthernetAdapter or None
        The devices' USB adapters (phones); None for a built-in port (boards).
    latency_s : float
        One-way latency of one message (:data:`WIRED_LATENCY_S`).
    """

    port_mbps: float = 1000.0
    server_port_mbps: float = 1000.0
    backplane_gbps: float | None = None
    adapter: UsbEthernetAdapter | None = field(default_factory=UsbEthernetAdapter)
    latency_s: float = WIRED_LATENCY_S
    name: str = "wired"

    def __post_init__(self) -> None:
        for label, value in (
            ("port_mbps", self.port_mbps),
            ("server_port_mbps", self.server_port_mbps),
        ):
            if not value > 0:
                raise ValueError(f"{label} must be > 0, got {value}")
        if self.backplane_gbps is not None and not self.backplane_gbps > 0:
            raise ValueError(f"backplane_gbps must be > 0, got {self.backplane_gbps}")
        if self.latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s}")

    @property
    def device_mbps(self) -> float:
        """Goodput of one device's link, adapter included."""
        port = ethernet_goodput_mbps(self.port_mbps)
        return min(port, self.adapter.goodput_mbps) if self.adapter else port

    @property
    def server_mbps(self) -> float:
        return ethernet_goodput_mbps(self.server_port_mbps)

    def backplane_mbps(self) -> float:
        return math.inf if self.backplane_gbps is None else self.backplane_gbps * 1e3

    def rates_mbps(self, flows: Sequence[Flow]) -> list[float]:
        """Max-min fair rates: caps per device port, shared server port sides and
        backplane, by progressive filling (Bertsekas and Gallager, Sec. 6.5.2)."""
        caps = [
            self.server_mbps
            if SERVER in (f.src, f.dst) and self.device_mbps > self.server_mbps
            else self.device_mbps
            for f in flows
        ]
        shared: dict[str, tuple[float, list[int]]] = {
            "server-tx": (self.server_mbps, []),
            "server-rx": (self.server_mbps, []),
            "backplane": (self.backplane_mbps(), []),
        }
        for index, flow in enumerate(flows):
            shared["backplane"][1].append(index)
            if flow.src == SERVER:
                shared["server-tx"][1].append(index)
            if flow.dst == SERVER:
                shared["server-rx"][1].append(index)
        return progressive_filling(caps, list(shared.values()))

    def allreduce_seconds(self, n: int, num_bytes: float) -> float:
        """Ring all-reduce with every device sending at once (bounded by backplane)."""
        per_device = min(self.device_mbps, self.backplane_mbps() / max(n, 1))
        return ring_allreduce_seconds(n, num_bytes, per_device, self.latency_s)

    def describe(self) -> str:
        adapter = ""
        if self.adapter:
            rate = self.adapter.goodput_mbps
            adapter = f", USB {self.adapter.usb} adapters ({rate:.0f} Mbit/s)"
        backplane = (
            "non-blocking"
            if self.backplane_gbps is None
            else f"{self.backplane_gbps:g} Gbit/s backplane"
        )
        return (
            f"switched Ethernet, {self.port_mbps:g} Mbit/s ports, {backplane}"
            f"{adapter}, {self.latency_s * 1e6:g} us latency"
        )


def progressive_filling(
    caps: Sequence[float], shared: Sequence[tuple[float, Sequence[int]]]
) -> list[float]:
    """Max-min fair rates of flows with per-flow ``caps`` and shared resources.

    ``shared`` lists ``(capacity, flow indices)``. All unfrozen flows grow at the
    same rate until a resource fills or a flow reaches its cap; those freeze;
    repeat (Bertsekas and Gallager, "Data Networks", Sec. 6.5.2).
    """
    rates = [0.0] * len(caps)
    frozen = [False] * len(caps)
    while not all(frozen):
        live = [i for i in range(len(caps)) if not frozen[i]]
        level = min(caps[i] for i in live)
        for capacity, members in shared:
            active = [i for i in members if not frozen[i]]
            if active:
                used = sum(rates[i] for i in members if frozen[i])
                level = min(level, (capacity - used) / len(active))
        level = max(level, 0.0)
        full = set()
        for capacity, members in shared:
            active = [i for i in members if not frozen[i]]
            used = sum(rates[i] for i in members if frozen[i])
            if active and (capacity - used) / len(active) <= level * (1 + 1e-12):
                full.update(active)
        for i in live:
            rates[i] = level
            if i in full or caps[i] <= level * (1 + 1e-12):
                frozen[i] = True
    return rates


@dataclass(frozen=True)
class WifiMedium:
    """One shared 802.11 channel under the DCF (module doc; Bianchi 2000).

    Attributes (defaults: 802.11ac, 5 GHz, 2x2 80 MHz MCS 9; module doc)
    ----------
    phy_mbps : float
        PHY data rate of the payload.
    slot_us, sifs_us, difs_us : float
        Slot time, SIFS and DIFS in microseconds.
    cw_min : int
        ``W``, the minimum contention window (CWmin + 1).
    backoff_stages : int
        ``m``, so that CWmax + 1 = W 2^m.
    preamble_us, ack_us : float
        PHY preamble and (block) acknowledgement airtime.
    mpdus : int
        MPDUs per A-MPDU.
    payload_bytes, overhead_bytes : int
        TCP payload and per-MPDU overhead bytes.
    server_mbps : float
        The access point's wired link to the server (not the bottleneck).
    """

    phy_mbps: float = 866.7
    slot_us: float = 9.0
    sifs_us: float = 16.0
    difs_us: float = 34.0
    cw_min: int = 16
    backoff_stages: int = 6
    preamble_us: float = 44.0
    ack_us: float = 32.0
    mpdus: int = 64
    payload_bytes: int = TCP_PAYLOAD_BYTES
    overhead_bytes: int = 96
    server_mbps: float = ethernet_goodput_mbps(1000.0)
    name: str = "wifi"

    def __post_init__(self) -> None:
        numbers = {
            "phy_mbps": self.phy_mbps,
            "slot_us": self.slot_us,
            "cw_min": self.cw_min,
            "mpdus": self.mpdus,
            "payload_bytes": self.payload_bytes,
            "server_mbps": self.server_mbps,
        }
        for label, value in numbers.items():
            if not value > 0:
                raise ValueError(f"{label} must be > 0, got {value}")
        if self.backoff_stages < 0:
            raise ValueError(f"backoff_stages must be >= 0, got {self.backoff_stages}")

    @property
    def success_us(self) -> float:
        """``T_s``: airtime of one successful transmission (PPDU+SIFS+ACK+DIFS)."""
        return self._ppdu_us() + self.sifs_us + self.ack_us + self.difs_us

    def _ppdu_us(self) -> float:
        bits = self.mpdus * (self.payload_bytes + self.overhead_bytes) * 8
        return self.preamble_us + bits / self.phy_mbps

    def transmit_probability(self, stations: int) -> float:
        """``tau`` of Bianchi's Eq. 7 (solved by bisection; unique fixed point)."""
        if stations < 1:
            raise ValueError(f"stations must be >= 1, got {stations}")
        w, m = self.cw_min, self.backoff_stages

        def rhs(tau: float) -> float:
            p = 1.0 - (1.0 - tau) ** (stations - 1)
            series = sum((2 * p) ** i for i in range(m))
            return 2.0 / (1.0 + w + p * w * series)

        low, high = 0.0, 1.0
        for _ in range(100):
            mid = (low + high) / 2
            if mid < rhs(mid):
                low = mid
            else:
                high = mid
        return (low + high) / 2

    @functools.lru_cache(maxsize=512)  # noqa: B019 (frozen, hashable, few values)
    def saturation_mbps(self, stations: int) -> float:
        """``S(k)``: aggregate goodput of ``k`` saturated stations (module doc)."""
        tau = self.transmit_probability(stations)
        p_tr = 1.0 - (1.0 - tau) ** stations
        p_s = stations * tau * (1.0 - tau) ** (stations - 1) / p_tr
        collision_us = self._ppdu_us() + self.difs_us
        payload_bits = self.mpdus * self.payload_bytes * 8
        mean_slot_us = (
            (1 - p_tr) * self.slot_us
            + p_tr * p_s * self.success_us
            + p_tr * (1 - p_s) * collision_us
        )
        return p_s * p_tr * payload_bits / mean_slot_us

    def rates_mbps(self, flows: Sequence[Flow]) -> list[float]:
        """Each sending station gets ``S(k) / k``, split evenly over its flows.

        The server's flows are sent by the access point (one station).
        """
        senders: dict[int, int] = {}
        for flow in flows:
            senders[flow.src] = senders.get(flow.src, 0) + 1
        if not senders:
            return []
        share = self.saturation_mbps(len(senders)) / len(senders)
        return [min(share / senders[f.src], self.server_mbps) for f in flows]

    def allreduce_seconds(self, n: int, num_bytes: float) -> float:
        """Ring all-reduce with all ``n`` stations sending at once: ``S(n) / n`` each,
        and one TXOP (``T_s``) of latency per message."""
        if n <= 1:
            return 0.0
        return ring_allreduce_seconds(
            n, num_bytes, self.saturation_mbps(n) / n, self.success_us * 1e-6
        )

    def describe(self) -> str:
        return (
            f"shared 802.11 channel, {self.phy_mbps:g} Mbit/s PHY, Bianchi DCF "
            f"(W={self.cw_min}, m={self.backoff_stages}), {self.mpdus}-MPDU A-MPDUs"
        )


def sync_step_seconds(
    network: Network,
    shares: Sequence[int],
    seconds_per_sample: Sequence[float],
    grad_bytes: float,
) -> float:
    """Virtual seconds of one synchronous data-parallel step (the DDP clock).

    Every member computes its share, then the gradients are all-reduced; the
    step ends when the slowest member's compute and the all-reduce are done
    (no overlap of the two: a conservative bound, DDP overlaps the all-reduce
    with the backward pass)::

        step = max_i B_i t_i + allreduce(n, grad_bytes)

    With shares by speed (``B_i`` proportional to ``1 / t_i``) the first term is
    ``B / sum_i (1 / t_i)``: no member waits for another.
    """
    if len(shares) != len(seconds_per_sample) or not shares:
        raise ValueError(
            f"{len(shares)} shares for {len(seconds_per_sample)} members: give one "
            "share and one per-sample time per member"
        )
    compute = max(b * t for b, t in zip(shares, seconds_per_sample, strict=True))
    return compute + network.allreduce_seconds(len(shares), grad_bytes)


def synchronous_throughput(
    network: Network,
    n: int,
    per_device_batch: int,
    seconds_per_sample: float,
    grad_bytes: float,
) -> float:
    """Samples per second on ``n`` equal devices: ``n b / step`` with
    :func:`sync_step_seconds`'s step."""
    step = sync_step_seconds(
        network, [per_device_batch] * n, [seconds_per_sample] * n, grad_bytes
    )
    return n * per_device_batch / step


NETWORKS = {"wired": SwitchedEthernet, "wifi": WifiMedium}
"""Network kinds by name, with their cited defaults."""


def network_of(name: str) -> Network:
    """A network with its defaults by name; unknown names list the choices."""
    try:
        return NETWORKS[name]()  # type: ignore[no-any-return]
    except KeyError:
        raise ValueError(
            f"unknown network {name!r}; valid choices: {', '.join(NETWORKS)}"
        ) from None


# ------------------------------------------------------------------- rounds
@dataclass(frozen=True)
class RoundTask:
    """One node's part of a round: download, compute, upload."""

    node: int
    down_bytes: float
    compute_s: float
    up_bytes: float


@dataclass(frozen=True)
class TaskTimes:
    """When a task's download and upload finished (seconds from the push)."""

    down_s: float
    up_done_s: float

    def comm_s(self, compute_s: float) -> float:
        """Seconds not spent computing: everything but ``compute_s``."""
        return self.up_done_s - compute_s


def round_times(network: Network, tasks: Sequence[RoundTask]) -> list[TaskTimes]:
    """Replay a round's transfers on ``network`` (a fluid event simulation).

    Every download starts at 0; a node's upload starts ``compute_s`` after its
    download ends. Between events every active transfer moves at the rate the
    network gives the active set (:meth:`Network.rates_mbps`).
    """
    remaining: dict[tuple[int, str], float] = {}
    flows: dict[tuple[int, str], Flow] = {}
    pending: list[tuple[float, int]] = []  # (upload start, task index)
    down_done = [0.0] * len(tasks)
    up_done = [0.0] * len(tasks)
    for index, task in enumerate(tasks):
        if task.down_bytes > 0:
            remaining[(index, "down")] = task.down_bytes * 8 / 1e6
            flows[(index, "down")] = Flow(SERVER, task.node)
        else:
            pending.append((task.compute_s, index))
    now = 0.0
    while remaining or pending:
        keys_ = list(remaining)
        rates = network.rates_mbps([flows[k] for k in keys_])
        finish = min(
            (remaining[k] / r for k, r in zip(keys_, rates, strict=True) if r > 0),
            default=math.inf,
        )
        start = min((t for t, _ in pending), default=math.inf) - now
        step = min(finish, start)
        if math.isinf(step):
            raise RuntimeError("transfers stalled: the network gave no flow any rate")
        now += step
        for key, rate in zip(keys_, rates, strict=True):
            remaining[key] -= rate * step
            if remaining[key] <= 1e-12 * max(1.0, rate):
                del remaining[key]
                index, kind = key
                if kind == "down":
                    down_done[index] = now
                    pending.append((now + tasks[index].compute_s, index))
                else:
                    up_done[index] = now
        for start_at, index in [p for p in pending if p[0] <= now + 1e-12]:
            pending.remove((start_at, index))
            if tasks[index].up_bytes > 0:
                remaining[(index, "up")] = tasks[index].up_bytes * 8 / 1e6
                flows[(index, "up")] = Flow(tasks[index].node, SERVER)
            else:
                up_done[index] = now
    return [TaskTimes(d, u) for d, u in zip(down_done, up_done, strict=True)]


def _record_bytes(message: Message) -> float:
    return float(
        sum(
            len(array.data)
            for record in message.content.array_records.values()
            for array in record.values()
        )
    )


def charge_round(
    network: Network,
    messages: Sequence[Message],
    outcomes: list[tuple[Message, float]],
) -> list[tuple[Message, float]]:
    """The in-process engine's hook: re-time one push's train replies on ``network``.

    Each successful train reply's ``comm-time-s`` becomes the time its transfers
    took on the shared network (its ``train-time-s`` is the compute between
    them), and its arrival ``train-time-s + comm-time-s`` after the push. Other
    messages and error replies keep their times.
    """
    chosen = [
        i
        for i, (message, (reply, _)) in enumerate(zip(messages, outcomes, strict=True))
        if message.metadata.message_type == MessageType.TRAIN
        and not reply.has_error()
        and keys.METRICS in reply.content.metric_records
    ]
    if not chosen:
        return outcomes
    tasks = []
    for i in chosen:
        reply = outcomes[i][0]
        compute = reply.content.metric_records[keys.METRICS].get(keys.TRAIN_TIME_S, 0.0)
        tasks.append(
            RoundTask(
                node=messages[i].metadata.dst_node_id,
                down_bytes=_record_bytes(messages[i]),
                compute_s=float(compute) if isinstance(compute, int | float) else 0.0,
                up_bytes=_record_bytes(reply),
            )
        )
    out = list(outcomes)
    for i, task, times in zip(chosen, tasks, round_times(network, tasks), strict=True):
        reply = outcomes[i][0]
        reply.content.metric_records[keys.METRICS][keys.COMM_TIME_S] = times.comm_s(
            task.compute_s
        )
        out[i] = (reply, times.up_done_s)
    return out
