"""What :class:`~flowerbed.strategies.PipelineTraining` plans with: the job's
checks, the layered model as the planner sees it, the candidate members of a
segment and each member's plan.

Pure functions of their arguments (the strategy passes its state), in the
spirit of ``torch.distributed.pipelining``'s split: the plan is data, the
strategy only moves it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flowerbed.models import layer_shapes
from flowerbed.parallel.pipeline.planner import Layout, PipelinePlanner
from flowerbed.parallel.pipeline.stage import LOCAL_DATASET
from flowerbed.parallel.plan import LayerSource, MemberPlan, PlanError
from flowerbed.parallel.store import layer_of
from flowerbed.parallel.user_code import Training, build_layers
from flwr.app import ArrayRecord

from .pipeline_options import PipelinePlanning, Pipelining
from .span_members import SpanMember


def check_job(
    model: str,
    input_shape: Sequence[int],
    steps_per_round: int | None,
    batch_size: int,
    micro_batches: int,
    sgd: tuple[float, float, float],
) -> None:
    """Raise ValueError naming the first of the job's settings that is wrong
    (``sgd``: learning rate, momentum, weight decay)."""
    lr, momentum, weight_decay = sgd
    checks = [
        (bool(model), "model is required: a layered model name or 'pkg.mod:fn'"),
        (len(input_shape) > 0, "input_shape is required, e.g. (1, 8, 8)"),
        (
            steps_per_round is None or steps_per_round >= 1,
            "steps_per_round must be >= 1 (or None: sized by setup_share)",
        ),
        (
            batch_size >= 1 and batch_size % max(micro_batches, 1) == 0,
            "batch_size must be a positive multiple of micro_batches",
        ),
        (lr > 0, "lr must be > 0"),
        (momentum >= 0 and weight_decay >= 0, "momentum, weight_decay >= 0"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


@dataclass(frozen=True)
class LayeredModel:
    """The job's model as the planner sees it, built once on the server (so
    that bad input fails before any message).

    Attributes
    ----------
    num_layers : int
        Layers of the layered model.
    reference_state : dict of str to tuple of int
        Each state array and its shape (what the members' replies must hold).
    planner : PipelinePlanner
        Planning state over activation bytes per cut (4 bytes per value of a
        micro-batch's output) and state bytes per layer (weights, times 2 with
        a momentum buffer, 3 with a factory's Adam-like optimiser).
    """

    num_layers: int
    reference_state: dict[str, tuple[int, ...]]
    planner: PipelinePlanner

    @classmethod
    def build(
        cls,
        model: str,
        model_args: Mapping[str, Any],
        sample: tuple[int, ...],
        settings: tuple[int, float, int, Training],
        pipelining: Pipelining,
        planning: PipelinePlanning,
    ) -> LayeredModel:
        """Build ``model`` for micro-batches of ``sample``-shaped inputs
        (``settings``: batch size, momentum, seed, training) and plan over it."""
        batch_size, momentum, seed, training = settings
        net = build_layers(model, dict(model_args), seed=seed)
        num_layers = len(net)
        check_stages(model, num_layers, planning)
        micro = batch_size // pipelining.micro_batches
        with torch.no_grad():
            shapes = layer_shapes(net, torch.zeros((micro, *sample)))
        state_bytes = [0.0] * num_layers
        for name, tensor in net.state_dict().items():
            state_bytes[layer_of(name)] += tensor.numel() * tensor.element_size()
        # optimiser state travels with the weights: a momentum buffer, or (a
        # factory's optimiser, Adam-like) two moment buffers
        factor = 3 if training.custom_optimizer else 2 if momentum > 0 else 1
        sizes = planning.stage_sizes
        planner = PipelinePlanner(
            out_bytes=[4.0 * math.prod(shape) for shape in shapes[1:]],
            state_bytes=[factor * b for b in state_bytes],
            micro_batches=pipelining.micro_batches,
            schedule=pipelining.schedule,
            link_bandwidth=planning.link_bandwidth,
            repartition=planning.repartition and sizes is None,
            threshold=planning.repartition_threshold,
            fixed_sizes=tuple(sizes) if sizes is not None else None,
        )
        state = {k: tuple(v.shape) for k, v in net.state_dict().items()}
        return cls(num_layers, state, planner)


def check_stages(model: str, num_layers: int, planning: PipelinePlanning) -> None:
    """PlanError unless ``planning``'s stages fit a model of ``num_layers``."""
    stages, sizes = planning.num_stages, planning.stage_sizes
    if stages is not None and stages > num_layers:
        raise PlanError(
            f"num_stages={stages} but model {model!r} has only "
            f"{num_layers} layers: every stage needs at least one layer"
        )
    if sizes is not None and (any(s < 1 for s in sizes) or sum(sizes) != num_layers):
        raise PlanError(
            f"stage_sizes {list(sizes)} must be positive and sum to the "
            f"model's {num_layers} layers"
        )


def usable_members(
    layout: Layout | None,
    members: Mapping[int, SpanMember],
    lost: set[int],
    local_data: bool,
    limit: int,
    power: Mapping[int, float],
) -> list[int]:
    """Candidate members in stage order: ``layout``'s, then the others; a data
    holder first when the dataset is the boards' own (``local_data``); the
    fastest (least ``power``) when there are more than ``limit``. The planner
    may leave slow ones on standby."""
    current = list(layout.members) if layout else []
    alive = [m for m in current if m in members and m not in lost]
    alive += sorted(m for m in members if m not in alive and m not in lost)
    head: list[int] = []
    if local_data:
        holders = [m for m in alive if int(members[m].info.get("has-data", 0))]
        if not holders:
            raise PlanError(
                f"dataset {LOCAL_DATASET!r}: no member has node_config "
                "'dataset-path', so none can hold the first stage"
            )
        head = holders[:1]
    rest = [m for m in alive if m not in head]
    if len(head) + len(rest) > limit:
        fastest = sorted(rest, key=lambda m: power[m])
        keep = set(fastest[: limit - len(head)])
        rest = [m for m in rest if m in keep]
    return head + rest


def stage_limit(
    num_layers: int,
    planning: PipelinePlanning,
    pipelining: Pipelining,
    fixed_sizes: Sequence[int] | None,
) -> int:
    """Most stages a segment may have: one layer each, at most ``num_stages``,
    with 1F1B at most ``micro_batches``, at most the fixed partition's."""
    limit = min(num_layers, planning.num_stages or num_layers)
    if pipelining.schedule == "1f1b":
        limit = min(limit, pipelining.micro_batches)
    if fixed_sizes is not None:
        limit = min(limit, len(fixed_sizes))
    return limit


def segment_payloads(
    pending: Mapping[int, MemberPlan],
    sources: Sequence[LayerSource],
    arrays: ArrayRecord,
    central_optimizer: Mapping[str, np.ndarray],
    lr: float,
) -> tuple[
    dict[int, MemberPlan], dict[int, dict[str, np.ndarray]], dict[int, dict[str, Any]]
]:
    """Each member's plan at learning rate ``lr``, and the weights and optimiser
    state of the layers it takes from the central copy (``arrays``)."""
    central = {s.layer for s in sources if s.kind == "central"}
    plans, weights, optimizer = {}, {}, {}
    for node_id, plan in pending.items():
        plan = plan.with_changes(lr=lr)
        mine = set(plan.layers) & central
        plans[node_id] = plan
        weights[node_id] = {
            k: v.numpy() for k, v in arrays.items() if layer_of(k) in mine
        }
        optimizer[node_id] = {
            k: v for k, v in central_optimizer.items() if layer_of(k) in mine
        }
    return plans, weights, optimizer


def stage_table(
    layout: Layout, members: Mapping[int, SpanMember]
) -> list[dict[str, Any]]:
    """``layout``'s stages: ``{"node": id, "device": label, "layers": [a, b]}``
    (layers ``a .. b-1``), in stage order."""
    return [
        {
            "node": node,
            "device": members[node].label,
            "layers": [layout.bounds[rank], layout.bounds[rank + 1]],
        }
        for rank, node in enumerate(layout.members)
    ]
