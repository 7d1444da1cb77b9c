"""The virtual clock: how long a task would have taken on a given device.

A simulated node trains for real on this machine's CPU but reports the time, energy
and failures its device would have had. One formula per cost (FedScale,
``client_metadata.py``: compute = samples x seconds-per-sample, communication =
bytes / bandwidth):

    step_s    = batch_size x seconds_per_sample(device) x cost_factor(model)
    down_s    = model_bytes x 8 / (downlink_mbps x 1e6)
    up_s      = model_bytes x 8 / (uplink_mbps x 1e6)
    compute_s = steps_done x step_s
    total_s   = down_s + compute_s + up_s
    energy_j  = busy_w x compute_s + idle_w x (down_s + up_s)

With a deadline D (``deadline-s``, measured from dispatch) a node takes at most
floor((D - down_s - up_s) / step_s) steps and reports that partial work. When not
one step fits and the server sent ``min-batch-size`` m, it takes one step of
b' = floor((D - down_s - up_s) / (step_s / batch_size)) samples if b' >= m.
"""

from __future__ import annotations

import math
import re

import numpy as np
from flowerbed.sims.devices import DeviceProfile

_DROPOUT_TAG = re.compile(r" ?\[flowerbed-dropout silent=([01]) after-s=([^\]]+)\]")


class NodeDropout(Exception):
    """A simulated node failed during its task.

    ``silent``: the node vanished and never replies (the engine lets the message's
    TTL expire). Otherwise the node reports an error ``after_s`` virtual seconds
    after dispatch.

    Its text ends in a tag carrying ``silent`` and ``after_s``, so that where the
    exception only survives as text -- Flower's simulation engine turns it into an
    error reply's reason -- :meth:`from_text` recovers it
    (:class:`flowerbed.sims.virtual_grid.VirtualTimeGrid` does).
    """

    def __init__(self, reason: str, *, silent: bool, after_s: float) -> None:
        super().__init__(
            f"{reason} [flowerbed-dropout silent={int(silent)} after-s={after_s!r}]"
        )
        self.reason = reason
        self.silent = silent
        self.after_s = after_s

    def __reduce__(self) -> tuple[object, ...]:
        return (_dropout, (self.reason, self.silent, self.after_s))

    @classmethod
    def from_text(cls, text: str) -> NodeDropout | None:
        """The dropout whose text ``text`` contains, or None."""
        found = _DROPOUT_TAG.search(text)
        if found is None:
            return None
        # Flower prefixes "...Exception ClientAppException occurred. Message: "
        reason = text[: found.start()].splitlines()[-1].rpartition("Message: ")[2]
        silent, after_s = found.groups()
        return cls(reason, silent=silent == "1", after_s=float(after_s))


def _dropout(reason: str, silent: bool, after_s: float) -> NodeDropout:
    return NodeDropout(reason, silent=silent, after_s=after_s)


def transfer_seconds(num_bytes: int, mbps: float) -> float:
    """Seconds to move ``num_bytes`` at ``mbps`` megabits per second."""
    return num_bytes * 8.0 / (mbps * 1e6)


def step_seconds(device: DeviceProfile, batch_size: int, cost_factor: float) -> float:
    """Virtual seconds of one optimiser step of ``batch_size`` samples."""
    return batch_size * device.seconds_per_sample * cost_factor


def max_steps_within(deadline_s: float, comm_s: float, step_s: float) -> int:
    """Steps that fit in a deadline after the model has travelled both ways."""
    budget = deadline_s - comm_s
    if budget <= 0:
        return 0
    return math.floor(budget / step_s + 1e-9)


def max_batch_within(deadline_s: float, comm_s: float, sample_s: float) -> int:
    """Samples one step can take within a deadline after the model has travelled
    both ways (``sample_s``: seconds per sample, ``step_s / batch_size``)."""
    budget = deadline_s - comm_s
    if budget <= 0 or sample_s <= 0:
        return 0
    return math.floor(budget / sample_s + 1e-9)


def energy_joules(device: DeviceProfile, compute_s: float, comm_s: float) -> float:
    """Energy of one task: busy power while computing, idle power while talking."""
    return device.busy_w * compute_s + device.idle_w * comm_s


def drop_probability(
    device: DeviceProfile, duration_s: float, override: float
) -> float:
    """Probability that a task of ``duration_s`` fails.

    A per-task fault (``dropout_prob``, or ``override`` when >= 0) or the end of the
    node's online session during the task, sessions being exponential with mean
    ``mean_online_s`` (memoryless, an assumption):
    p = p_task + (1 - p_task) x (1 - exp(-duration_s / mean_online_s)).
    With an override the session term is left out, so the override is the rate.
    """
    if override >= 0:
        return override
    p_task = device.dropout_prob
    return p_task + (1 - p_task) * (1 - math.exp(-duration_s / device.mean_online_s))


def task_rng(
    seed: int, partition_id: int, server_round: int, kind: int
) -> np.random.Generator:
    """The random stream of one task, the same on every engine for the same seed."""
    return np.random.default_rng([seed, partition_id, server_round, kind])
