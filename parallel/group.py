"""Joining a fresh gloo process group for one segment, and failing fast.

A gloo group cannot shrink (docs/references.md, "torch.distributed and gloo"), so
every segment (and every retry after a loss) starts a new group on a new
rendezvous port. Rank 0 hosts the rendezvous (a
``torch.distributed.TCPStore``) on its advertised address; every member binds
gloo to its own advertised address (so a board with several interfaces, or a
Debian host name resolving to 127.0.1.1, still works without
``GLOO_SOCKET_IFNAME``).

Two timeouts, both from the plan:

- ``join_timeout_s`` bounds the rendezvous: a member that never arrives (its board
  died before the segment, or its Flower message came late) makes the others
  raise :class:`PeerFailure` after this long;
- ``timeout_s`` bounds every collective and send/receive afterwards: a peer that
  dies mid-segment surfaces at once as "Connection closed by peer" on its
  neighbours (their processes then exit and close their own connections, so the
  failure cascades along the pipeline in milliseconds), and a peer that hangs
  surfaces after ``timeout_s``. (gloo takes every operation's timeout from
  ``init_process_group``'s, which also bounds its rendezvous, and ignores
  ``pg_options``' timeout; so the join is a barrier on the store first.)

:func:`joined_group` turns both into :class:`PeerFailure`; a rendezvous port that
is in use, or an advertised address that is not this board's, is a
:class:`RendezvousError` (the plan is wrong, no peer is lost).

Which peer was lost: gloo's error names a socket, not a rank. So every member
keeps a *liveness port* open on its advertised address for as long as its
process lives (:func:`liveness_port`; a thread accepts and closes each
connection) and publishes it in the segment's store when it joins. A member
that loses a peer connects to every peer's liveness port (:func:`probe_peers`,
at most :data:`LIVENESS_PROBE_S` each, all at once): a refused or unanswered
connection means that peer's process (or board) is gone (when none is, the
probe is repeated a few times within a second: a process being killed may close
its gloo connections before its liveness port), and its rank goes into
the :class:`PeerFailure` (``lost_ranks``) and the reply, so the server need not
wait for Flower's heartbeat to learn it. A peer that is alive but busy still
answers (the kernel completes the connection).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from .plan import MemberPlan

log = logging.getLogger(__name__)

GLOO_FAILURE_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Timed out",
    "timed out",
    "Broken pipe",
    "Connection refused",
    "Socket Timeout",
)
"""Substrings of gloo/c10d errors that mean a peer is gone or unresponsive."""
STORE_GRACE_S = 5.0
"""Seconds beyond the join timeout before a silent rendezvous counts as lost."""
LIVENESS_PROBE_S = 1.0
"""Seconds a connection to a peer's liveness port may take before the peer counts
as gone (on a LAN a live board answers in milliseconds; a process that died is
refused at once, a board without power does not answer)."""
LIVENESS_RECHECKS = 3
"""Probes after the first, :data:`LIVENESS_RECHECK_S` apart, when the first finds
no peer gone: a process being killed closes its gloo connections and its
liveness port one after the other, and its peers may probe in between."""
LIVENESS_RECHECK_S = 0.25
LIVENESS_KEY = "flowerbed/alive/{rank}"
"""Store key under which a member publishes its liveness address and port."""

_listeners: dict[str, socket.socket] = {}
_listeners_lock = threading.Lock()


class RendezvousError(RuntimeError):
    """The plan's rendezvous cannot be used here (port taken, foreign address)."""


class PeerFailure(RuntimeError):
    """A peer died or did not answer within the plan's timeout.

    ``phase`` says where it happened (``join``, ``setup``, ``train``,
    ``replicate`` ...), ``step`` the global step in progress (-1 if none).
    """

    def __init__(
        self,
        message: str,
        *,
        phase: str,
        step: int = -1,
        lost_ranks: tuple[int, ...] = (),
    ) -> None:
        super().__init__(message)
        self.phase = phase
        self.step = step
        self.lost_ranks = lost_ranks
        """Ranks found gone by :func:`probe_peers` (empty: none found, or not
        probed, as in a failed join)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (tests, local runs)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def segment_port(first: int, count: int, segment: int) -> int:
    """The rendezvous port of ``segment``: round-robin over ``first .. first+count-1``.

    Consecutive segments use different ports, so a group that is still being torn
    down never collides with the next one. Deployment guides open this range.
    """
    if count < 1 or not 1 <= first <= 65535 - count + 1:
        raise ValueError(
            f"rendezvous ports {first}..{first + count - 1} are outside 1..65535"
        )
    return first + segment % count


def check_bindable(host: str, port: int) -> None:
    """Raise :class:`RendezvousError` unless this machine can listen on host:port.

    Tells a port in use apart from an address that is not one of this board's.
    """
    try:
        with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise RendezvousError(
                f"rendezvous port {port} on {host} is in use: another program (or "
                "a previous segment still closing) holds it; the server retries on "
                "the next port of its range"
            ) from err
        if err.errno == errno.EADDRNOTAVAIL:
            raise RendezvousError(
                f"advertised address {host} is not an address of this machine "
                f"({err.strerror}): set node_config 'address' to this board's IP "
                "on the network its peers share"
            ) from err
        raise RendezvousError(f"cannot listen on {host}:{port}: {err}") from err


def liveness_port(address: str) -> int:
    """This process's liveness port on ``address``, opened on first use and kept
    open until the process exits (module doc). Raises :class:`RendezvousError`
    when ``address`` is not this machine's."""
    with _listeners_lock:
        sock = _listeners.get(address)
        if sock is None:
            sock = socket.socket(_family(address), socket.SOCK_STREAM)
            try:
                sock.bind((address, 0))
                sock.listen(64)
            except OSError as err:
                sock.close()
                raise RendezvousError(
                    f"cannot open a liveness port on {address}: {err}"
                ) from err
            threading.Thread(
                target=_answer, args=(sock,), name="span-liveness", daemon=True
            ).start()
            _listeners[address] = sock
        return int(sock.getsockname()[1])


def close_liveness(address: str) -> None:
    """Close this process's liveness port on ``address``: from now on its peers
    find it gone (a process that is stopping and will not reply)."""
    with _listeners_lock:
        sock = _listeners.pop(address, None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()


def _answer(sock: socket.socket) -> None:
    """Accept and close every connection: being there is the answer."""
    while True:
        try:
            conn, _ = sock.accept()
        except OSError:
            return
        conn.close()


def probe_peers(
    peers: Mapping[int, tuple[str, int]], timeout: float = LIVENESS_PROBE_S
) -> dict[int, str]:
    """The ranks of ``peers`` (rank -> liveness host and port) that are gone, with
    why: the connection was refused, failed, or took over ``timeout`` seconds.
    All peers are probed at once, so this takes at most about ``timeout``."""
    gone: dict[int, str] = {}

    def probe(rank: int, host: str, port: int) -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                pass
        except TimeoutError:
            gone[rank] = f"{host}:{port} did not answer within {timeout:g} s"
        except OSError as err:
            gone[rank] = f"{host}:{port} {_os_reason(err)}"

    threads = [
        threading.Thread(target=probe, args=(rank, host, port), daemon=True)
        for rank, (host, port) in peers.items()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 1.0)
    return dict(sorted(gone.items()))


def find_lost(
    peers: Mapping[int, tuple[str, int]],
    rechecks: int = LIVENESS_RECHECKS,
    pause_s: float = LIVENESS_RECHECK_S,
) -> dict[int, str]:
    """:func:`probe_peers`, repeated up to ``rechecks`` times ``pause_s`` apart
    while it finds no peer gone (see :data:`LIVENESS_RECHECKS`)."""
    gone = probe_peers(peers)
    for _ in range(rechecks):
        if gone or not peers:
            break
        time.sleep(pause_s)
        gone = probe_peers(peers)
    return gone


def close_all_liveness() -> None:
    """Close every liveness port of this process (it is about to end)."""
    for address in list(_listeners):
        close_liveness(address)


def describe_lost(gone: Mapping[int, str]) -> str:
    """``gone`` (rank -> why) as a clause of a failure message."""
    if not gone:
        return (
            "every peer's process still answers (one hung, or left on a failure "
            "of its own)"
        )
    return "gone: " + "; ".join(
        f"rank {rank} ({why})" for rank, why in sorted(gone.items())
    )


def _os_reason(err: OSError) -> str:
    if isinstance(err, ConnectionRefusedError):
        return "refused the connection: its process is gone"
    return f"cannot be reached: {err.strerror or err}"


def is_peer_failure(err: BaseException) -> bool:
    """Whether a torch.distributed error means a lost or unresponsive peer."""
    text = str(err)
    return any(marker in text for marker in GLOO_FAILURE_MARKERS)


@contextlib.contextmanager
def joined_group(plan: MemberPlan, address: str) -> Iterator[float]:
    """Join a fresh gloo group for ``plan`` as ``address``; leave it on exit.

    The block is given the seconds the rendezvous took (from the call until
    every member had arrived and the group formed).

    Inside the block, torch.distributed's default group is this segment's group.
    Errors from torch.distributed that mean a lost peer are re-raised as
    :class:`PeerFailure` with ``phase="train"`` unless a more specific
    :class:`PeerFailure` was raised inside.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError(
            "a torch.distributed group is already active in this process"
        )
    if plan.rank == 0:
        check_bindable(plan.host, plan.port)
        if address != plan.host:
            raise RendezvousError(
                f"rank 0 advertises {address} but the plan's rendezvous host is "
                f"{plan.host}"
            )
    join = datetime.timedelta(seconds=plan.join_timeout_s)
    operation = datetime.timedelta(seconds=plan.timeout_s)
    started = time.monotonic()
    alive_port = liveness_port(address)
    try:
        store = _connect_store(plan, join)
        # The join is a barrier on the store, bounded by the join timeout:
        # init_process_group's own timeout bounds both its rendezvous and every
        # later operation of the group (gloo ignores pg_options' timeout), so it
        # gets the operation timeout, and by then every member is there.
        store.set(
            LIVENESS_KEY.format(rank=plan.rank),
            json.dumps([address, alive_port]),
        )
        store.set(f"flowerbed/arrived/{plan.rank}", "1")
        store.wait([f"flowerbed/arrived/{r}" for r in range(plan.world_size)], join)
        peers = _peer_liveness(store, plan)
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        options._timeout = operation
        dist.init_process_group(
            "gloo",
            store=store,
            rank=plan.rank,
            world_size=plan.world_size,
            timeout=operation,
            pg_options=options,
        )
    except PeerFailure:
        raise
    except RuntimeError as err:
        if "EADDRINUSE" in str(err) or "address already in use" in str(err):
            raise RendezvousError(
                f"rendezvous port {plan.port} on {plan.host} is in use"
            ) from err
        waited = time.monotonic() - started
        raise PeerFailure(
            f"could not join the group of {plan.world_size} at {plan.host}:{plan.port} "
            f"as rank {plan.rank} within {waited:.1f} s (join timeout "
            f"{plan.join_timeout_s:g} s): a member did not arrive ({_short(err)})",
            phase="join",
        ) from err
    try:
        yield time.monotonic() - started
    except PeerFailure as err:
        if err.lost_ranks or err.phase == "join":
            raise
        gone = find_lost(peers)
        raise PeerFailure(
            f"{err}; {describe_lost(gone)}",
            phase=err.phase,
            step=err.step,
            lost_ranks=tuple(gone),
        ) from err
    except (SystemExit, KeyboardInterrupt):
        # The process is being stopped (Flower's SIGINT when its SuperNode is
        # gone): it will not reply, so stop answering for it before the group's
        # connections close and the peers probe.
        close_liveness(address)
        raise
    except RuntimeError as err:
        if is_peer_failure(err):
            gone = find_lost(peers)
            raise PeerFailure(
                f"rank {plan.rank} lost a peer: {_short(err)}; {describe_lost(gone)}",
                phase="train",
                lost_ranks=tuple(gone),
            ) from err
        raise
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        del store


def _peer_liveness(store: Any, plan: MemberPlan) -> dict[int, tuple[str, int]]:
    """Every other member's liveness address (published before it arrived)."""
    peers: dict[int, tuple[str, int]] = {}
    for rank in range(plan.world_size):
        if rank != plan.rank:
            host, port = json.loads(store.get(LIVENESS_KEY.format(rank=rank)))
            peers[rank] = (str(host), int(port))
    return peers


def _connect_store(plan: MemberPlan, join: datetime.timedelta) -> Any:
    """The segment's TCPStore (rank 0 hosts it), or :class:`PeerFailure`.

    torch's client waits without bound when the port is held by a program that
    accepts connections but does not speak the store's protocol, so the connect
    runs in a daemon thread given ``join_timeout_s`` (plus a little) to finish.
    """
    import torch.distributed as dist

    found: dict[str, Any] = {}

    def connect() -> None:
        try:
            found["store"] = dist.TCPStore(
                plan.host,
                plan.port,
                plan.world_size,
                is_master=plan.rank == 0,
                timeout=join,
                wait_for_workers=False,
            )
        except BaseException as err:  # handed to the caller's thread
            found["error"] = err

    thread = threading.Thread(target=connect, name="span-rendezvous", daemon=True)
    thread.start()
    thread.join(plan.join_timeout_s + STORE_GRACE_S)
    if thread.is_alive():
        raise PeerFailure(
            f"the rendezvous at {plan.host}:{plan.port} did not answer within "
            f"{plan.join_timeout_s:g} s: rank 0 is not there, or another program "
            "holds that port",
            phase="join",
        )
    if "error" in found:
        raise found["error"]
    return found["store"]


def _short(err: BaseException) -> str:
    """The first line of a c10d error, without its C++ source location."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". This is typically", 1)[0][:300]


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
