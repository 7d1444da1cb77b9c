"""The virtual clock's arithmetic, checked against hand computation."""

import math

import pytest
from flowerbed.sims import vclock
from flowerbed.sims.devices import PI4_SECONDS_PER_SAMPLE, DeviceProfile, get_device


def profile(**overrides: float) -> DeviceProfile:
    base = {
        "geekbench5_multi": 450.0,  # half a Pi 4B
        "downlink_mbps": 8.0,
        "uplink_mbps": 2.0,
        "idle_w": 1.0,
        "busy_w": 4.0,
        "dropout_prob": 0.1,
        "mean_online_s": 1000.0,
    }
    base.update(overrides)
    return DeviceProfile(name="test", description="test", **base)  # type: ignore[arg-type]


def test_half_a_pi4_takes_twice_as_long_per_sample() -> None:
    assert profile().relative_speed == pytest.approx(0.5)
    assert profile().seconds_per_sample == pytest.approx(2 * PI4_SECONDS_PER_SAMPLE)


def test_step_time_is_batch_times_seconds_per_sample_times_model_cost() -> None:
    dev = profile()
    # 16 samples x (2 x 3.0815 ms) x 0.5 = 49.30 ms
    assert vclock.step_seconds(dev, 16, 0.5) == pytest.approx(
        16 * dev.seconds_per_sample * 0.5
    )
    assert vclock.step_seconds(dev, 16, 0.5) == pytest.approx(0.049304, rel=1e-4)


def test_transfer_time_is_bits_over_bandwidth() -> None:
    # 1,000,000 bytes = 8 Mbit: 1 s at 8 Mbit/s, 4 s at 2 Mbit/s
    assert vclock.transfer_seconds(1_000_000, 8.0) == pytest.approx(1.0)
    assert vclock.transfer_seconds(1_000_000, 2.0) == pytest.approx(4.0)


def test_deadline_leaves_room_for_communication_then_whole_steps() -> None:
    # 10 s deadline, 5 s of communication, 2 s per step: 2 whole steps fit
    assert vclock.max_steps_within(10.0, 5.0, 2.0) == 2
    assert vclock.max_steps_within(9.0, 5.0, 2.0) == 2
    assert vclock.max_steps_within(6.9, 5.0, 2.0) == 0
    assert vclock.max_steps_within(4.0, 5.0, 2.0) == 0


def test_energy_is_busy_power_while_computing_plus_idle_power_while_talking() -> None:
    # 4 W x 3 s + 1 W x 5 s = 17 J
    assert vclock.energy_joules(profile(), compute_s=3.0, comm_s=5.0) == pytest.approx(
        17.0
    )


def test_drop_probability_adds_session_end_to_per_task_faults() -> None:
    dev = profile()
    # 0.1 + 0.9 x (1 - e^-1) for a task as long as the mean session
    expected = 0.1 + 0.9 * (1 - math.exp(-1.0))
    assert vclock.drop_probability(dev, 1000.0, -1.0) == pytest.approx(expected)
    assert vclock.drop_probability(dev, 0.0, -1.0) == pytest.approx(0.1)
    assert vclock.drop_probability(dev, 1000.0, 0.25) == 0.25


def test_task_streams_repeat_for_the_same_task_and_differ_between_tasks() -> None:
    a = vclock.task_rng(1, 2, 3, 0).random()
    assert vclock.task_rng(1, 2, 3, 0).random() == a
    assert vclock.task_rng(1, 2, 4, 0).random() != a
    assert vclock.task_rng(2, 2, 3, 0).random() != a


def test_catalogue_device_costs_follow_the_formula() -> None:
    pixel, low = get_device("pixel-7"), get_device("low-end-phone")
    assert pixel.seconds_per_sample * 10 == pytest.approx(low.seconds_per_sample)
