"""Timed training with a deadline and power metering, for any ClientApp.

The board ClientApp (:mod:`flowerbed.clients.board_app`) trains through
:func:`timed_train`; a user's own ``@app.train()`` can call it too, or wrap its own
loop in a :class:`TrainingMeter`, and report the same wire keys
(``num-examples``, ``num-steps``, ``train-time-s``, ``samples-per-s``, and where
the board can measure them ``power-w``, ``energy-j``, ``temp-c``)::

    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
    from flowerbed.clients import timed_train

    @app.train()
    def train(msg, context):
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        cfg = msg.content["config"]
        done = timed_train(model, x, y, steps=int(cfg.get("local-steps", 10)),
                           batch_size=32, lr=0.05,
                           deadline_s=float(cfg.get("deadline-s", 0)) or None)
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                              "metrics": MetricRecord(done.metrics())})
        return Message(content, reply_to=msg)
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from flowerbed import keys
from flowerbed.clients import telemetry
from flowerbed.clients.training import train_steps
from torch import nn

DEFAULT_POWER_INTERVAL_S = 0.5
"""Seconds between power samples while training (INA3221 updates every ~0.1 s)."""


class PowerSampler:
    """Sample board power in a background thread; report the mean.

    A sample is taken on entry, every ``interval_s`` while running, and on exit.
    When the board cannot measure power (no reading on entry) no thread starts and
    :attr:`mean_w` stays ``None``.
    """

    def __init__(
        self,
        root: str | Path = "/",
        interval_s: float = DEFAULT_POWER_INTERVAL_S,
        reader: Callable[[str | Path], telemetry.Telemetry] = telemetry.read_power,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.root = root
        self.interval_s = interval_s
        self._reader = reader
        self._samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> bool:
        value = self._reader(self.root).get(telemetry.POWER_W)
        if isinstance(value, int | float) and math.isfinite(value):
            self._samples.append(float(value))
            return True
        return False

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> PowerSampler:
        if self._sample():
            self._thread = threading.Thread(
                target=self._run, name="flowerbed-power", daemon=True
            )
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._sample()

    @property
    def samples(self) -> list[float]:
        """Power readings taken so far (W)."""
        return list(self._samples)

    @property
    def mean_w(self) -> float | None:
        """Mean of the samples (W), or ``None`` when power is not measurable."""
        return sum(self._samples) / len(self._samples) if self._samples else None


def energy_j(mean_power_w: float, seconds: float) -> float:
    """Energy of a task: mean power x duration.

    E = integral of P dt ~= mean(P) x T, with P sampled at a fixed interval (the
    rectangle rule). Strubell, Ganesh, McCallum, "Energy and Policy Considerations
    for Deep Learning in NLP", ACL 2019, Sec. 2, estimate training energy the same
    way: average power draw times training time.
    """
    if seconds < 0:
        raise ValueError(f"seconds must be >= 0, got {seconds}")
    return mean_power_w * seconds


@dataclass(frozen=True)
class TimedTraining:
    """What a timed training task did, and the reply metrics it makes."""

    num_steps: int
    num_examples: int
    train_time_s: float
    mean_loss: float
    stopped_by_deadline: bool
    power_w: float | None = None
    energy_j: float | None = None
    temp_c: float | None = None
    start_wait_s: float | None = None

    @property
    def samples_per_s(self) -> float | None:
        """Throughput: ``num_examples / train_time_s`` (None for an empty task)."""
        if self.train_time_s <= 0 or self.num_examples == 0:
            return None
        return self.num_examples / self.train_time_s

    def metrics(self) -> dict[str, int | float]:
        """Reply metrics under the wire keys; unmeasured values are left out."""
        out: dict[str, int | float] = {
            keys.NUM_EXAMPLES: self.num_examples,
            keys.NUM_STEPS: self.num_steps,
            keys.TRAIN_TIME_S: self.train_time_s,
        }
        optional: dict[str, float | None] = {
            keys.SAMPLES_PER_S: self.samples_per_s,
            keys.TRAIN_LOSS: self.mean_loss if self.num_steps else None,
            keys.POWER_W: self.power_w,
            keys.ENERGY_J: self.energy_j,
            keys.TEMP_C: self.temp_c,
            keys.START_WAIT_S: self.start_wait_s,
        }
        out.update({k: v for k, v in optional.items() if v is not None})
        return out


class TrainingMeter:
    """Time a training loop, hold it to a deadline and meter its power.

    Use it around your own loop::

        with TrainingMeter(deadline_s=cfg_deadline) as meter:
            for xb, yb in batches:
                if meter.should_stop():
                    break
                ...  # one optimiser step
                meter.count_step(len(xb))
        metrics = meter.result(mean_loss=loss).metrics()

    Parameters
    ----------
    deadline_s : float, optional
        Stop once this many seconds have passed since ``started_at``. ``None`` or
        a value <= 0 means no deadline.
    started_at : float, optional
        ``time.monotonic()`` value the deadline counts from (for example when the
        message arrived); default: entering the meter.
    root : str or Path, default "/"
        Filesystem root for the power and temperature readers.
    power_interval_s : float, default 0.5
        Seconds between power samples.
    slowdown_s : float, default 0
        Extra seconds slept before each step, capped at the deadline. A test aid
        that turns a fast machine into a slow board; leave 0 in production.
    clock, sleep : callables, default ``time.monotonic``, ``time.sleep``
        Time source and sleep of the deadline and duration (tests pass fakes).
    """

    def __init__(
        self,
        deadline_s: float | None = None,
        started_at: float | None = None,
        root: str | Path = "/",
        power_interval_s: float = DEFAULT_POWER_INTERVAL_S,
        slowdown_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if slowdown_s < 0:
            raise ValueError(f"slowdown_s must be >= 0, got {slowdown_s}")
        self.deadline_s = deadline_s if deadline_s and deadline_s > 0 else None
        self.started_at = started_at
        self.root = root
        self.slowdown_s = slowdown_s
        self._clock = clock
        self._sleep = sleep
        self._power = PowerSampler(root, power_interval_s)
        self._t0 = 0.0
        self._t1: float | None = None
        self._origin_given = started_at is not None
        self.num_steps = 0
        self.num_examples = 0
        self.stopped_by_deadline = False

    def __enter__(self) -> TrainingMeter:
        self._t0 = self._clock()
        if self.started_at is None:
            self.started_at = self._t0
        self._power.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._t1 = self._clock()
        self._power.__exit__(*exc_info)

    def remaining_s(self) -> float:
        """Seconds left before the deadline (``inf`` without one)."""
        if self.deadline_s is None:
            return math.inf
        now = self._clock()
        start = self.started_at if self.started_at is not None else now
        return start + self.deadline_s - now

    def should_stop(self, _steps_done: int = 0) -> bool:
        """True once the deadline has passed; sleeps ``slowdown_s`` first.

        The signature fits :func:`flowerbed.clients.training.train_steps`'s
        ``should_stop``.
        """
        if self.slowdown_s > 0:
            self._sleep(max(0.0, min(self.slowdown_s, self.remaining_s())))
        if self.remaining_s() <= 0:
            self.stopped_by_deadline = True
        return self.stopped_by_deadline

    def count_step(self, num_examples: int) -> None:
        """Record one optimiser step over ``num_examples`` samples."""
        self.num_steps += 1
        self.num_examples += num_examples

    @property
    def start_wait_s(self) -> float | None:
        """Seconds from ``started_at`` to entering the meter (None without both a
        deadline and a ``started_at`` of the caller's)."""
        if self.deadline_s is None or not self._origin_given:
            return None
        assert self.started_at is not None
        return max(0.0, self._t0 - self.started_at)

    @property
    def elapsed_s(self) -> float:
        """Seconds inside the meter (up to now while still running)."""
        end = self._t1 if self._t1 is not None else self._clock()
        return end - self._t0

    def result(self, mean_loss: float = math.nan) -> TimedTraining:
        """The finished task, with power, energy and temperature where measurable."""
        seconds = self.elapsed_s
        mean_w = self._power.mean_w
        temp = telemetry.read_temperature(self.root).get(telemetry.TEMP_C)
        return TimedTraining(
            num_steps=self.num_steps,
            num_examples=self.num_examples,
            train_time_s=seconds,
            mean_loss=mean_loss,
            stopped_by_deadline=self.stopped_by_deadline,
            power_w=mean_w,
            energy_j=energy_j(mean_w, seconds) if mean_w is not None else None,
            temp_c=float(temp) if isinstance(temp, int | float) else None,
            start_wait_s=self.start_wait_s,
        )


def timed_train(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int = 0,
    deadline_s: float | None = None,
    started_at: float | None = None,
    root: str | Path = "/",
    slowdown_s: float = 0.0,
    proximal_mu: float = 0.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> TimedTraining:
    """Train up to ``steps`` SGD steps or until the deadline, whichever comes first.

    The loop is :func:`flowerbed.clients.training.train_steps` (so ``num-steps``
    and ``num-examples`` mean what they mean on every flowerbed node, and
    ``proximal_mu`` adds FedProx's proximal term), wrapped in a
    :class:`TrainingMeter`. Parameters are those of both; see there.

    Before the clock starts, an optimiser is built once and dropped: the first
    ``torch.optim`` optimiser of a process imports ``torch._dynamo``, seconds of
    one-off work on a board (Flower starts a fresh ClientApp process per message)
    that would otherwise be counted as training time.

    Returns
    -------
    TimedTraining
        ``.metrics()`` gives the reply's MetricRecord content.
    """
    torch.optim.SGD(model.parameters(), lr=lr)
    with TrainingMeter(
        deadline_s=deadline_s,
        started_at=started_at,
        root=root,
        slowdown_s=slowdown_s,
        clock=clock,
        sleep=sleep,
    ) as meter:
        stats = train_steps(
            model,
            x,
            y,
            steps=steps,
            batch_size=batch_size,
            lr=lr,
            seed=seed,
            should_stop=meter.should_stop,
            proximal_mu=proximal_mu,
        )
        meter.num_steps = stats.num_steps
        meter.num_examples = stats.num_examples
    return meter.result(mean_loss=stats.mean_loss)
