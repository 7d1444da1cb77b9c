"""The ``tiles`` mode of the boards' span ClientApp: run, profile, evaluate.

:func:`run` (train messages) builds this member's part of the plan
(:class:`~flowerbed.parallel.tiles.exact_step.TiledMember`: the exact tiled step,
described there), joins the segment's gloo group and trains ``plan.steps``
steps on the job's data, every member reading the same batches
(:class:`JobData`); rank 0 replies with the whole model and its momentum, every
member with its measurements. A lost peer ends the segment with ``span-ok = 0``
(:class:`~flowerbed.parallel.group.PeerFailure`), never a hang. :func:`profile`
(query messages) measures the board's training speed on the model's first
layers and its free memory, for the planner; :func:`evaluate` (evaluate
messages) evaluates the whole model on one board.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Mapping
from logging import INFO
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from flowerbed import keys
from flowerbed.models import count_macs
from flowerbed.system import available_memory
from flwr.supercore import log
from torch import nn

from ..group import PeerFailure, joined_group
from ..job_data import batch_indices, load_job_dataset
from ..member import (
    MemberContext,
    MemberResult,
    MetricValue,
    load_module_state,
    mean_or_zero,
    median_or_zero,
    plan_optimizer,
    plan_training,
    segment_result,
)
from ..plan import MemberPlan, PlanError
from ..setup_time import SetupClock
from ..user_code import build_layers
from .exact_step import (
    INPUT_SHAPE,
    TiledMember,
    TileSettings,
    settings_of,
)
from .layout import layout
from .region_ops import front_geometry
from .regions import TileError
from .speed import two_point_rate

__all__ = ["MODE", "SYNTHETIC", "JobData", "evaluate", "prepare", "profile", "run"]

MODE = "tiles"
SYNTHETIC = "synthetic"
"""Dataset name: Gaussian images and uniform labels drawn per step from
``(seed, step)`` (timing runs at sizes no offline dataset has)."""


# --------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------


class JobData:
    """The batch of a global step: a built-in dataset or synthetic images."""

    def __init__(self, name: str, shape: tuple[int, int, int], classes: int) -> None:
        self.name, self.shape, self.classes = name, shape, classes
        self.x: np.ndarray | None = None
        self.y: np.ndarray | None = None
        if name != SYNTHETIC:
            data = load_job_dataset(name)
            if tuple(data.x_train.shape[1:]) != shape:
                raise PlanError(
                    f"dataset {name!r} has samples of shape "
                    f"{list(data.x_train.shape[1:])}, the plan's input is {list(shape)}"
                )
            self.x, self.y = data.x_train, data.y_train

    def batch(
        self, seed: int, step: int, size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.x is None or self.y is None:
            rng = np.random.default_rng((seed, step))
            x = rng.standard_normal((size, *self.shape), dtype=np.float32)
            y = rng.integers(0, self.classes, size)
        else:
            idx = batch_indices(seed, step, len(self.y), size)
            x, y = self.x[idx], self.y[idx]
        return (
            torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)),
            torch.from_numpy(np.asarray(y, dtype=np.int64)),
        )


def _peak_rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


# --------------------------------------------------------------------------------
# The runner (train messages), profiler (query) and evaluator
# --------------------------------------------------------------------------------


def prepare(
    plan: MemberPlan, context: MemberContext
) -> tuple[TiledMember, torch.optim.Optimizer, TileSettings]:
    """Build this member's part of the plan (raises PlanError/TileError)."""
    settings = settings_of(plan)
    model = _layers(plan.model, plan.model_args, plan.seed)
    geometry = front_geometry(model, settings.input_shape, settings.norm, costs=False)
    plan_layout = layout(geometry, settings.bounds, settings.weights, settings.bands)
    training, loss_fn = plan_training(plan)
    member = TiledMember(
        model, plan_layout, plan.rank, settings, speed=context.speed, loss_fn=loss_fn
    )
    optimizer = plan_optimizer(training, plan, member.modules().parameters())
    return member, optimizer, settings


def _layers(
    name: str, args: Mapping[str, Any] | None, seed: int | None
) -> nn.Sequential:
    """The job's layered model; a name that cannot be built or cut is a PlanError."""
    try:
        return build_layers(name, args, seed)  # type: ignore[no-any-return]
    except ValueError as err:
        raise PlanError(f"model: {err}") from None


def run(
    plan: MemberPlan, context: MemberContext, arrays: Mapping[str, np.ndarray]
) -> MemberResult:
    """Run one segment of a tile job (module docstring)."""
    clock = SetupClock.begin()
    arrived = clock.arrived
    member, optimizer, settings = prepare(plan, context)
    load_module_state(member.modules(), optimizer, arrays)
    data = JobData(
        plan.dataset or SYNTHETIC, settings.input_shape, settings.num_classes
    )
    step = plan.start_step
    done = 0
    failure = ""
    lost: tuple[int, ...] = ()
    setup = 0.0
    try:
        with joined_group(plan, context.address) as join_s:
            clock.joined(join_s)
            setup = clock.ready()
            log(
                INFO,
                "tiles %s segment %d: rank %d of %d, steps %d-%d; %s",
                plan.job,
                plan.segment,
                plan.rank,
                plan.world_size,
                plan.start_step,
                plan.end_step - 1,
                clock.describe(),
            )
            for k in range(plan.steps):
                step = plan.start_step + k
                x, y = data.batch(plan.seed, step, plan.batch_size)
                member.step(x, y, optimizer, step)
                done += 1
    except PeerFailure as err:
        failure = f"{err.phase}: {err}"
        lost = err.lost_ranks
    metrics = metrics_of(plan, member, done, step, failure, arrived, setup)
    weights = member.modules() if member.rank == 0 else None
    return segment_result(metrics, failure, lost, clock.metrics(), weights, optimizer)


def metrics_of(
    plan: MemberPlan,
    member: TiledMember,
    done: int,
    step: int,
    failure: str,
    arrived: float,
    setup: float,
) -> dict[str, MetricValue]:
    ok = not failure
    s = member.stats
    steady = slice(1, None) if len(s.step_s) > 1 else slice(None)
    metrics: dict[str, MetricValue] = {
        keys.SPAN_OK: int(ok),
        keys.NUM_STEPS: done,
        keys.NUM_EXAMPLES: done * plan.batch_size,
        keys.TRAIN_TIME_S: time.monotonic() - arrived,
        keys.SPAN_SETUP_S: setup,
        keys.SPAN_STEP_S: mean_or_zero(s.step_s[steady]),
        keys.SPAN_OVERRUN_S: s.overrun_s,
        keys.SPAN_FAILED_STEP: -1 if ok else step,
        keys.TILES_COMPUTE_S: median_or_zero(s.compute_s[steady]),
        keys.TILES_LINK_S: median_or_zero(s.link_s[steady]),
        keys.TILES_LINK_BYTES: median_or_zero(s.link_bytes[steady]),
        keys.TILES_MACS: member.step_macs(plan.batch_size),
        keys.TILES_ACTIVATION_BYTES: s.activation_bytes,
        keys.TILES_PEAK_RSS_BYTES: _peak_rss_bytes(),
    }
    if s.losses:
        metrics[keys.TRAIN_LOSS] = float(np.mean(s.losses))
    return metrics


def profile(query: Mapping[str, Any], context: MemberContext) -> MemberResult:
    """Measure this board's training speed on the model's first layers.

    Query keys: ``model``, ``model_args``, ``input-shape``, ``profile-size``
    (side of the square crop timed, default 64; half that size is timed too),
    ``repeats`` (default 3), ``step`` (global step, for an emulated speed
    schedule). Replies ``tiles-speed`` (forward MACs per second of forward +
    backward, the planner's ``v``: the slope between the two crop sizes, so
    the fixed cost of a call is not counted as slowness,
    :mod:`~flowerbed.parallel.tiles.speed`) and ``tiles-memory-bytes`` (memory
    available now).
    """
    model = _layers(str(query.get("model", "")), query.get("model_args"), None)
    shape = query.get(INPUT_SHAPE)
    if not isinstance(shape, list) or len(shape) != 3:
        raise PlanError(f"query {INPUT_SHAPE!r} must be [channels, h, w]")
    side = int(query.get("profile-size", 64))
    repeats = max(1, int(query.get("repeats", 3)))
    step = int(query.get("step", 0))
    geometry = front_geometry(model, shape, costs=False)
    if geometry.tileable < 1:
        raise TileError(
            f"no layer of model {query.get('model')!r} can be tiled: {geometry.stop}"
        )
    probe = nn.Sequential(*list(model)[: min(2, geometry.tileable)])
    overrun = 0.0
    timings: list[tuple[float, float]] = []
    # Two crop sizes: the line through them separates the cost per MAC (the
    # planner's speed) from the fixed cost of a call (tiles.speed).
    for crop in (max(8, side // 2), side):
        x = torch.randn(
            (1, int(shape[0]), min(crop, int(shape[1])), min(crop, int(shape[2])))
        )
        macs = count_macs(probe, x)
        seconds: list[float] = []
        for _ in range(repeats + 1):  # the first pass warms up allocations
            begin = time.perf_counter()
            probe(x).square().mean().backward()
            real = time.perf_counter() - begin
            target = 0.0
            if context.speed is not None:
                target = context.speed.forward_s(macs, step) + context.speed.backward_s(
                    macs, step
                )
            if target > real:
                time.sleep(target - real)
            else:
                overrun += real - target if context.speed is not None else 0.0
            seconds.append(max(real, target))
        timings.append((float(macs), max(median_or_zero(seconds[1:]), 1e-9)))
    small, large = sorted(timings)
    rate, _ = two_point_rate(small, large)
    metrics: dict[str, MetricValue] = {
        keys.SPAN_OK: 1,
        keys.TILES_SPEED: rate,
        keys.TILES_MEMORY_BYTES: float(available_memory()),
        keys.SPAN_OVERRUN_S: overrun,
    }
    return MemberResult(ok=True, metrics=metrics)


def evaluate(
    query: Mapping[str, Any], context: MemberContext, arrays: Mapping[str, np.ndarray]
) -> MemberResult:
    """Evaluate the whole model on this board (one device) on the dataset's test
    split: ``eval-samples`` samples (default all). Replies accuracy and loss."""
    del context
    model = _layers(str(query.get("model", "")), query.get("model_args"), None)
    dataset = str(query.get("dataset", ""))
    if not dataset or dataset == SYNTHETIC:
        raise PlanError(
            "evaluation needs a built-in dataset with a test split, got "
            f"{dataset or 'none'!r}"
        )
    data = load_job_dataset(dataset)
    limit = int(query.get("eval-samples", 0)) or len(data.y_test)
    load_module_state(model, None, arrays, strict=True)
    model.eval()
    x = torch.from_numpy(np.ascontiguousarray(data.x_test[:limit], dtype=np.float32))
    y = torch.from_numpy(np.asarray(data.y_test[:limit], dtype=np.int64))
    begin = time.monotonic()
    with torch.no_grad():
        logits = model(x)
        loss = float(F.cross_entropy(logits, y))
        accuracy = float((logits.argmax(1) == y).float().mean())
    metrics: dict[str, MetricValue] = {
        keys.SPAN_OK: 1,
        "accuracy": accuracy,
        "loss": loss,
        keys.NUM_EXAMPLES: len(y),
        keys.EVAL_TIME_S: time.monotonic() - begin,
    }
    return MemberResult(ok=True, metrics=metrics)
