"""The ``allreduce`` mode: a member of a large-batch synchronous data-parallel job.

Every member holds the whole model, which may be any ``nn.Module`` (data
parallelism cuts nothing). A segment joins the plan's fresh gloo group
(:func:`~flowerbed.parallel.group.joined_group`), wraps the model in
``torch.nn.parallel.DistributedDataParallel`` (CPU, no ``device_ids``) and runs
steps ``start_step .. start_step + steps - 1``: the global batch of step ``t`` is
:func:`~flowerbed.parallel.job_data.batch_indices` ``(seed, t)``; this member takes
samples ``batch_share = (first, stop)`` of it, scales its mean loss (the job's
loss, :class:`~flowerbed.parallel.user_code.Training`; cross-entropy by default) by
``W * B_i / B`` (:func:`~flowerbed.parallel.large_batch.recipe.loss_scale`) so
DDP's averaged gradient is the gradient of the whole batch, and applies the
plan's large-batch optimiser
(:class:`~flowerbed.parallel.large_batch.optimizers.LargeBatchOptimizer`), or the
job's own ``torch.optim`` factory, at the schedule's rate
(:class:`~flowerbed.parallel.large_batch.recipe.LrSchedule`).
Every replica applies the same update to the same weights, so they stay equal.

Plan options (:data:`OPTIMIZER` ...): the optimiser kind and its settings, the
schedule, and the gradient compression: ``none``, ``fp16`` (DDP's
``fp16_compress_hook``: gradients travel as float16, half the bytes) or
``powersgd`` (``powerSGD_hook``, Vogels et al., NeurIPS 2019: rank-``r``
approximations with error feedback, which restarts with each segment).

A lost peer makes the segment fail fast (gloo raises on the neighbours within
the plan's ``timeout_s``): the member answers ``span-ok = 0`` with the step it
was on; the strategy re-forms the group without the lost member and repeats the
segment from the last weights it holds.

Replies: the weights (``arrays``), the optimiser state (``optimizer``, names
``<buffer>/<parameter>`` and ``step``), and per step the compute seconds
(forward + backward of this member's share, emulated speed included) and the
rest of the step's wall time, the exposed all-reduce (``span-step-comm-s``).

The simulator runs a whole group in one process with :func:`run_group` (every
member's share in turn, their gradients summed as the all-reduce would), on the
same :class:`Segment` code as a DDP member: data, batch shares, loss scale,
optimiser and schedule are one code path (``flowerbed.sims.span_sim`` adds the
virtual clock).
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from logging import INFO
from typing import Any

import numpy as np
import torch
from flowerbed import keys
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
    lost_ranks_metric,
    module_state,
    plan_training,
    result_arrays,
)
from ..plan import MemberPlan, PlanError
from ..setup_time import SetupClock
from ..store import MOMENTUM_PREFIX
from ..user_code import LossFn, UserCodeError, build_module, set_lr
from .optimizers import LargeBatchOptimizer
from .recipe import LrSchedule, loss_scale

MODE = "allreduce"
LOCAL_DATASET = "local"
"""Dataset name meaning each member's own data (node_config ``dataset-path``)."""

OPTIMIZER = "optimizer"
TRUST = "trust"
COMPRESSION = "compression"
POWERSGD_RANK = "powersgd-rank"
SCHEDULE = "schedule"
"""Plan option holding :meth:`LrSchedule.to_config` (base-lr, base-batch ...)."""
COMPRESSIONS = ("none", "fp16", "powersgd")
OPTIMIZER_PREFIX = MOMENTUM_PREFIX
"""How the span ClientApp prefixes optimiser-state arrays."""


def _schedule(plan: MemberPlan) -> LrSchedule:
    raw = plan.options.get(SCHEDULE)
    if raw is None:  # a constant rate: the plan's lr
        return LrSchedule(base_lr=plan.lr, base_batch=1, batch_size=1)
    if not isinstance(raw, dict):
        raise PlanError(f"plan option {SCHEDULE!r} must be an object, got {raw!r}")
    return LrSchedule.from_config(raw)


def make_optimizer(plan: MemberPlan) -> LargeBatchOptimizer:
    """The plan's optimiser (options ``optimizer``, ``trust``; momentum, decay)."""
    kind = plan.options.get(OPTIMIZER, "sgd")
    try:
        return LargeBatchOptimizer(
            str(kind),
            momentum=plan.momentum,
            weight_decay=plan.weight_decay,
            trust=float(plan.options.get(TRUST, 0.001)),
        )
    except ValueError as err:
        raise PlanError(f"plan optimiser: {err}") from None


def _data(plan: MemberPlan, context: MemberContext) -> tuple[np.ndarray, np.ndarray]:
    if plan.dataset == LOCAL_DATASET:
        if context.local_data is None:
            raise PlanError(
                "the job's dataset is 'local' but this board has no node_config "
                "'dataset-path'"
            )
        return context.local_data()
    data = load_job_dataset(plan.dataset)
    return data.x_train, data.y_train


def _register_compression(ddp: Any, plan: MemberPlan) -> None:
    kind = str(plan.options.get(COMPRESSION, "none"))
    if kind == "none":
        return
    if kind == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return
    if kind == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        rank = int(plan.options.get(POWERSGD_RANK, 1))
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=max(1, rank),
            start_powerSGD_iter=2,
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return
    raise PlanError(
        f"plan option {COMPRESSION!r} is {kind!r}; valid choices: "
        f"{', '.join(COMPRESSIONS)}"
    )


def _module(name: str, args: Mapping[str, Any] | None, seed: int, what: str) -> Any:
    """Any ``nn.Module`` by name (data parallelism cuts nothing)."""
    try:
        return build_module(name, args, seed=seed)
    except ValueError as err:
        raise PlanError(f"{what}: {err}") from None


def build_member_model(plan: MemberPlan, arrays: Mapping[str, np.ndarray]) -> nn.Module:
    """The plan's model (any ``nn.Module``) with the weights the message carried."""
    model: nn.Module = _module(plan.model, plan.model_args, plan.seed, "plan model")
    weights = {k: v for k, v in arrays.items() if not k.startswith(OPTIMIZER_PREFIX)}
    if weights:
        try:
            load_module_state(model, None, weights, strict=True)
        except PlanError as err:
            raise PlanError(f"weights do not fit model {plan.model!r}: {err}") from None
    return model


@dataclass
class Segment:
    """A segment's working state, built the same way for a DDP member and for the
    in-process group (:func:`run_group`): the model with the message's weights,
    the optimiser with its state, the schedule, the job's data and its loss.

    ``optimizer`` is the plan's large-batch optimiser, or a ``torch.optim``
    optimiser from the job's own factory
    (:class:`~flowerbed.parallel.user_code.Training`); either steps at the
    schedule's rate."""

    plan: MemberPlan
    model: nn.Module
    optimizer: LargeBatchOptimizer | torch.optim.Optimizer
    schedule: LrSchedule
    x: torch.Tensor
    y: torch.Tensor
    loss_fn: LossFn = nn.functional.cross_entropy
    params: dict[str, nn.Parameter] = field(init=False)
    views: dict[str, np.ndarray] = field(init=False)

    def __post_init__(self) -> None:
        self.params = {
            n: p for n, p in self.model.named_parameters() if p.requires_grad
        }
        self.views = {n: p.detach().numpy() for n, p in self.params.items()}

    def batch(self, step: int) -> np.ndarray:
        """Sample indices of global step ``step``'s whole batch."""
        plan = self.plan
        return batch_indices(plan.seed, step, len(self.x), plan.batch_size)

    def share_backward(
        self, module: nn.Module, indices: np.ndarray, scale: float
    ) -> float:
        """Forward and backward of one share, its mean loss (the job's loss,
        cross-entropy by default) scaled by ``scale``
        (:func:`~flowerbed.parallel.large_batch.recipe.loss_scale`); the unscaled
        loss."""
        idx = torch.from_numpy(indices)
        loss = self.loss_fn(module(self.x[idx]), self.y[idx])
        (loss * scale).backward()
        return float(loss.detach())

    def update(self, step: int) -> float:
        """Apply the optimiser to the parameters' (all-reduced) gradients at
        step ``step``'s rate; clear the gradients; return the rate."""
        lr = self.schedule.lr(step)
        if isinstance(self.optimizer, torch.optim.Optimizer):
            set_lr(self.optimizer, lr)
            self.optimizer.step()
        else:
            grads = {
                n: p.grad.numpy()
                if p.grad is not None
                else np.zeros_like(self.views[n])
                for n, p in self.params.items()
            }
            self.optimizer.step(self.views, grads, lr)
        for p in self.params.values():
            p.grad = None
        return lr

    def grad_bytes(self) -> int:
        """Bytes of the gradients a member all-reduces per step (uncompressed)."""
        return sum(p.numel() * p.element_size() for p in self.params.values())

    def result_state(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """Copies of the model state and the optimiser state (the reply's)."""
        if isinstance(self.optimizer, torch.optim.Optimizer):
            arrays, momentum = result_arrays(module_state(self.model, self.optimizer))
            return (
                {k: v.copy() for k, v in arrays.items()},
                {k: v.copy() for k, v in momentum.items()},
            )
        arrays = {
            k: v.detach().numpy().copy() for k, v in self.model.state_dict().items()
        }
        return arrays, {k: np.asarray(v) for k, v in self.optimizer.state().items()}


def share_of(plan: MemberPlan) -> tuple[int, int]:
    """``(first, stop)`` of the plan's share of each step's batch (checked)."""
    if len(plan.batch_share) != 2 or plan.batch_share[1] <= plan.batch_share[0]:
        raise PlanError(
            "an all-reduce member needs a non-empty batch_share, got "
            f"{plan.batch_share}"
        )
    first, stop = plan.batch_share
    return first, stop


def prepare(
    plan: MemberPlan, context: MemberContext, arrays: Mapping[str, np.ndarray]
) -> Segment:
    """The plan's :class:`Segment`: PlanError names a bad plan before anything runs."""
    share_of(plan)
    schedule = _schedule(plan)
    training, loss_fn = plan_training(plan)
    model = build_member_model(plan, arrays)
    optimizer: LargeBatchOptimizer | torch.optim.Optimizer
    if training.custom_optimizer:
        try:
            torch_optimizer: torch.optim.Optimizer = training.make_optimizer(
                [p for p in model.parameters() if p.requires_grad],
                schedule.lr(plan.start_step),
                lambda ps: None,
            )
        except UserCodeError as err:
            raise PlanError(f"plan training: {err}") from None
        if any(k.startswith(OPTIMIZER_PREFIX) for k in arrays):
            load_module_state(model, torch_optimizer, arrays)
        optimizer = torch_optimizer
    else:
        optimizer = make_optimizer(plan)
        saved = {
            k[len(OPTIMIZER_PREFIX) :]: v
            for k, v in arrays.items()
            if k.startswith(OPTIMIZER_PREFIX)
        }
        if saved:
            try:
                optimizer.load_state(saved)
            except ValueError as err:
                raise PlanError(f"optimiser state: {err}") from None
    x_all, y_all = _data(plan, context)
    return Segment(
        plan,
        model,
        optimizer,
        schedule,
        torch.from_numpy(np.ascontiguousarray(x_all, dtype=np.float32)),
        torch.from_numpy(np.ascontiguousarray(y_all)).long(),
        loss_fn,
    )


def segment_metrics(
    share: int,
    compute: list[float],
    comm: list[float],
    losses: list[float],
    lr: float,
    *,
    train_s: float,
    setup_s: float,
    overrun_s: float = 0.0,
) -> dict[str, MetricValue]:
    """A finished member's reply metrics (per-step compute and communication
    seconds, examples, speed, loss): the same keys from a DDP member and from the
    simulated one."""
    steps = len(compute)
    metrics: dict[str, MetricValue] = {
        keys.SPAN_OK: 1,
        keys.NUM_EXAMPLES: share * steps,
        keys.NUM_STEPS: steps,
        keys.TRAIN_TIME_S: train_s,
        keys.SPAN_SETUP_S: setup_s,
        keys.SPAN_STEP_COMPUTE_S: compute,
        keys.SPAN_STEP_COMM_S: comm,
        keys.SPAN_LR: lr,
        keys.SPAN_OVERRUN_S: overrun_s,
    }
    if steps:
        metrics[keys.TRAIN_LOSS] = statistics.fmean(losses)
        metrics[keys.SAMPLES_PER_S] = share * steps / max(sum(compute), 1e-9)
        metrics[keys.SPAN_STEP_S] = statistics.fmean(
            c + m for c, m in zip(compute, comm, strict=True)
        )
    return metrics


def run(
    plan: MemberPlan, context: MemberContext, arrays: Mapping[str, np.ndarray]
) -> MemberResult:
    """Run one segment of large-batch synchronous training (module docstring)."""
    from torch.nn.parallel import DistributedDataParallel

    clock = SetupClock.begin()
    begin = clock.arrived
    segment = prepare(plan, context, arrays)
    first, stop = share_of(plan)
    share = stop - first
    timed = TimedModule(segment.model, context.speed)
    scale = loss_scale(share, plan.batch_size, plan.world_size)
    compute: list[float] = []
    comm: list[float] = []
    losses: list[float] = []
    lr = segment.schedule.lr(plan.start_step)
    step = plan.start_step - 1
    setup = 0.0
    try:
        with joined_group(plan, context.address) as join_s:
            clock.joined(join_s)
            ddp = DistributedDataParallel(timed)
            try:
                _register_compression(ddp, plan)
                setup = clock.ready()
                log(
                    INFO,
                    "large batch %s segment %d: rank %d of %d, samples %d-%d of "
                    "each batch, steps %d-%d; %s",
                    plan.job,
                    plan.segment,
                    plan.rank,
                    plan.world_size,
                    first,
                    stop - 1,
                    plan.start_step,
                    plan.end_step - 1,
                    clock.describe(),
                )
                for step in range(plan.start_step, plan.end_step):
                    timed.step = step
                    timed.reset()
                    started = time.perf_counter()
                    indices = segment.batch(step)[first:stop]
                    losses.append(segment.share_backward(ddp, indices, scale))
                    wall = time.perf_counter() - started
                    busy = sum(timed.forward_s) + sum(timed.backward_s)
                    compute.append(busy)
                    comm.append(max(0.0, wall - busy))
                    lr = segment.update(step)
            finally:
                # Free DDP's reducer (and its comm hook's state) while the group
                # is still alive: left to the garbage collector after
                # destroy_process_group, its destructor hung the next segment's
                # call in about 1 of 6 three-segment runs (a rank stuck for the
                # test's 240 s, tests/test_large_batch_ddp.py).
                del ddp
                gc.collect()
    except PeerFailure as err:
        return MemberResult(
            ok=False,
            metrics={
                keys.SPAN_OK: 0,
                keys.SPAN_FAILED_STEP: step if step >= plan.start_step else -1,
                keys.TRAIN_TIME_S: time.monotonic() - begin,
                **lost_ranks_metric(err.lost_ranks),
                **clock.metrics(),
            },
            failure=f"{err.phase}: {err}",
        )
    arrays_out, optimizer_out = segment.result_state()
    metrics = segment_metrics(
        share,
        compute,
        comm,
        losses,
        lr,
        train_s=time.monotonic() - begin,
        setup_s=setup,
        overrun_s=timed.overrun_s,
    )
    metrics.update(clock.metrics())
    return MemberResult(
        ok=True, metrics=metrics, arrays=arrays_out, optimizer=optimizer_out
    )


@dataclass
class GroupRun:
    """What :func:`run_group` did: the steps completed, each member's losses, the
    final state (rank 0's, as every replica's) and the bytes all-reduced per step."""

    steps: int
    losses: list[list[float]]
    lr: float
    grad_bytes: int
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    optimizer: dict[str, np.ndarray] = field(default_factory=dict)


def check_group(plans: Sequence[MemberPlan]) -> list[MemberPlan]:
    """The plans of one segment in rank order, checked to form a whole group:
    ranks ``0 .. W-1``, the same segment settings, shares tiling the batch."""
    if not plans:
        raise PlanError("a group needs at least one member's plan")
    ordered = sorted(plans, key=lambda p: p.rank)
    lead = ordered[0]
    ranks = [p.rank for p in ordered]
    if ranks != list(range(lead.world_size)):
        raise PlanError(
            f"segment {lead.segment} of job {lead.job!r} has ranks {ranks}, world "
            f"size {lead.world_size}: a group needs every rank once"
        )
    same = (
        "job",
        "segment",
        "world_size",
        "start_step",
        "steps",
        "batch_size",
        "seed",
        "model",
        "model_args",
        "dataset",
        "momentum",
        "weight_decay",
        "options",
    )
    for plan in ordered[1:]:
        for name in same:
            if getattr(plan, name) != getattr(lead, name):
                raise PlanError(
                    f"rank {plan.rank}'s plan differs from rank 0's in {name!r}: "
                    f"{getattr(plan, name)!r} vs {getattr(lead, name)!r}"
                )
    edge = 0
    for plan in ordered:
        first, stop = share_of(plan)
        if first != edge:
            raise PlanError(
                f"rank {plan.rank}'s batch_share {plan.batch_share} does not start "
                f"where rank {plan.rank - 1}'s ends ({edge})"
            )
        edge = stop
    if edge != lead.batch_size:
        raise PlanError(
            f"the shares cover {edge} samples of a batch of {lead.batch_size}"
        )
    return ordered


def run_group(
    plans: Sequence[MemberPlan],
    context: MemberContext,
    arrays: Mapping[str, np.ndarray],
    *,
    stop_step: int | None = None,
) -> GroupRun:
    """Run a whole group's segment in this process, member by member (simulation).

    Each step, every member in rank order computes the gradient of its share
    with its loss scaled by ``W B_i / B`` (:meth:`Segment.share_backward`, as a
    DDP member does); the all-reduce is their sum divided by ``W`` (DDP divides
    before it sums; with compression ``fp16`` each contribution travels as
    float16, as ``fp16_compress_hook`` sends it); then the optimiser steps once
    (:meth:`Segment.update`), the same update every replica applies. Buffers
    (BatchNorm's running statistics) follow DDP's ``broadcast_buffers``: every
    member starts a step from rank 0's, and rank 0's are kept. The weights start
    from ``arrays`` (rank 0's, which DDP broadcasts when it wraps the model).

    ``stop_step``: the group breaks at that global step (a member lost): the
    steps before it are done, the result has no state. PlanError for plans that
    do not form one group, ``powersgd`` compression (not simulated) or a bad plan.
    """
    ordered = check_group(plans)
    lead = ordered[0]
    compression = str(lead.options.get(COMPRESSION, "none"))
    if compression not in ("none", "fp16"):
        raise PlanError(
            f"compression {compression!r} is not simulated in process; valid "
            "choices here: none, fp16"
        )
    segment = prepare(lead, context, arrays)
    world = len(ordered)
    bounds = [share_of(p) for p in ordered]
    scales = [loss_scale(b - a, lead.batch_size, world) for a, b in bounds]
    buffers = [b for b in segment.model.buffers() if b.is_floating_point()]
    losses: list[list[float]] = [[] for _ in ordered]
    lr = segment.schedule.lr(lead.start_step)
    end = lead.end_step if stop_step is None else min(stop_step, lead.end_step)
    done = 0
    for step in range(lead.start_step, end):
        batch = segment.batch(step)
        start_buffers = [b.detach().clone() for b in buffers]
        rank0_buffers = start_buffers
        total: dict[str, torch.Tensor] = {}
        for rank, (first, stop) in enumerate(bounds):
            if rank == 1 and buffers:
                rank0_buffers = [b.detach().clone() for b in buffers]
            if rank and buffers:
                _copy_into(buffers, start_buffers)
            losses[rank].append(
                segment.share_backward(segment.model, batch[first:stop], scales[rank])
            )
            for name, param in segment.params.items():
                grad = param.grad if param.grad is not None else torch.zeros_like(param)
                part = (
                    grad.to(torch.float16).div_(world)
                    if compression == "fp16"
                    else grad / world
                )
                total[name] = part if name not in total else total[name] + part
                param.grad = None
        if world > 1 and buffers:
            _copy_into(buffers, rank0_buffers)
        for name, param in segment.params.items():
            param.grad = total[name].to(param.dtype)
        lr = segment.update(step)
        done += 1
    grad_bytes = segment.grad_bytes() // (2 if compression == "fp16" else 1)
    if stop_step is not None and stop_step < lead.end_step:
        return GroupRun(done, losses, lr, grad_bytes)
    arrays_out, optimizer_out = segment.result_state()
    return GroupRun(done, losses, lr, grad_bytes, arrays_out, optimizer_out)


def _copy_into(targets: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for target, value in zip(targets, values, strict=True):
            target.copy_(value)


def profile(query: Mapping[str, Any], context: MemberContext) -> MemberResult:
    """Measure this member's training speed (samples per second) on the job's model.

    The query names ``model``, ``model_args``, ``dataset`` (as a plan does),
    ``batch`` (samples per timed step) and ``repeats``; the member times that
    many forward + backward passes (emulated speed included) and answers their
    median as ``samples-per-s``.
    """
    batch = int(query.get("batch", 8))
    repeats = max(1, int(query.get("repeats", 3)))
    model = _module(
        str(query.get("model", "")), query.get("model_args"), 0, "profile model"
    )
    dataset = str(query.get("dataset", ""))
    if dataset == LOCAL_DATASET and context.local_data is None:
        raise PlanError(
            "dataset 'local' but this board has no node_config 'dataset-path'"
        )
    x = (
        context.local_data()[0]
        if dataset == LOCAL_DATASET and context.local_data is not None
        else load_job_dataset(dataset).x_train
    )
    sample = torch.from_numpy(
        np.ascontiguousarray(x[: max(1, batch)], dtype=np.float32)
    )
    timed = TimedModule(model, context.speed)
    seconds = []
    for _ in range(repeats):
        timed.reset()
        timed(sample).sum().backward()
        seconds.append(sum(timed.forward_s) + sum(timed.backward_s))
    per_step = statistics.median(seconds)
    return MemberResult(
        ok=True,
        metrics={
            keys.SPAN_OK: 1,
            keys.SAMPLES_PER_S: len(sample) / max(per_step, 1e-9),
        },
        info={"address": context.address},
    )


def evaluate(
    query: Mapping[str, Any], context: MemberContext, arrays: Mapping[str, np.ndarray]
) -> MemberResult:
    """Accuracy and loss of the whole model on the job dataset's test split."""
    model = _module(
        str(query.get("model", "")), query.get("model_args"), 0, "evaluation model"
    )
    load_module_state(model, None, arrays, strict=True)
    data = load_job_dataset(str(query.get("dataset", "")))
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(np.ascontiguousarray(data.x_test)))
        target = torch.from_numpy(np.ascontiguousarray(data.y_test)).long()
        loss = float(nn.functional.cross_entropy(logits, target))
        acc = float((logits.argmax(dim=1) == target).float().mean())
    return MemberResult(
        ok=True,
        metrics={
            keys.SPAN_OK: 1,
            keys.NUM_EXAMPLES: len(data.x_test),
            keys.EVAL_LOSS: loss,
            keys.EVAL_ACC: acc,
        },
    )
