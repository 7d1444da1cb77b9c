"""Device catalogue and fleet mixes."""

from collections import Counter

import pytest
from flowerbed.sims.devices import DEVICES, get_device
from flowerbed.sims.fleet import FLEETS, assign_devices

REQUIRED = [
    "rpi3b",
    "rpi4b",
    "rpi5",
    "jetson-nano",
    "low-end-phone",
    "galaxy-s10",
    "pixel-7",
]


def test_catalogue_has_the_required_device_classes() -> None:
    assert set(REQUIRED) <= set(DEVICES)


@pytest.mark.parametrize("name", REQUIRED)
def test_every_number_names_its_source(name: str) -> None:
    dev = DEVICES[name]
    assert {"geekbench5_multi", "bandwidth", "power", "availability"} <= set(
        dev.sources
    )
    assert all(len(text) > 20 for text in dev.sources.values())
    assert dev.busy_w > dev.idle_w > 0
    assert 0 <= dev.dropout_prob < 1 and dev.mean_online_s > 0
    assert dev.uplink_mbps > 0 and dev.downlink_mbps > 0


def test_phones_10x_spans_exactly_ten_times() -> None:
    speeds = [get_device(n).relative_speed for n in FLEETS["phones-10x"]]
    assert max(speeds) / min(speeds) == pytest.approx(10.0)


def test_fleet_counts_follow_the_mix_by_largest_remainder() -> None:
    counts = Counter(d.name for d in assign_devices("phones-10x", 10, seed=1))
    assert counts == {"low-end-phone": 4, "galaxy-s10": 3, "pixel-7": 3}
    # 7 nodes of a 40/30/30 mix: 2.8/2.1/2.1 -> 3/2/2
    counts = Counter(d.name for d in assign_devices("phones-10x", 7, seed=1))
    assert counts == {"low-end-phone": 3, "galaxy-s10": 2, "pixel-7": 2}


def test_assignment_is_seeded() -> None:
    a = [d.name for d in assign_devices("mixed", 20, seed=3)]
    assert a == [d.name for d in assign_devices("mixed", 20, seed=3)]
    assert a != [d.name for d in assign_devices("mixed", 20, seed=4)]


def test_uniform_fleet_is_one_device() -> None:
    assert {d.name for d in assign_devices("uniform", 5, seed=0)} == {"rpi4b"}


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: assign_devices("nope", 5, 0), "valid choices: uniform, phones-10x"),
        (lambda: assign_devices("mixed", 0, 0), "num-nodes must be >= 1"),
        (lambda: get_device("iphone"), "valid choices: rpi3b"),
    ],
)
def test_bad_names_list_the_valid_choices(call, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        call()
