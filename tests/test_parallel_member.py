"""A member's disk store and its timing/emulation wrapper."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from flowerbed.models import count_macs
from flowerbed.parallel.emulation import DeviceSpeed, TimedModule
from flowerbed.parallel.store import OWN, REPLICA, LayerStore, layer_of, split_by_layer
from torch import nn


def state(layers: range, value: float) -> dict[str, torch.Tensor]:
    out = {}
    for layer in layers:
        out[f"{layer}.weight"] = torch.full((2, 2), value)
        out[f"momentum:{layer}.weight"] = torch.full((2, 2), -value)
    return out


def test_the_store_finds_each_layer_at_a_step_among_own_and_replica(
    tmp_path: Path,
) -> None:
    store = LayerStore(tmp_path, "job")
    store.save(OWN, 10, range(3, 6), state(range(3, 6), 1.0))
    store.save(REPLICA, 10, range(0, 3), state(range(0, 3), 2.0))
    store.save(OWN, 15, range(3, 6), state(range(3, 6), 3.0))
    got = store.load([2, 4], 10)
    assert sorted(got) == [
        "2.weight",
        "4.weight",
        "momentum:2.weight",
        "momentum:4.weight",
    ]
    assert got["2.weight"][0, 0] == 2.0 and got["4.weight"][0, 0] == 1.0
    assert store.load([4], 15)["4.weight"][0, 0] == 3.0
    assert store.holds(1, 10) and not store.holds(1, 15)
    assert store.consistent_steps() == [10]
    with pytest.raises(KeyError, match=r"layers \[0, 1\] at step 15"):
        store.load([0, 1, 4], 15)
    store.prune([15])
    assert [e.step for e in store.entries()] == [15]
    assert not list(tmp_path.glob("job/.tmp-*"))


def test_a_state_outside_the_named_layers_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"layers \[7\] outside range\(3, 6\)"):
        LayerStore(tmp_path, "job").save(OWN, 0, range(3, 6), state(range(7, 8), 0.0))


def test_state_names_map_to_top_level_layers() -> None:
    assert layer_of("3.0.weight") == 3 and layer_of("momentum:11.bias") == 11
    assert sorted(split_by_layer(state(range(2), 0.0))) == [0, 1]
    with pytest.raises(ValueError, match=r"nn\.Sequential"):
        layer_of("features.0.weight")


def test_timed_module_leaves_gradients_unchanged() -> None:
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    twin = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    twin.load_state_dict(inner.state_dict())
    x = torch.randn(4, 6)
    TimedModule(inner)(x).square().sum().backward()
    twin(x).square().sum().backward()
    for a, b in zip(inner.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_an_emulated_device_takes_at_least_its_flops_over_its_rate() -> None:
    inner = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    x = torch.randn(8, 64)
    macs = count_macs(inner, x)
    assert macs == 8 * (64 * 64 + 64 * 10)
    # 2 FLOPs per MAC forward, 4 backward: at 20 MFLOP/s this forward takes
    # 2 * 37,888 / 2e7 = 3.8 ms and the backward 7.6 ms, far above real compute.
    speed = DeviceSpeed(flops_per_s=2e7)
    timed = TimedModule(inner, speed)
    timed(x).sum().backward()
    assert timed.forward_s[0] >= 2 * macs / 2e7
    assert timed.backward_s[0] >= 4 * macs / 2e7
    assert len(timed.forward_s) == len(timed.backward_s) == 1


def test_a_device_can_slow_down_from_a_step_on() -> None:
    speed = DeviceSpeed(flops_per_s=1e9, slow_from_step=40, slow_factor=10)
    assert speed.rate_at(39) == 1e9 and speed.rate_at(40) == 1e8
    assert speed.forward_s(1e6, 40) == pytest.approx(2e6 / 1e8)
    with pytest.raises(ValueError, match="flops_per_s must be > 0"):
        DeviceSpeed(flops_per_s=0)
    with pytest.raises(ValueError, match="slow_factor must be >= 1"):
        DeviceSpeed(flops_per_s=1, slow_factor=0.5)
