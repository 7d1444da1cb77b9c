"""Links as objects: Ethernet, Wi-Fi (Bianchi's DCF), ring all-reduce, rounds."""

from __future__ import annotations

import math

import pytest
from flowerbed.models import charged_costs
from flowerbed.sims.devices import get_device
from flowerbed.sims.links import (
    SERVER,
    Flow,
    Network,
    RoundTask,
    SwitchedEthernet,
    UsbEthernetAdapter,
    WifiMedium,
    ethernet_goodput_mbps,
    network_of,
    progressive_filling,
    ring_allreduce_seconds,
    round_times,
    sync_step_seconds,
    synchronous_throughput,
)

GBE = 1000 * 1448 / 1538  # TCP goodput of gigabit Ethernet, Mbit/s


def test_ring_allreduce_by_hand() -> None:
    # 2 * 3/4 * 8e6 bits / 1e8 bit/s = 1.5 * 0.08 = 0.12 s, plus 2 * 3 * 1 ms
    assert ring_allreduce_seconds(4, 1e6, 100.0, 1e-3) == pytest.approx(0.126)
    assert ring_allreduce_seconds(1, 1e6, 100.0, 1e-3) == 0.0
    with pytest.raises(ValueError, match="at least one device"):
        ring_allreduce_seconds(0, 1e6, 100.0, 0.0)
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        ring_allreduce_seconds(2, 1e6, math.nan, 0.0)
    with pytest.raises(ValueError, match="latency must be >= 0"):
        ring_allreduce_seconds(2, 1e6, 100.0, -1.0)


def test_one_ring_formula_for_the_simulator_and_the_tile_cost_model() -> None:
    """The same 4 devices, 1 MB, 100 Mbit/s (12.5 MB/s), 1 ms: 0.126 s both ways."""
    from flowerbed.parallel import collectives
    from flowerbed.parallel.tiles.grouping import Cluster

    assert ring_allreduce_seconds is collectives.ring_allreduce_seconds
    cluster = Cluster(speeds=(1.0,) * 4, link_bytes_per_s=12.5e6, latency_s=1e-3)
    assert cluster.ring_s(1e6) == pytest.approx(0.126)
    assert Cluster(speeds=(1.0,)).ring_s(1e6) == 0.0


def test_ethernet_goodput_and_usb_adapters() -> None:
    assert ethernet_goodput_mbps(1000) == pytest.approx(941.48, abs=0.01)
    assert UsbEthernetAdapter("3.0").goodput_mbps == pytest.approx(GBE)
    # USB 2.0: 13 x 512 bytes per 125 us microframe
    assert UsbEthernetAdapter("2.0").goodput_mbps == pytest.approx(425.984)
    with pytest.raises(ValueError, match=r"valid choices: 2\.0, 3\.0"):
        UsbEthernetAdapter("1.1")


def test_a_switch_shares_the_server_port_and_the_backplane() -> None:
    net = SwitchedEthernet()
    down = [Flow(SERVER, 1), Flow(SERVER, 2), Flow(3, SERVER)]
    assert net.rates_mbps(down) == pytest.approx([GBE / 2, GBE / 2, GBE])
    # a 2 Gbit/s backplane among 4 devices all sending: 500 Mbit/s each
    small = SwitchedEthernet(backplane_gbps=2.0)
    assert small.allreduce_seconds(4, 1e6) == pytest.approx(
        2 * 3 / 4 * 8e6 / 500e6 + 6 * 100e-6
    )
    with pytest.raises(ValueError, match="backplane_gbps must be > 0"):
        SwitchedEthernet(backplane_gbps=0)


def test_progressive_filling_by_hand() -> None:
    # flow 0 is capped at 1; the other two split what is left of 12: 5.5 each
    assert progressive_filling([1, 10, 10], [(12, [0, 1, 2])]) == pytest.approx(
        [1, 5.5, 5.5]
    )
    # two resources: flows 0,1 share 4; flows 1,2 share 10 -> 2, 2, 8
    got = progressive_filling([100, 100, 100], [(4, [0, 1]), (10, [1, 2])])
    assert got == pytest.approx([2, 2, 8])


def test_bianchi_single_station_by_hand() -> None:
    """One station: tau = 2 / (W + 1) = 2/17, no collisions.

    PPDU = 44 + 64 x 1544 x 8 / 866.7 us; T_s = PPDU + 16 + 32 + 34;
    S = tau L / ((1 - tau) 9 + tau T_s), L = 64 x 1448 x 8 bits.
    """
    wifi = WifiMedium()
    tau = 2 / 17
    assert wifi.transmit_probability(1) == pytest.approx(tau)
    t_s = 44 + 64 * 1544 * 8 / 866.7 + 16 + 32 + 34
    assert wifi.success_us == pytest.approx(t_s)
    expected = tau * 64 * 1448 * 8 / ((1 - tau) * 9 + tau * t_s)
    assert wifi.saturation_mbps(1) == pytest.approx(expected)
    assert 660 < expected < 680


def test_bianchi_fixed_point_and_contention_loss() -> None:
    wifi = WifiMedium()
    for k in (2, 10, 138):
        tau = wifi.transmit_probability(k)
        p = 1 - (1 - tau) ** (k - 1)
        series = sum((2 * p) ** i for i in range(6))
        assert tau == pytest.approx(2 / (1 + 16 + p * 16 * series), rel=1e-9)
    rates = [wifi.saturation_mbps(k) for k in (2, 8, 32, 138)]
    assert rates == sorted(rates, reverse=True)  # collisions cost airtime


def test_wifi_airtime_is_split_among_senders_and_the_ap_is_one() -> None:
    wifi = WifiMedium()
    flows = [Flow(SERVER, 1), Flow(SERVER, 2), Flow(SERVER, 3), Flow(4, SERVER)]
    share = wifi.saturation_mbps(2) / 2
    assert wifi.rates_mbps(flows) == pytest.approx([share / 3] * 3 + [share])
    # all-reduce among n stations: S(n) / n each, one T_s of latency per message
    n, nbytes = 8, 4e6
    expected = 2 * 7 / 8 * nbytes * 8 / (wifi.saturation_mbps(8) / 8 * 1e6)
    expected += 2 * 7 * wifi.success_us * 1e-6
    assert wifi.allreduce_seconds(n, nbytes) == pytest.approx(expected)


def test_a_round_replayed_on_a_switch_by_hand() -> None:
    """Two 1 MB downloads share the server port (16 Mbit at G: both end at 16/G);
    the node computing 0.1 s uploads alone (8/G), the other 0.9 s later."""
    g = GBE
    times = round_times(
        SwitchedEthernet(),
        [RoundTask(1, 1e6, 0.1, 1e6), RoundTask(2, 1e6, 1.0, 1e6)],
    )
    assert times[0].down_s == pytest.approx(16 / g)
    assert times[0].up_done_s == pytest.approx(16 / g + 0.1 + 8 / g)
    assert times[1].up_done_s == pytest.approx(16 / g + 1.0 + 8 / g)
    assert times[0].comm_s(0.1) == pytest.approx(24 / g)
    # equal compute: the uploads overlap and share the port too
    both = round_times(
        SwitchedEthernet(), [RoundTask(1, 1e6, 0.0, 1e6), RoundTask(2, 1e6, 0.0, 1e6)]
    )
    assert [t.up_done_s for t in both] == pytest.approx([32 / g, 32 / g])


def test_unknown_network_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="valid choices: wired, wifi"):
        network_of("carrier-pigeon")


def test_s1_wired_scales_and_wifi_stops_from_cited_parameters() -> None:
    """S1 (Na et al., arXiv 2110.12172): near-linear on wired Ethernet up to 138
    phones; a wireless cluster stops scaling at tens of phones. Galaxy S10+ from
    the catalogue, Goyal et al.'s 32 samples per device, published model sizes."""
    phone = get_device("galaxy-s10plus")
    for model in ("mobilenet-v1", "resnet-50"):
        factor, grad_bytes = charged_costs(model)
        per_sample = phone.seconds_per_sample * factor

        wired, wifi = SwitchedEthernet(), WifiMedium()

        def throughput(
            net: Network, n: int, f: float = per_sample, b: float = grad_bytes
        ) -> float:
            return synchronous_throughput(net, n, 32, f, b)

        alone = throughput(wired, 1)
        assert throughput(wired, 138) / (138 * alone) > 0.9, model
        assert throughput(wifi, 138) / (138 * alone) < 0.35, model
        # 64 -> 138 phones adds less than a fifth on Wi-Fi
        assert throughput(wifi, 138) < 1.2 * throughput(wifi, 64), model


def test_the_in_process_engine_charges_a_round_to_the_shared_switch() -> None:
    """Two equal phones on one switch: downloads share the server port (2 x 8b/G
    Mbit), both compute c, uploads share it again: arrival 16b/G + c + 16b'/G."""
    from flowerbed import keys
    from flowerbed.models import build_model
    from flowerbed.sims.scenario import build_fleet_grid
    from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict

    grid = build_fleet_grid(
        {"dropout": 0.0, "local-steps": 2, "batch-size": 8, "num-nodes": 2},
        ["galaxy-s10plus", "galaxy-s10plus"],
    )
    grid.network = SwitchedEthernet()
    arrays = ArrayRecord(build_model("lenet", 1, 8, 10).state_dict())
    sent = sum(len(a.data) for a in arrays.values())
    messages = [
        Message(
            RecordDict({keys.ARRAYS: arrays, keys.CONFIG: ConfigRecord()}),
            node,
            "train",
            group_id="1",
        )
        for node in grid.get_node_ids()
    ]
    replies = list(grid.send_and_receive(messages))
    assert len(replies) == 2
    back = sum(len(a.data) for a in replies[0].content[keys.ARRAYS].values())
    compute = replies[0].content[keys.METRICS][keys.TRAIN_TIME_S]
    expected = 16 * sent / 1e6 / GBE + compute + 16 * back / 1e6 / GBE
    assert grid.clock.now() == pytest.approx(expected)
    for reply in replies:
        m = reply.content[keys.METRICS]
        assert m[keys.TRAIN_TIME_S] + m[keys.COMM_TIME_S] == pytest.approx(expected)


def test_a_synchronous_step_waits_for_the_slowest_share_then_all_reduces() -> None:
    """Two members, 10 and 40 ms per sample. Equal shares of 8: the slow one
    takes 0.32 s; shares by speed (13, 3) take max(0.13, 0.12) = 0.13 s; then the
    ring all-reduce of 1 MB on the switch."""
    net = SwitchedEthernet()
    ring = ring_allreduce_seconds(2, 1e6, net.device_mbps, net.latency_s)
    assert sync_step_seconds(net, [8, 8], [0.01, 0.04], 1e6) == pytest.approx(
        0.32 + ring
    )
    assert sync_step_seconds(net, [13, 3], [0.01, 0.04], 1e6) == pytest.approx(
        0.13 + ring
    )
    with pytest.raises(ValueError, match="2 shares for 1 members"):
        sync_step_seconds(net, [8, 8], [0.01], 1e6)
