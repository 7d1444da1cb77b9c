"""A member of a pipeline job: profile the layers, run a segment of K steps.

The engine is ``torch.distributed.pipelining``: the member wraps its layers
(``plan.layers``, full-model names kept) in a :class:`PipelineStage` with static
input/output metadata (no shape inference: docs/references.md,
"torch.distributed and gloo") and runs ``Schedule1F1B`` or ``ScheduleGPipe``
once per step, then its optimiser (SGD with optional momentum and weight
decay, or the job's own: :class:`~flowerbed.parallel.user_code.Training`, as is
the loss). With the flush per step, K steps on p
members give exactly the weights of K steps of single-process training on the
same batches (loss averaged over the micro-batches, ``scale_grads``).

A segment, in order:

1. join the segment's gloo group (:func:`~flowerbed.parallel.group.joined_group`);
2. gather this member's layers at ``start_step`` from their sources
   (:class:`~flowerbed.parallel.plan.LayerSource`): its own disk store, a peer
   (sent over torch.distributed, pairs in a fixed global order so no two members
   wait on each other), or the arrays in the message (the central copy); save
   them as its own state at ``start_step``;
3. the first stage broadcasts the segment's labels (the last stage needs them);
4. K steps; after every step ``t`` with ``t % R == 0`` (but not the last) each
   member sends its state to its ring successor and keeps its predecessor's,
   both saved at ``t`` (FTPipeHD's neighbour replication, with the ring closed so
   the last stage's copy also lives on a peer);
5. save its state at the end step and reply with it (the central copy).

A lost peer at any point ends the segment with ``span-ok = 0``, the step in
progress (``span-failed-step``) and the member's store listing
(``span-holds``), from which the strategy picks the restart step.

:func:`profile` times every layer's forward and backward on one micro-batch
(median of ``repeats``), through the same emulation as a segment.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Mapping
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flowerbed import keys
from flowerbed.models import layer_shapes
from flwr.supercore import log
from torch import nn

from ..emulation import TimedModule
from ..group import PeerFailure, joined_group
from ..job_data import batch_indices, load_job_dataset
from ..member import (
    MemberContext,
    MemberResult,
    MetricValue,
    load_module_state,
    mean_or_zero,
    median_or_zero,
    module_state,
    plan_optimizer,
    plan_training,
    recv_state,
    segment_result,
    send_state,
)
from ..plan import SOURCE_CENTRAL, SOURCE_PEER, SOURCE_SELF, MemberPlan, PlanError
from ..setup_time import SetupClock
from ..store import OWN, REPLICA, LayerStore, State, layer_of
from ..user_code import Training, build_layers

INPUT_SHAPE = "input-shape"
"""Plan/query option: the shape of one sample (e.g. ``[1, 32, 32]``)."""
LOCAL_DATASET = "local"
"""Job dataset name meaning: the first stage's board reads its own data."""
CRASH_EXIT_CODE = 137
"""Exit code of the ``crash_at_step`` test aid (as after SIGKILL)."""
KEEP_REPLICATIONS = 2
"""Replication steps kept on disk (the newest two: a member that lost a peer in
the middle of an exchange still finds the previous one everywhere)."""


# --------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------


def _input_shape(options: Mapping[str, Any]) -> tuple[int, ...]:
    shape = options.get(INPUT_SHAPE)
    if (
        not isinstance(shape, list | tuple)
        or not shape
        or not all(isinstance(v, int) and v > 0 for v in shape)
    ):
        raise PlanError(f"option {INPUT_SHAPE!r} must list positive ints: {shape!r}")
    return tuple(shape)


def stage_module(model: nn.Sequential, layers: range) -> nn.Sequential:
    """The layers ``layers`` of ``model`` as a Sequential keeping their indices as
    names, so its ``state_dict`` uses the whole model's names."""
    return nn.Sequential(OrderedDict((str(i), model[i]) for i in layers))


def _layers(name: str, args: Mapping[str, Any] | None) -> nn.Sequential:
    """The job's layered model (:func:`~flowerbed.parallel.user_code.build_layers`);
    a name that cannot be built or cut is a :class:`PlanError`."""
    try:
        return build_layers(name, args)  # type: ignore[no-any-return]
    except ValueError as err:
        raise PlanError(f"plan model: {err}") from None


def _holds(store: LayerStore) -> list[int]:
    flat: list[int] = []
    for entry in store.entries():
        flat += [entry.step, entry.first, entry.stop]
    return flat


def job_data(dataset: str, context: MemberContext) -> tuple[np.ndarray, np.ndarray]:
    """Training data of the first stage: the board's own or a built-in dataset."""
    if dataset == LOCAL_DATASET:
        if context.local_data is None:
            raise PlanError(
                "the job's dataset is 'local' but this board has no node_config "
                "'dataset-path'"
            )
        return context.local_data()
    data = load_job_dataset(dataset)
    return data.x_train, data.y_train


# --------------------------------------------------------------------------------
# Profiling
# --------------------------------------------------------------------------------


def profile(query: Mapping[str, Any], context: MemberContext) -> MemberResult:
    """Time each layer's forward and backward on one micro-batch (module doc).

    Query keys: ``model``, ``model_args``, ``micro_batch``, ``input-shape``,
    ``repeats`` (default 3), ``step`` (global step, for a speed schedule),
    ``dataset`` (tells whether this board can feed the first stage).
    """
    model = _layers(str(query.get("model", "")), query.get("model_args"))
    shape = _input_shape(query)
    micro = int(query.get("micro_batch", 1))
    repeats = max(1, int(query.get("repeats", 3)))
    step = int(query.get("step", 0))
    if micro < 1:
        raise PlanError(f"micro_batch must be >= 1, got {micro}")
    layer_shapes(model, torch.zeros((1, *shape)))  # every layer must be cuttable
    timed = [TimedModule(layer, context.speed) for layer in model]
    for t in timed:
        t.step = step
    x = torch.randn((micro, *shape))
    for _ in range(repeats + 1):  # the first pass warms up allocations
        out = x
        for t in timed:
            out = t(out)
        out.float().square().mean().backward()
    forward = [median_or_zero(t.forward_s[1:]) for t in timed]
    backward = [median_or_zero(t.backward_s[1:]) for t in timed]
    dataset = str(query.get("dataset", ""))
    has_data = dataset != LOCAL_DATASET or context.local_data is not None
    metrics: dict[str, MetricValue] = {
        keys.SPAN_OK: 1,
        keys.SPAN_LAYER_FORWARD_S: forward,
        keys.SPAN_LAYER_BACKWARD_S: backward,
        keys.SPAN_OVERRUN_S: sum(t.overrun_s for t in timed),
    }
    return MemberResult(ok=True, metrics=metrics, info={"has-data": int(has_data)})


# --------------------------------------------------------------------------------
# A segment
# --------------------------------------------------------------------------------


def _gather_sources(
    plan: MemberPlan,
    store: LayerStore,
    arrays: Mapping[str, np.ndarray],
) -> tuple[State, int]:
    """This member's layers at ``plan.start_step``; also sends what peers need.

    Returns the state and the bytes received from peers.
    """
    sources = {s.layer: s for s in plan.sources}
    num_layers = plan.partition[-1]
    missing = [layer for layer in range(num_layers) if layer not in sources]
    if missing:
        raise PlanError(f"the plan gives no source for layers {missing}")

    def owner(layer: int) -> int:
        for rank in range(plan.world_size):
            if layer in plan.layers_of(rank):
                return rank
        raise PlanError(f"layer {layer} outside the partition")

    received: State = {}
    moved = 0
    pairs = sorted(
        {(s.rank, owner(s.layer)) for s in plan.sources if s.kind == SOURCE_PEER}
    )
    for src, dst in pairs:
        wanted = sorted(
            s.layer
            for s in plan.sources
            if s.kind == SOURCE_PEER and s.rank == src and owner(s.layer) == dst
        )
        if src == dst:
            raise PlanError(f"layers {wanted} would move from rank {src} to itself")
        if plan.rank == src:
            send_state(store.load(wanted, plan.start_step), dst)
        elif plan.rank == dst:
            got = recv_state(src)
            moved += sum(t.numel() * t.element_size() for t in got.values())
            received.update(got)
    state: State = {}
    for layer in plan.layers:
        source = sources[layer]
        if source.step != plan.start_step:
            raise PlanError(
                f"layer {layer}'s source is at step {source.step}, the segment starts "
                f"at {plan.start_step}"
            )
        if source.kind == SOURCE_SELF:
            try:
                state.update(store.load([layer], plan.start_step))
            except KeyError as err:
                raise PlanError(str(err.args[0])) from None
        elif source.kind == SOURCE_PEER:
            state.update({k: v for k, v in received.items() if layer_of(k) == layer})
        elif source.kind == SOURCE_CENTRAL:
            state.update(
                {
                    k: torch.from_numpy(np.array(v))
                    for k, v in arrays.items()
                    if layer_of(k) == layer
                }
            )
    # A layer missing from the result (and holding state) is named when the
    # state is loaded into the stage.
    return state, moved


class _Segment:
    """Bookkeeping of one segment on one member."""

    def __init__(self, plan: MemberPlan) -> None:
        self.plan = plan
        self.step = plan.start_step
        self.done = 0
        self.losses: list[float] = []
        self.step_s: list[float] = []
        self.replicate_s: list[float] = []
        """Seconds of each replication: state copy, save, exchange."""
        self.exchange_s: list[float] = []
        """Seconds of each replication's exchange with the ring neighbours."""
        self.replicate_bytes = 0
        self.moved_bytes = 0
        self.setup_s = 0.0


def _pipeline_stage(
    plan: MemberPlan, timed: TimedModule, shapes: list[tuple[int, ...]]
) -> Any:
    from torch.distributed.pipelining import PipelineStage

    first, last = plan.rank == 0, plan.rank == plan.world_size - 1
    layers = plan.layers
    # Static metadata: the activations crossing a cut must be marked as needing
    # gradients, or the stage's backward fails (docs/references.md).
    inputs = torch.empty(shapes[layers.start], device="meta", requires_grad=not first)
    outputs = torch.empty(shapes[layers.stop], device="meta", requires_grad=not last)
    return PipelineStage(
        timed,
        plan.rank,
        plan.world_size,
        torch.device("cpu"),
        input_args=(inputs,),
        output_args=(outputs,),
    )


def _schedule(plan: MemberPlan, stage: Any, training: Training) -> Any:
    """The plan's schedule; its loss is the job's (cross-entropy by default),
    each micro-batch's divided by their number (``scale_grads``), so a loss
    that averages over its batch gives the whole batch's gradient."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    kind = Schedule1F1B if plan.schedule == "1f1b" else ScheduleGPipe
    return kind(stage, plan.micro_batches, loss_fn=training.loss_fn())


def check_pipeline_plan(plan: MemberPlan, num_layers: int) -> None:
    """Raise :class:`PlanError` unless ``plan`` is a runnable pipeline plan."""
    if not plan.partition:
        raise PlanError("a pipeline plan needs a partition")
    if plan.partition[-1] != num_layers:
        raise PlanError(
            f"the partition covers {plan.partition[-1]} layers, the model has "
            f"{num_layers}"
        )
    if plan.batch_size % plan.micro_batches:
        raise PlanError(
            f"batch size {plan.batch_size} is not a multiple of "
            f"{plan.micro_batches} micro-batches"
        )
    if plan.schedule == "1f1b" and plan.micro_batches < plan.world_size:
        raise PlanError(
            f"1F1B needs at least as many micro-batches as stages "
            f"({plan.micro_batches} < {plan.world_size})"
        )


def run_segment(
    plan: MemberPlan, context: MemberContext, arrays: Mapping[str, np.ndarray]
) -> MemberResult:
    """Run ``plan`` (a pipeline segment) on this member; see the module doc."""
    clock = SetupClock.begin()
    arrived = clock.arrived
    torch.manual_seed(plan.seed + plan.rank)
    model = _layers(plan.model, plan.model_args)
    check_pipeline_plan(plan, len(model))
    training, _ = plan_training(plan)  # a bad name fails before joining
    shape = _input_shape(plan.options)
    micro = plan.batch_size // plan.micro_batches
    shapes = layer_shapes(model, torch.zeros((micro, *shape)))
    layers = plan.layers
    stage = stage_module(model, layers)
    del model
    params = list(stage.parameters())
    # A stage of parameter-free layers (flatten, pooling) has nothing to optimise.
    optimizer = plan_optimizer(training, plan, params) if params else None
    timed = TimedModule(stage, context.speed)
    store = context.store(plan.job)
    store.prune([plan.start_step])  # older steps are done with, newer ones stale
    data = job_data(plan.dataset, context) if plan.rank == 0 else None
    seg = _Segment(plan)
    failure = ""
    lost: tuple[int, ...] = ()
    try:
        with joined_group(plan, context.address) as join_s:
            clock.joined(join_s)
            state, seg.moved_bytes = _gather_sources(plan, store, arrays)
            load_module_state(stage, optimizer, state)
            store.save(OWN, plan.start_step, layers, module_state(stage, optimizer))
            labels = _broadcast_labels(plan, data)
            schedule = _schedule(plan, _pipeline_stage(plan, timed, shapes), training)
            seg.setup_s = clock.ready()
            log(
                INFO,
                "pipeline %s segment %d: rank %d of %d, layers %d-%d, steps %d-%d; %s",
                plan.job,
                plan.segment,
                plan.rank,
                plan.world_size,
                layers.start,
                layers.stop - 1,
                plan.start_step,
                plan.end_step - 1,
                clock.describe(),
            )
            timed.reset()
            for k in range(plan.steps):
                seg.step = plan.start_step + k
                if seg.step == context.crash_at_step:
                    os._exit(CRASH_EXIT_CODE)  # test aid: a board losing power
                _one_step(plan, seg, schedule, timed, optimizer, data, labels[k])
                _maybe_replicate(plan, seg, stage, optimizer, store)
            store.save(OWN, plan.end_step, layers, module_state(stage, optimizer))
    except PeerFailure as err:
        failure = f"{err.phase}: {err}"
        lost = err.lost_ranks
        log(
            WARNING,
            "pipeline %s: rank %d stopped at step %d: %s",
            plan.job,
            plan.rank,
            seg.step,
            failure,
        )
    metrics = _metrics(plan, seg, timed, store, failure, arrived)
    return segment_result(metrics, failure, lost, clock.metrics(), stage, optimizer)


def _broadcast_labels(
    plan: MemberPlan, data: tuple[np.ndarray, np.ndarray] | None
) -> torch.Tensor:
    """The segment's labels, ``(steps, batch)``, from the first stage to all."""
    import torch.distributed as dist

    labels = torch.zeros((max(plan.steps, 1), plan.batch_size), dtype=torch.int64)
    if plan.rank == 0:
        assert data is not None
        y = data[1]
        for k in range(plan.steps):
            idx = batch_indices(plan.seed, plan.start_step + k, len(y), plan.batch_size)
            labels[k] = torch.from_numpy(np.asarray(y[idx], dtype=np.int64))
    if plan.world_size > 1:
        dist.broadcast(labels, src=0)
    return labels


def _one_step(
    plan: MemberPlan,
    seg: _Segment,
    schedule: Any,
    timed: TimedModule,
    optimizer: torch.optim.Optimizer | None,
    data: tuple[np.ndarray, np.ndarray] | None,
    labels: torch.Tensor,
) -> None:
    timed.step = seg.step
    begin = time.perf_counter()
    if optimizer is not None:
        optimizer.zero_grad()
    first, last = plan.rank == 0, plan.rank == plan.world_size - 1
    x = None
    if first:
        assert data is not None
        idx = batch_indices(plan.seed, seg.step, len(data[0]), plan.batch_size)
        x = torch.from_numpy(np.ascontiguousarray(data[0][idx], dtype=np.float32))
    losses: list[torch.Tensor] = []
    if first and last:
        schedule.step(x, target=labels, losses=losses)
    elif first:
        schedule.step(x)
    elif last:
        schedule.step(target=labels, losses=losses)
    else:
        schedule.step()
    if optimizer is not None:
        optimizer.step()
    seg.step_s.append(time.perf_counter() - begin)
    if losses:
        seg.losses.append(float(torch.stack([v.detach() for v in losses]).mean()))
    seg.done += 1


def _maybe_replicate(
    plan: MemberPlan,
    seg: _Segment,
    stage: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    store: LayerStore,
) -> None:
    """After step t with t % R == 0 (not the segment's last): ring replication."""
    from ..member import exchange_ring

    done = seg.step + 1
    every = plan.replicate_every
    if every <= 0 or done % every or done >= plan.end_step:
        return
    begin = time.perf_counter()
    state = module_state(stage, optimizer)
    store.save(OWN, done, plan.layers, state)
    if plan.world_size > 1:
        exchange = exchange_ring(state, plan.rank, plan.world_size)
        store.save(REPLICA, done, plan.layers_of(plan.predecessor), exchange.received)
        seg.exchange_s.append(exchange.seconds)
        seg.replicate_bytes = exchange.sent_bytes
    keep = {plan.start_step, *store.newest_steps(KEEP_REPLICATIONS)}
    store.prune(keep)
    seg.replicate_s.append(time.perf_counter() - begin)
    log(INFO, "pipeline %s: rank %d replicated at step %d", plan.job, plan.rank, done)


def _metrics(
    plan: MemberPlan,
    seg: _Segment,
    timed: TimedModule,
    store: LayerStore,
    failure: str,
    arrived: float,
) -> dict[str, MetricValue]:
    ok = not failure
    # The first step includes one-off costs (allocations, stage set-up). Step
    # and replication times are means: the server multiplies them by a
    # segment's steps to tell its set-up from its steps, so a median, below
    # the mean when a few steps run long, left part of every step unaccounted.
    steady = seg.step_s[1:] if len(seg.step_s) > 1 else seg.step_s
    m = plan.micro_batches
    forward = timed.forward_s[m:] if len(timed.forward_s) > m else timed.forward_s
    backward = timed.backward_s[m:] if len(timed.backward_s) > m else timed.backward_s
    metrics: dict[str, MetricValue] = {
        keys.SPAN_OK: int(ok),
        keys.NUM_STEPS: seg.done,
        keys.NUM_EXAMPLES: seg.done * plan.batch_size,
        keys.TRAIN_TIME_S: time.monotonic() - arrived,
        keys.SPAN_SETUP_S: seg.setup_s,
        keys.SPAN_STEP_S: mean_or_zero(steady),
        keys.SPAN_FORWARD_S: median_or_zero(forward),
        keys.SPAN_BACKWARD_S: median_or_zero(backward),
        keys.SPAN_REPLICATE_S: mean_or_zero(seg.replicate_s),
        keys.SPAN_REPLICATE_BYTES: seg.replicate_bytes,
        keys.SPAN_MOVED_BYTES: seg.moved_bytes,
        keys.SPAN_OVERRUN_S: timed.overrun_s,
        keys.SPAN_FAILED_STEP: -1 if ok else seg.step,
        keys.SPAN_HOLDS: _holds(store),
    }
    if seg.exchange_s and median_or_zero(seg.exchange_s) > 0:
        metrics[keys.SPAN_LINK_BYTES_PER_S] = seg.replicate_bytes / median_or_zero(
            seg.exchange_s
        )
    if seg.losses:
        metrics[keys.TRAIN_LOSS] = float(np.mean(seg.losses))
    return metrics
