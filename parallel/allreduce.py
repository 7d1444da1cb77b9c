"""The ``allreduce`` mode: a member of a large-batch synchronous data-parallel job.

Every member holds the whole model. A segment joins the plan's fresh gloo group
(:func:`~flowerbed.parallel.group.joined_group`), wraps the model in
``torch.nn.parallel.DistributedDataParallel`` (CPU, no ``device_ids``) and runs
steps ``start_step .. start_step + steps - 1``: the global batch of step ``t`` is
:func:`~flowerbed.parallel.data.batch_indices` ``(seed, t)``; this member takes
samples ``batch_share = (first, stop)`` of it, scales its mean loss by
``W * B_i / B`` (:func:`~flowerbed.parallel.large_batch.loss_scale`) so DDP's
averaged gradient is the gradient of the whole batch, and applies the plan's
large-batch optimiser (:class:`~flowerbed.parallel.optim.LargeBatchOptimizer`)
at the schedule's rate (:class:`~flowerbed.parallel.large_batch.LrSchedule`).
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
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from flowerbed import keys
from flowerbed.models import build_sequential
from torch import nn

from .data import batch_indices, load_job_dataset
from .emulation import TimedModule
from .group import PeerFailure, joined_group
from .large_batch import LrSchedule, loss_scale
from .member import MemberContext, MemberResult, MetricValue, load_module_state
from .optim import LargeBatchOptimizer
from .plan import MemberPlan, PlanError
from .store import MOMENTUM_PREFIX

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


def build_member_model(plan: MemberPlan, arrays: Mapping[str, np.ndarray]) -> nn.Module:
    """The plan's model with the weights the message carried (all of them)."""
    try:
        model = build_sequential(plan.model, plan.model_args, seed=plan.seed)
    except ValueError as err:
        raise PlanError(f"plan model: {err}") from None
    weights = {k: v for k, v in arrays.items() if not k.startswith(OPTIMIZER_PREFIX)}
    if weights:
        try:
            load_module_state(model, None, weights, strict=True)
        except PlanError as err:
            raise PlanError(f"weights do not fit model {plan.model!r}: {err}") from None
    return model


def run(
    plan: MemberPlan, context: MemberContext, arrays: Mapping[str, np.ndarray]
) -> MemberResult:
    """Run one segment of large-batch synchronous training (module docstring)."""
    from torch.nn.parallel import DistributedDataParallel

    begin = time.monotonic()
    if len(plan.batch_share) != 2 or plan.batch_share[1] <= plan.batch_share[0]:
        raise PlanError(
            "an all-reduce member needs a non-empty batch_share, got "
            f"{plan.batch_share}"
        )
    first, stop = plan.batch_share
    share = stop - first
    schedule = _schedule(plan)
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
    model = build_member_model(plan, arrays)
    x_all, y_all = _data(plan, context)
    x_data = torch.from_numpy(np.ascontiguousarray(x_all, dtype=np.float32))
    y_data = torch.from_numpy(np.ascontiguousarray(y_all)).long()
    timed = TimedModule(model, context.speed)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    views = {n: p.detach().numpy() for n, p in params.items()}
    scale = loss_scale(share, plan.batch_size, plan.world_size)
    loss_fn = nn.CrossEntropyLoss()
    compute: list[float] = []
    comm: list[float] = []
    losses: list[float] = []
    lr = schedule.lr(plan.start_step)
    step = plan.start_step - 1
    setup = 0.0
    try:
        with joined_group(plan, context.address):
            ddp = DistributedDataParallel(timed)
            _register_compression(ddp, plan)
            setup = time.monotonic() - begin
            for step in range(plan.start_step, plan.end_step):
                batch = batch_indices(plan.seed, step, len(x_data), plan.batch_size)
                idx = torch.from_numpy(batch[first:stop])
                timed.step = step
                timed.reset()
                started = time.perf_counter()
                loss = loss_fn(ddp(x_data[idx]), y_data[idx])
                (loss * scale).backward()
                wall = time.perf_counter() - started
                busy = sum(timed.forward_s) + sum(timed.backward_s)
                compute.append(busy)
                comm.append(max(0.0, wall - busy))
                losses.append(float(loss.detach()))
                lr = schedule.lr(step)
                grads = {
                    n: (
                        p.grad.numpy()
                        if p.grad is not None
                        else np.zeros_like(views[n])
                    )
                    for n, p in params.items()
                }
                optimizer.step(views, grads, lr)
                for p in params.values():
                    p.grad = None
    except PeerFailure as err:
        return MemberResult(
            ok=False,
            metrics={
                keys.SPAN_OK: 0,
                keys.SPAN_FAILED_STEP: step if step >= plan.start_step else -1,
                keys.TRAIN_TIME_S: time.monotonic() - begin,
            },
            failure=f"{err.phase}: {err}",
        )
    steps = len(compute)
    metrics: dict[str, MetricValue] = {
        keys.SPAN_OK: 1,
        keys.NUM_EXAMPLES: share * steps,
        keys.NUM_STEPS: steps,
        keys.TRAIN_TIME_S: time.monotonic() - begin,
        keys.SPAN_SETUP_S: setup,
        keys.SPAN_STEP_COMPUTE_S: compute,
        keys.SPAN_STEP_COMM_S: comm,
        keys.SPAN_LR: lr,
        keys.SPAN_OVERRUN_S: timed.overrun_s,
    }
    if steps:
        metrics[keys.TRAIN_LOSS] = statistics.fmean(losses)
        metrics[keys.SAMPLES_PER_S] = share * steps / max(sum(compute), 1e-9)
        metrics[keys.SPAN_STEP_S] = statistics.fmean(
            c + m for c, m in zip(compute, comm, strict=True)
        )
    return MemberResult(
        ok=True,
        metrics=metrics,
        arrays={k: v.detach().numpy().copy() for k, v in model.state_dict().items()},
        optimizer={k: np.asarray(v) for k, v in optimizer.state().items()},
    )


def profile(query: Mapping[str, Any], context: MemberContext) -> MemberResult:
    """Measure this member's training speed (samples per second) on the job's model.

    The query names ``model``, ``model_args``, ``dataset`` (as a plan does),
    ``batch`` (samples per timed step) and ``repeats``; the member times that
    many forward + backward passes (emulated speed included) and answers their
    median as ``samples-per-s``.
    """
    batch = int(query.get("batch", 8))
    repeats = max(1, int(query.get("repeats", 3)))
    try:
        model = build_sequential(
            str(query.get("model", "")), dict(query.get("model_args") or {}), seed=0
        )
    except ValueError as err:
        raise PlanError(f"profile model: {err}") from None
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
    try:
        model = build_sequential(
            str(query.get("model", "")), dict(query.get("model_args") or {}), seed=0
        )
    except ValueError as err:
        raise PlanError(f"evaluation model: {err}") from None
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
