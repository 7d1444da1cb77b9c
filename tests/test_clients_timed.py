"""Timed, deadline-bound training and its metrics, on a fake clock where it matters."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from flowerbed import keys
from flowerbed.clients.timed import (
    PowerSampler,
    TimedTraining,
    TrainingMeter,
    energy_j,
    timed_train,
)
from flowerbed.models import build_model


class FakeClock:
    """Monotonic time that only moves when the code under test sleeps."""

    def __init__(self, start: float) -> None:
        self.t = start
        self.slept: list[float] = []

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.t += seconds


def jetson_nano(root: Path, milliwatts: int) -> None:
    iio = root / "sys/bus/i2c/drivers/ina3221x/6-0040/iio:device0"
    iio.mkdir(parents=True)
    (iio / "rail_name_0").write_text("POM_5V_IN")
    (iio / "in_power0_input").write_text(str(milliwatts))
    zone = root / "sys/class/thermal/thermal_zone0"
    zone.mkdir(parents=True)
    (zone / "type").write_text("CPU-therm")
    (zone / "temp").write_text("51500")


def tiny_data(n: int = 40) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.random((n, 1, 8, 8), dtype=np.float32), rng.integers(0, 10, n)


def test_energy_is_mean_power_times_duration() -> None:
    assert energy_j(4.0, 2.5) == 10.0
    with pytest.raises(ValueError, match="seconds"):
        energy_j(4.0, -1.0)


def test_metrics_hold_wire_keys_and_derived_throughput() -> None:
    done = TimedTraining(
        num_steps=4,
        num_examples=64,
        train_time_s=2.0,
        mean_loss=0.5,
        stopped_by_deadline=False,
        power_w=5.0,
        energy_j=10.0,
        temp_c=60.0,
    )
    assert done.metrics() == {
        keys.NUM_EXAMPLES: 64,
        keys.NUM_STEPS: 4,
        keys.TRAIN_TIME_S: 2.0,
        keys.SAMPLES_PER_S: 32.0,  # 64 samples / 2 s
        keys.TRAIN_LOSS: 0.5,
        keys.POWER_W: 5.0,
        keys.ENERGY_J: 10.0,
        keys.TEMP_C: 60.0,
    }


def test_unmeasured_values_are_left_out_not_zero() -> None:
    done = TimedTraining(0, 0, 0.5, math.nan, True)
    assert done.metrics() == {
        keys.NUM_EXAMPLES: 0,
        keys.NUM_STEPS: 0,
        keys.TRAIN_TIME_S: 0.5,
    }


def test_deadline_counts_from_when_the_task_was_sent() -> None:
    clock = FakeClock(100.0)
    # Sent at t=97 with a 10 s deadline: 7 s are left on entry at t=100. Each step
    # first sleeps 2 s (the slowdown), the last sleep is cut to the 1 s left:
    # steps after t=102, 104, 106; the check at t=107 stops the loop.
    meter = TrainingMeter(
        deadline_s=10.0,
        started_at=97.0,
        slowdown_s=2.0,
        clock=clock.now,
        sleep=clock.sleep,
    )
    with meter:
        while not meter.should_stop():
            meter.count_step(8)
    result = meter.result()
    assert clock.slept == [2.0, 2.0, 2.0, 1.0]
    assert (result.num_steps, result.num_examples) == (3, 24)
    assert result.stopped_by_deadline
    assert result.train_time_s == 7.0
    # It waited 3 s for the task before training: the reply says so.
    assert result.metrics()[keys.START_WAIT_S] == 3.0


def test_a_task_received_after_its_deadline_does_no_work_and_says_why() -> None:
    clock = FakeClock(100.0)
    meter = TrainingMeter(deadline_s=10.0, started_at=88.0, clock=clock.now)
    with meter:
        assert meter.should_stop()
    metrics = meter.result().metrics()
    assert metrics[keys.NUM_STEPS] == 0
    assert metrics[keys.START_WAIT_S] == 12.0


def test_no_deadline_means_never_stop_early() -> None:
    meter = TrainingMeter(deadline_s=0.0)
    with meter:
        assert meter.remaining_s() == math.inf
        assert not meter.should_stop()


def test_timed_train_does_all_steps_without_deadline(tmp_path: Path) -> None:
    x, y = tiny_data()
    model = build_model("lenet", 1, 8, 10)
    done = timed_train(model, x, y, steps=5, batch_size=8, lr=0.1, root=tmp_path)
    assert (done.num_steps, done.num_examples) == (5, 40)
    assert not done.stopped_by_deadline
    assert done.power_w is None and done.energy_j is None and done.temp_c is None
    assert set(done.metrics()) == {
        keys.NUM_EXAMPLES,
        keys.NUM_STEPS,
        keys.TRAIN_TIME_S,
        keys.SAMPLES_PER_S,
        keys.TRAIN_LOSS,
    }


def one_second_steps(
    root: Path, steps: int, deadline_s: float | None = None
) -> TimedTraining:
    """``timed_train`` of LeNet on ``tiny_data()`` for ``steps`` steps of 8 at
    lr 0.1, each step slowed by 1 s of a fake clock that starts at 0, with the
    deadline ``deadline_s`` (None: none) and the device files under ``root``."""
    clock = FakeClock(0.0)
    x, y = tiny_data()
    return timed_train(
        build_model("lenet", 1, 8, 10),
        x,
        y,
        steps=steps,
        batch_size=8,
        lr=0.1,
        deadline_s=deadline_s,
        slowdown_s=1.0,
        root=root,
        clock=clock.now,
        sleep=clock.sleep,
    )


def test_timed_train_stops_at_deadline_with_partial_work(tmp_path: Path) -> None:
    # 1 s per step and a 3.5 s deadline: steps after t=1, 2, 3; stop at t=3.5.
    done = one_second_steps(tmp_path, steps=100, deadline_s=3.5)
    assert (done.num_steps, done.num_examples) == (3, 24)
    assert done.stopped_by_deadline
    assert done.train_time_s == 3.5
    # Without a started_at of its own the deadline counts from entry: no wait.
    assert keys.START_WAIT_S not in done.metrics()


def test_timed_train_meters_board_power_and_temperature(tmp_path: Path) -> None:
    jetson_nano(tmp_path, milliwatts=4520)
    done = one_second_steps(tmp_path, steps=2)
    assert done.train_time_s == 2.0
    assert done.power_w == pytest.approx(4.52)
    assert done.energy_j == pytest.approx(9.04)  # 4.52 W x 2 s
    assert done.temp_c == pytest.approx(51.5)
    metrics = done.metrics()
    assert metrics[keys.POWER_W] == pytest.approx(4.52)
    assert metrics[keys.ENERGY_J] == pytest.approx(9.04)


def test_power_sampler_averages_its_samples() -> None:
    readings = iter([2.0, 4.0, 9.0, 9.0, 9.0])

    def reader(_root: object) -> dict[str, float | int | str]:
        return {"power-w": next(readings)}

    # A long interval: only the entry and exit samples are taken.
    with PowerSampler(interval_s=60.0, reader=reader) as sampler:
        pass
    assert sampler.samples == [2.0, 4.0]
    assert sampler.mean_w == 3.0


def test_power_sampler_without_power_reading_reports_none() -> None:
    with PowerSampler(reader=lambda _root: {}) as sampler:
        pass
    assert sampler.mean_w is None and sampler.samples == []


def test_negative_slowdown_is_refused() -> None:
    with pytest.raises(ValueError, match="slowdown_s"):
        TrainingMeter(slowdown_s=-1.0)


def test_helpers_are_importable_from_the_package() -> None:
    import flowerbed.clients as clients

    assert clients.timed_train is timed_train
    assert clients.TrainingMeter is TrainingMeter
    with pytest.raises(AttributeError, match="no_such_helper"):
        _ = clients.no_such_helper
