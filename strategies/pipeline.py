"""PipelineTraining: one model trained across unequal boards as a pipeline.

FTPipeHD (Chen, Yang, He, Shi, Chen, arXiv 2110.02781; IEEE TMC 2023) on Flower:
the ServerApp is FTPipeHD's central node (it profiles, partitions, holds the
central copy of the weights, detects failures and re-plans); the boards run
``torch.distributed.pipelining`` stages peer-to-peer over gloo
(:mod:`flowerbed.parallel.pipeline.stage`). One Flower round is one segment of ``K``
synchronous steps (1F1B with a flush per step); when a loss interrupts it, the
round goes on from the recovered step until its ``K`` steps are done. The
decisions (partition, re-partition, restart step, layer sources) are pure
functions in :mod:`flowerbed.parallel.pipeline.planner` and
:mod:`flowerbed.parallel.pipeline.recovery`; this class moves plans, weights and
measurements.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flowerbed import keys
from flowerbed.models import layer_shapes
from flowerbed.parallel.pipeline.makespan import replications, step_s, throughput
from flowerbed.parallel.pipeline.planner import (
    KEEP,
    REPARTITION,
    Layout,
    PipelinePlanner,
)
from flowerbed.parallel.pipeline.recovery import (
    Holdings,
    MemberReport,
    layer_sources,
    recover,
)
from flowerbed.parallel.pipeline.stage import INPUT_SHAPE, LOCAL_DATASET
from flowerbed.parallel.plan import SCHEDULES, LayerSource, MemberPlan, PlanError
from flowerbed.parallel.reference import ReferenceJob
from flowerbed.parallel.store import layer_of
from flowerbed.parallel.user_code import Training, build_layers
from flowerbed.replies import ReplyRejected
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    MetricRecordValues,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.supercore import log

from .span import (
    SegmentOutcome,
    SegmentReply,
    SpanJobStrategy,
    SpanMember,
    arrayrecord,
    check_initial_arrays,
    check_segment_reply,
)
from .span_options import SpanGroup
from .span_sizing import (
    DEFAULT_SETUP_SHARE,
    SegmentSizer,
)

DEFAULT_LINK_BYTES_PER_S = 12.5e6
"""Assumed bandwidth of a link not yet measured: 100 Mbit/s (a Pi 3's Ethernet)."""

# Round metrics (the train MetricRecord of each round) ------------------------------
ROUND_STEP_S = "step-s"
"""Measured seconds per step (the slowest member's median)."""
ROUND_PREDICTED_STEP_S = "predicted-step-s"
"""The makespan model's seconds per step for the round's layout."""
ROUND_PARTITION = "partition"
"""Layers per stage, in stage order."""
ROUND_STAGES = "stages"
ROUND_LOST_STEPS = "lost-steps"
"""Steps recomputed after losses in the round."""
ROUND_RECOVERIES = "recoveries"
ROUND_REPARTITIONS = "repartitions"
DEFAULT_STEPS_PER_ROUND = 20
"""Steps of the first round's segment when the strategy sizes segments."""
ROUND_SECONDS = "round-s"
"""Clock seconds of the round (set-up, steps, recoveries)."""
ROUND_FAILURE_S = "failure-s"
"""Clock seconds the round's failed attempts cost beyond the steps they kept:
set-up, the lost steps, the time until the loss was known."""
ROUND_MODEL_STEP_S = "model-step-s"
"""The makespan model's step time from the stage times measured in this round
(the model's check; ``predicted-step-s`` is the forecast made before it)."""


@dataclass
class _Book:
    """What happened in one round."""

    lost_steps: int = 0
    recoveries: int = 0
    repartitions: int = 0
    failure_s: float = 0.0


class PipelineTraining(SpanJobStrategy):
    """Pipeline-parallel training over unequal boards (FTPipeHD), with recovery.

    **Profiling.** Every member times each layer's forward and backward pass on
    one micro-batch (on its own device, emulated or real). The fastest member is
    the reference; each member's *computing power* is its total over the
    reference's (FTPipeHD Sec. 4.1). Activation bytes per cut come from the
    model's shapes; link bandwidths from the replication exchanges (until
    measured: ``link_bandwidth``).

    **Partition.** FTPipeHD's dynamic programme (Sec. 4.2;
    :func:`flowerbed.parallel.pipeline.partition.partition`)::

        dp[j][s] = min_{i<j} max(dp[i][s-1], 2 * out_bytes[i] / bw[s-1],
                                 (T_fwd(i+1..j) + T_bwd(i+1..j)) * power[s])

    run over the ``k`` fastest members for every ``k``, keeping the best
    predicted step time (:mod:`flowerbed.parallel.pipeline.makespan`): a board so slow
    that one layer on it would pace the pipeline below what the others reach
    alone waits on standby.

    **Dynamic re-partition.** After each segment the measured per-stage times
    update every member's power (stages with under 10% of the compute keep
    theirs); if the new optimum's predicted step time
    ``t'`` beats the current ``t`` so that the gain over the remaining steps
    ``(t - t') * steps_left`` exceeds the cost of moving layers (their state
    bytes over the link bandwidth) and ``t' < (1 - repartition_threshold) t``,
    the next segment uses it; the log says when and why.

    **Fault tolerance** (FTPipeHD Sec. 4.3-4.4, synchronous variant). Every
    ``replicate_every`` (R) steps each stage sends its weights and optimiser
    state to its ring successor over torch.distributed (the last stage's to the
    first; its segment-end state also reaches the ServerApp with the reply, the
    central copy). When members are lost mid-segment, the ServerApp picks the
    newest step every layer still has a copy at among the survivors
    (:mod:`flowerbed.parallel.pipeline.recovery`; at most R steps lost after one loss or
    several non-adjacent ones, back to the central copy after adjacent ones),
    re-partitions over the survivors and tells each new stage where each layer
    comes from (itself, a peer, or the central copy in the message). A member
    that answers again later (a new node id after a restart) is profiled and
    used again.

    Parameters
    ----------
    (FedAvg's parameters, same defaults: ``fraction_train`` is the share of
    connected nodes taken as members, at least ``min_train_nodes``;
    ``min_available_nodes`` are awaited before profiling; ``fraction_evaluate``
    members evaluate the whole model each round), and:
    model : str
        The layered model every member builds: a name of
        ``flowerbed.models.SEQUENTIAL_MODELS`` or ``"package.module:function"``
        (importable on every board) returning an ``nn.Sequential``, or a module
        whose ``pipeline_layers()`` returns one
        (:func:`flowerbed.parallel.user_code.cut_points`); any other module is
        refused with a ``ModelCutError`` saying why. The job's arrays are the
        layered model's ``state_dict``.
    input_shape : sequence of int
        Shape of one sample, e.g. ``(3, 32, 32)``.
    model_args : dict, optional
        Keyword arguments of the model factory (JSON values).
    dataset : str (default: "digits")
        The first stage's training data: a name of
        ``flowerbed.parallel.job_data.JOB_DATASETS``, or ``"local"`` for the board's
        own ``dataset-path``.
    steps_per_round : int, optional (default: None)
        K, synchronous steps per round (segment), fixed. None: the strategy
        sizes segments itself, starting at 20 steps and growing them after
        each round so that set-up (Flower's delivery, the ClientApps' start,
        the rendezvous, weight moves) is at most ``setup_share`` of a round
        (:mod:`flowerbed.strategies.span_sizing`; each round's metrics say
        its ``setup-s`` and ``setup-share``).
    setup_share : float or None (default: 0.1)
        Largest share of a round set-up may take when ``steps_per_round`` is
        None; None keeps 20 steps per round.
    batch_size : int (default: 32)
        Samples per step (split into ``micro_batches``).
    micro_batches : int (default: 4)
        Micro-batches per step; 1F1B needs at least as many as stages.
    schedule : str (default: "1f1b")
        ``"1f1b"`` or ``"gpipe"``.
    replicate_every : int (default: 5)
        R: steps between replications (0: never; a loss then costs the segment).
    lr, momentum, weight_decay : float (defaults: 0.05, 0.0, 0.0)
        SGD's settings. A train config's ``lr`` overrides ``lr`` for its round.
    training : flowerbed.parallel.Training, optional
        A loss function and a ``torch.optim`` optimiser factory of your own, by
        ``"package.module:function"`` name (default: cross-entropy and SGD with
        the settings above; a factory gets ``lr`` and its own arguments).
    num_stages : int, optional
        Most members to use (default: all usable, at most one per layer, and
        with 1F1B at most ``micro_batches``); the fastest are kept. More than the
        model's layers is an error.
    stage_sizes : sequence of int, optional
        A fixed partition (layers per stage, in member order) instead of the DP;
        disables re-partitioning. Must sum to the model's layers.
    repartition : bool (default: True)
        Re-partition from measured times (see above).
    repartition_threshold : float (default: 0.1)
        Least relative step-time improvement worth a re-partition.
    link_bandwidth : float (default: 12.5e6)
        Bytes/s assumed for links not yet measured.
    profile_repeats : int (default: 3)
        Timed passes per layer when profiling.
    query_timeout_s : float (default: 120)
        How long profiling waits for a member.
    max_attempts : int (default: 10)
        Segment attempts per round before the run stops early (logged; the
        Result keeps the last good weights).
    seed : int (default: 0)
        Seed of the batch order (and of the model built on the server).
    group, checkpoint_path
        Where the members meet and how long they wait (a
        :class:`~flowerbed.strategies.span_options.SpanGroup`; its fields as
        keywords are deprecated), and the checkpoint file: see
        :class:`flowerbed.strategies.span.SpanJobStrategy`. A resumed job
        re-profiles the boards connected then and plans afresh from its step.

    Attributes
    ----------
    model, model_args, input_shape, dataset, seed
        The parameters of the same names, as given (``input_shape`` a tuple).
    planner : flowerbed.parallel.pipeline.planner.PipelinePlanner
        The planning state: reference per-layer times, every member's computing
        power, measured links, the current layout.
    members : dict of int to SpanMember
        Nodes admitted to the job (profiled, with an address).
    lost : set of int
        Members that died or failed a plan the others could run.
    refused : dict of int to str
        Nodes that cannot take part, and why.
    step : int
        The global step the next segment starts from: the steps completed, or
        after a loss the step recovery restarts from.
    events : list of str
        Re-partitions and recoveries, as logged.
    layouts : dict of int to list of dict
        Round -> its stages: ``{"node": id, "device": label, "layers": [a, b]}``.
    profiled_power : dict of int to float
        Node -> computing power measured when it was admitted.
    """

    mode = "pipeline"

    # pylint: disable=too-many-arguments,too-many-locals
    def __init__(
        self,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 2,
        min_evaluate_nodes: int = 2,
        min_available_nodes: int = 2,
        weighted_by_key: str = keys.NUM_EXAMPLES,
        arrayrecord_key: str = keys.ARRAYS,
        configrecord_key: str = keys.CONFIG,
        train_metrics_aggr_fn: Callable[[list[RecordDict], str], MetricRecord]
        | None = None,
        evaluate_metrics_aggr_fn: Callable[[list[RecordDict], str], MetricRecord]
        | None = None,
        *,
        model: str = "",
        input_shape: Sequence[int] = (),
        model_args: Mapping[str, Any] | None = None,
        dataset: str = "digits",
        steps_per_round: int | None = None,
        setup_share: float | None = DEFAULT_SETUP_SHARE,
        batch_size: int = 32,
        micro_batches: int = 4,
        schedule: str = "1f1b",
        replicate_every: int = 5,
        lr: float = 0.05,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        num_stages: int | None = None,
        stage_sizes: Sequence[int] | None = None,
        repartition: bool = True,
        repartition_threshold: float = 0.1,
        link_bandwidth: float = DEFAULT_LINK_BYTES_PER_S,
        profile_repeats: int = 3,
        query_timeout_s: float = 120.0,
        max_attempts: int = 10,
        seed: int = 0,
        training: Training | None = None,
        group: SpanGroup | None = None,
        checkpoint_path: str | Path | None = None,
        **legacy: Any,
    ) -> None:
        super().__init__(
            fraction_train,
            fraction_evaluate,
            min_train_nodes,
            min_evaluate_nodes,
            min_available_nodes,
            weighted_by_key,
            arrayrecord_key,
            configrecord_key,
            train_metrics_aggr_fn,
            evaluate_metrics_aggr_fn,
            group=group,
            checkpoint_path=checkpoint_path,
            **legacy,
        )
        checks = [
            (bool(model), "model is required: a layered model name or 'pkg.mod:fn'"),
            (len(input_shape) > 0, "input_shape is required, e.g. (1, 8, 8)"),
            (
                steps_per_round is None or steps_per_round >= 1,
                "steps_per_round must be >= 1 (or None: sized by setup_share)",
            ),
            (micro_batches >= 1, "micro_batches must be >= 1"),
            (
                batch_size >= 1 and batch_size % max(micro_batches, 1) == 0,
                "batch_size must be a positive multiple of micro_batches",
            ),
            (schedule in SCHEDULES, f"schedule must be one of {', '.join(SCHEDULES)}"),
            (replicate_every >= 0, "replicate_every must be >= 0"),
            (lr > 0, "lr must be > 0"),
            (momentum >= 0 and weight_decay >= 0, "momentum, weight_decay >= 0"),
            (num_stages is None or num_stages >= 1, "num_stages must be >= 1"),
            (0 <= repartition_threshold < 1, "repartition_threshold must be in [0, 1)"),
            (link_bandwidth > 0, "link_bandwidth must be > 0"),
            (profile_repeats >= 1, "profile_repeats must be >= 1"),
            (max_attempts >= 1, "max_attempts must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self.model = model
        self.model_args = dict(model_args or {})
        self.input_shape = tuple(int(v) for v in input_shape)
        self.dataset = dataset
        self.sizer = SegmentSizer(
            DEFAULT_STEPS_PER_ROUND if steps_per_round is None else steps_per_round,
            setup_share if steps_per_round is None else None,
        )
        self.batch_size = batch_size
        self.micro_batches = micro_batches
        self.schedule = schedule
        self.replicate_every = replicate_every
        self.lr = lr
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.profile_repeats = profile_repeats
        self.query_timeout_s = query_timeout_s
        self.max_attempts = max_attempts
        self.seed = seed
        self.training = Training() if training is None else training
        self.training.check()  # a name that does not import fails here
        # Build the model here, so that bad input fails before any message.
        net = build_layers(model, self.model_args, seed=seed)
        self.num_layers = len(net)
        if num_stages is not None and num_stages > self.num_layers:
            raise PlanError(
                f"num_stages={num_stages} but model {model!r} has only "
                f"{self.num_layers} layers: every stage needs at least one layer"
            )
        if stage_sizes is not None and (
            any(s < 1 for s in stage_sizes) or sum(stage_sizes) != self.num_layers
        ):
            raise PlanError(
                f"stage_sizes {list(stage_sizes)} must be positive and sum to the "
                f"model's {self.num_layers} layers"
            )
        self.num_stages = num_stages
        micro = batch_size // micro_batches
        with torch.no_grad():
            shapes = layer_shapes(net, torch.zeros((micro, *self.input_shape)))
        self.reference_state = {k: tuple(v.shape) for k, v in net.state_dict().items()}
        state_bytes = [0.0] * self.num_layers
        for name, tensor in net.state_dict().items():
            state_bytes[layer_of(name)] += tensor.numel() * tensor.element_size()
        # optimiser state travels with the weights: a momentum buffer, or (a
        # factory's optimiser, Adam-like) two moment buffers
        factor = 3 if self.training.custom_optimizer else 2 if momentum > 0 else 1
        self.planner = PipelinePlanner(
            out_bytes=[4.0 * math.prod(shape) for shape in shapes[1:]],
            state_bytes=[factor * b for b in state_bytes],
            micro_batches=micro_batches,
            schedule=schedule,
            link_bandwidth=link_bandwidth,
            repartition=repartition and stage_sizes is None,
            threshold=repartition_threshold,
            fixed_sizes=tuple(stage_sizes) if stage_sizes is not None else None,
        )
        # The run's state.
        self.members: dict[int, SpanMember] = {}
        """Nodes admitted to the job (profiled, with an address)."""
        self.evaluate_timeout_s = query_timeout_s
        self.job = ""
        self.layout: Layout | None = None
        self.central: dict[str, np.ndarray] = {}
        self.holdings = Holdings(self.num_layers)
        self.events: list[str] = []
        """Re-partitions and recoveries, as logged."""
        self.layouts: dict[int, list[dict[str, Any]]] = {}
        """Round -> its stages: ``{"node": id, "device": label, "layers": [a, b]}``
        (layers ``a .. b-1``), in stage order."""
        self.profiled_power: dict[int, float] = {}
        """Node -> computing power measured when it was admitted."""
        self._pending: dict[int, MemberPlan] = {}
        self._sources: tuple[LayerSource, ...] = ()

    @property
    def steps_per_round(self) -> int:
        """The steps of the next round's segment (see ``steps_per_round``)."""
        return self.sizer.steps

    def reference_job(self) -> ReferenceJob:
        """This job as one device would train it: pass it to
        :func:`flowerbed.parallel.reference.single_device` to check a run (a
        train config's ``lr`` override is not part of it)."""
        return ReferenceJob(
            model=self.model,
            model_args=self.model_args,
            dataset=self.dataset,
            batch_size=self.batch_size,
            seed=self.seed,
            lr=self.lr,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            training=self.training,
            layered=True,
        )

    def summary(self) -> None:
        log(
            INFO,
            "\t├── PipelineTraining: model %s (%d layers), %d steps/round, batch %d "
            "in %d micro-batches, %s, replicate every %d steps",
            self.model,
            self.num_layers,
            self.steps_per_round,
            self.batch_size,
            self.micro_batches,
            self.schedule,
            self.replicate_every,
        )
        log(INFO, "\t└── %s", self.training.describe("SGD"))

    # ------------------------------------------------------------------ members
    def _request(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "model": self.model,
            "model_args": self.model_args,
            "micro_batch": self.batch_size // self.micro_batches,
            INPUT_SHAPE: list(self.input_shape),
            "repeats": self.profile_repeats,
            "dataset": self.dataset,
            "step": self.step,
        }

    def admit(self, grid: Grid, node_ids: Iterable[int]) -> list[int]:
        """Profile the nodes not yet known; add the usable ones as members."""
        ids = [
            n
            for n in node_ids
            if n not in self.members and n not in self.lost and n not in self.refused
        ]
        if not ids:
            return []
        found, errors = self.profile_members(
            grid, ids, self._request(), self.query_timeout_s
        )
        self.refused.update(errors)
        profiles = {}
        for node_id, member in found.items():
            try:
                profiles[node_id] = (
                    _layer_times(
                        member.metrics, keys.SPAN_LAYER_FORWARD_S, self.num_layers
                    ),
                    _layer_times(
                        member.metrics, keys.SPAN_LAYER_BACKWARD_S, self.num_layers
                    ),
                )
            except ReplyRejected as err:
                self.refused[node_id] = err.reason
                log(WARNING, "node %d: bad profile: %s", node_id, err.reason)
                continue
            self.members[node_id] = member
        self.planner.profiled(profiles)
        self.profiled_power.update({n: self.planner.power[n] for n in profiles})
        if profiles and self.layout is not None:
            log(INFO, "PipelineTraining: new members %s", sorted(profiles))
        return sorted(profiles)

    def _usable(self) -> list[int]:
        """Candidate members in stage order: the current layout's, then the
        others; a data holder first when the dataset is the boards' own; the
        fastest when there are more than stages allowed. The planner may leave
        slow ones on standby."""
        current = list(self.layout.members) if self.layout else []
        alive = [m for m in current if m in self.members and m not in self.lost]
        alive += sorted(
            m for m in self.members if m not in alive and m not in self.lost
        )
        head: list[int] = []
        if self.dataset == LOCAL_DATASET:
            holders = [m for m in alive if int(self.members[m].info.get("has-data", 0))]
            if not holders:
                raise PlanError(
                    "dataset 'local': no member has node_config 'dataset-path', so "
                    "none can hold the first stage"
                )
            head = holders[:1]
        limit = min(self.num_layers, self.num_stages or self.num_layers)
        if self.schedule == "1f1b":
            limit = min(limit, self.micro_batches)
        if self.planner.fixed_sizes is not None:
            limit = min(limit, len(self.planner.fixed_sizes))
        rest = [m for m in alive if m not in head]
        if len(head) + len(rest) > limit:
            fastest = sorted(rest, key=lambda m: self.planner.power[m])
            keep = set(fastest[: limit - len(head)])
            rest = [m for m in rest if m in keep]
        return head + rest

    # ------------------------------------------------------------------ Flower API
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The planned segment's messages: each member's plan (``lr`` from the
        config when it has one) and the layers it takes from ``arrays``."""
        del grid
        lr = config.get(keys.LEARNING_RATE, self.lr)
        if isinstance(lr, bool) or not isinstance(lr, int | float) or lr <= 0:
            lr = self.lr
        central = {s.layer for s in self._sources if s.kind == "central"}
        config = ConfigRecord(dict(config))
        config[keys.SERVER_ROUND] = server_round
        plans, weights, optimizer = {}, {}, {}
        for node_id, pending in self._pending.items():
            plan = pending.with_changes(lr=float(lr))
            mine = set(plan.layers) & central
            plans[node_id] = plan
            weights[node_id] = {
                k: v.numpy() for k, v in arrays.items() if layer_of(k) in mine
            }
            optimizer[node_id] = {
                k: v for k, v in self.central_optimizer.items() if layer_of(k) in mine
            }
        return self.segment_messages(plans, weights, optimizer, config, self._timeout)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Stitch the members' layers into the whole model.

        The replies must all report a finished segment and together hold every
        state array of the model exactly once, with its shape; otherwise the
        result is ``(None, None)`` (a failed segment) and the reason logged.
        """
        checked = []
        for reply in replies:
            try:
                if reply.has_error():
                    raise ReplyRejected(reply.error.reason or "error reply")
                checked.append(self.check_reply(check_segment_reply(reply)))
            except ReplyRejected as err:
                log(WARNING, "round %d: rejected reply: %s", server_round, err.reason)
                return None, None
        return self._stitch(checked)

    def check_reply(self, reply: SegmentReply) -> SegmentReply:
        """Reject arrays the model does not have, wrong shapes, a bad listing."""
        for name, value in reply.arrays.items():
            if name not in self.reference_state:
                raise ReplyRejected(f"unexpected array {name!r}")
            if tuple(value.shape) != self.reference_state[name]:
                raise ReplyRejected(
                    f"array {name!r} has shape {tuple(value.shape)}, expected "
                    f"{self.reference_state[name]}"
                )
        holds = reply.metrics.get(keys.SPAN_HOLDS, [])
        if not isinstance(holds, list) or len(holds) % 3:
            raise ReplyRejected(f"{keys.SPAN_HOLDS!r} must be a list of triples")
        return reply

    def _stitch(
        self, replies: Sequence[SegmentReply]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        arrays: dict[str, np.ndarray] = {}
        for reply in replies:
            if not reply.ok:
                return None, None
            for name, value in reply.arrays.items():
                if name in arrays:
                    log(WARNING, "array %s came from two members", name)
                    return None, None
                arrays[name] = value
        missing = sorted(set(self.reference_state) - set(arrays))
        if missing:
            log(WARNING, "the replies lack arrays %s", missing[:5])
            return None, None
        steps = min(int(_num(r.metrics.get(keys.NUM_STEPS, 0))) for r in replies)
        losses = [
            _num(r.metrics[keys.TRAIN_LOSS])
            for r in replies
            if keys.TRAIN_LOSS in r.metrics
        ]
        metrics: dict[str, MetricRecordValues] = {
            keys.NUM_EXAMPLES: steps * self.batch_size,
            keys.NUM_STEPS: steps,
        }
        if losses:
            metrics[keys.TRAIN_LOSS] = float(np.mean(losses))
        ordered = {name: arrays[name] for name in self.reference_state}
        return arrayrecord(ordered), MetricRecord(metrics)

    def evaluation_query(self) -> dict[str, Any]:
        """The evaluate messages' query: the layered model and the data."""
        return {
            "mode": self.mode,
            "model": self.model,
            "model_args": self.model_args,
            "dataset": self.dataset,
        }

    def live_members(self) -> list[int]:
        return sorted(m for m in self.members if m not in self.lost)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Evaluation messages to ``fraction_evaluate`` of the live members (at
        least ``min_evaluate_nodes``) with the whole model and
        :meth:`evaluation_query`. Unlike FedAvg it never waits for nodes to
        connect: lost boards are not asked."""
        del grid
        if self.fraction_evaluate == 0.0:
            return []
        live = self.live_members()
        count = max(
            math.ceil(len(live) * self.fraction_evaluate), self.min_evaluate_nodes
        )
        config = ConfigRecord(dict(config))
        config[keys.SERVER_ROUND] = server_round
        config[keys.SPAN_QUERY] = json.dumps(self.evaluation_query(), sort_keys=True)
        content = RecordDict(
            {self.arrayrecord_key: arrays, self.configrecord_key: config}
        )
        return [
            Message(content, dst_node_id=node_id, message_type=MessageType.EVALUATE)
            for node_id in live[:count]
        ]

    # ------------------------------------------------------------------ the rounds
    def _check_initial(self, initial_arrays: ArrayRecord) -> None:
        check_initial_arrays(initial_arrays, self.reference_state, self.model)

    def _prepare_run(self, grid: Grid, done: int) -> None:
        """A new job whose central copy is the (resumed) model; admit
        ``fraction_train`` of the connected nodes (at least ``min_train_nodes``)."""
        del done
        self.job = f"pipe-{uuid.uuid4().hex[:12]}"
        self.central = dict(self._global_np)
        self.holdings = Holdings(self.num_layers, central_step=self.step)
        nodes = self.discover(grid, 10**6, self._timeout)
        take = max(self.min_train_nodes, math.ceil(len(nodes) * self.fraction_train))
        self.admit(grid, nodes[:take])
        self._require_members(len(self.members))

    def _evaluate_wait(self) -> float:
        return self.evaluate_timeout_s

    def _event(self, text: str, quiet: bool = False) -> None:
        if not quiet:
            self.events.append(text)
        log(INFO, "PipelineTraining: %s", text)

    def _segment_round(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> tuple[ArrayRecord | None, MetricRecord | None] | None:
        """Admit newcomers, then segments until the round's K steps are done,
        recovering from losses (each from the central copy: ``arrays``' values)."""
        del arrays
        self.admit(grid, grid.get_node_ids())  # newcomers, returning boards
        end = self.step + self.steps_per_round
        later = (self._num_rounds - server_round) * self.steps_per_round
        book = _Book()
        began = self.clock.now()
        for attempt in range(1, self.max_attempts + 1):
            try:
                usable = self._usable()
                required = usable[:1] if self.dataset == LOCAL_DATASET else []
                decision = self.planner.decide(
                    self.layout, usable, end - self.step + later, required
                )
            except PlanError as err:
                log(WARNING, "round %d: %s", server_round, err)
                return None
            self._event(
                f"step {self.step}: {decision.kind}: {decision.reason}",
                quiet=decision.kind == KEEP,
            )
            book.repartitions += decision.kind == REPARTITION
            layout = decision.layout
            previous = self.layout.owner() if self.layout else {}
            self._sources = layer_sources(
                self.holdings, layout.bounds, layout.members, self.step, previous
            )
            self._pending = self._plans(layout, end - self.step)
            messages = self.configure_train(
                server_round, arrayrecord(self.central), config, grid
            )
            outcome = self.run_segment(
                messages, server_round, self._timeout, self.check_reply
            )
            self.layout = layout
            if outcome.complete:
                stitched, metrics = self._stitch(list(outcome.replies.values()))
                if stitched is not None and metrics is not None:
                    return self._finish(
                        server_round, layout, outcome, stitched, metrics, book, began
                    )
            self._recover(server_round, layout, outcome, book, attempt)
        return None

    def _plans(self, layout: Layout, steps: int) -> dict[int, MemberPlan]:
        segment, port = self.next_segment()
        host = self.members[layout.members[0]].address
        return {
            member: MemberPlan(
                mode=self.mode,
                job=self.job,
                segment=segment,
                rank=rank,
                world_size=len(layout.members),
                host=host,
                port=port,
                start_step=self.step,
                steps=steps,
                batch_size=self.batch_size,
                seed=self.seed,
                micro_batches=self.micro_batches,
                schedule=self.schedule,
                replicate_every=self.replicate_every,
                join_timeout_s=self.join_timeout_s,
                timeout_s=self.timeout_s,
                model=self.model,
                model_args=self.model_args,
                dataset=self.dataset,
                lr=self.lr,
                momentum=self.momentum,
                weight_decay=self.weight_decay,
                partition=layout.bounds,
                sources=self._sources,
                options={
                    INPUT_SHAPE: list(self.input_shape),
                    **self.training.to_options(),
                },
            )
            for rank, member in enumerate(layout.members)
        }

    def _finish(
        self,
        server_round: int,
        layout: Layout,
        outcome: SegmentOutcome,
        stitched: ArrayRecord,
        metrics: MetricRecord,
        book: _Book,
        began: float,
    ) -> tuple[ArrayRecord, MetricRecord]:
        """A completed segment: the replies become the central copy."""
        steps = int(_num(metrics[keys.NUM_STEPS]))
        first = self.step
        self.step += steps
        self.central = {k: v.numpy() for k, v in stitched.items()}
        self.central_optimizer = {}
        for reply in outcome.replies.values():
            self.central_optimizer.update(reply.optimizer)
        self.holdings = Holdings(self.num_layers, central_step=self.step)
        for node_id, reply in outcome.replies.items():
            self.holdings.add_report(node_id, _ints(reply.metrics[keys.SPAN_HOLDS]))
        _, predicted = self.planner.predict(layout)
        self.layouts[server_round] = [
            {
                "node": node,
                "device": self.members[node].label,
                "layers": [layout.bounds[rank], layout.bounds[rank + 1]],
            }
            for rank, node in enumerate(layout.members)
        ]
        replies = outcome.replies
        self.planner.measured(
            layout,
            {
                n: _num(r.metrics.get(keys.SPAN_FORWARD_S, 0))
                + _num(r.metrics.get(keys.SPAN_BACKWARD_S, 0))
                for n, r in replies.items()
            },
            {
                n: _num(r.metrics.get(keys.SPAN_LINK_BYTES_PER_S, 0))
                for n, r in replies.items()
            },
        )
        measured = max(
            _num(r.metrics.get(keys.SPAN_STEP_S, 0)) for r in replies.values()
        )
        out = dict(metrics)
        # A step's cost includes its share of the ring replications: they are
        # paid per step, not once per segment like the set-up.
        replicate = max(
            _num(r.metrics.get(keys.SPAN_REPLICATE_S, 0)) for r in replies.values()
        )
        per_step = measured + (
            replicate / self.replicate_every if self.replicate_every else 0.0
        )
        out.update(
            self._measure_setup(
                server_round,
                outcome.seconds,
                steps,
                per_step,
                (r.metrics for r in replies.values()),
            )
        )
        out.update(
            {
                keys.SAMPLES_PER_S: throughput(self.batch_size, measured),
                ROUND_STEP_S: measured,
                ROUND_PREDICTED_STEP_S: predicted,
                ROUND_PARTITION: layout.sizes,
                ROUND_STAGES: len(layout.members),
                ROUND_LOST_STEPS: book.lost_steps,
                ROUND_RECOVERIES: book.recoveries,
                ROUND_REPARTITIONS: book.repartitions,
                ROUND_SECONDS: self.clock.now() - began,
                ROUND_FAILURE_S: book.failure_s,
                ROUND_MODEL_STEP_S: self._model_step_s(layout, replies),
                "replications": replications(first, steps, self.replicate_every),
            }
        )
        return stitched, MetricRecord(out)

    def _model_step_s(
        self, layout: Layout, replies: Mapping[int, SegmentReply]
    ) -> float:
        """The makespan model on this round's measured per-stage times."""
        fwd = [
            _num(replies[m].metrics.get(keys.SPAN_FORWARD_S, 0)) for m in layout.members
        ]
        bwd = [
            _num(replies[m].metrics.get(keys.SPAN_BACKWARD_S, 0))
            for m in layout.members
        ]
        cuts = [
            self.planner.out_bytes[layout.bounds[s + 1] - 1]
            / self.planner.link(layout.members[s], layout.members[s + 1])
            for s in range(len(layout.members) - 1)
        ]
        return step_s(fwd, bwd, self.micro_batches, cuts, self.schedule)

    def _recover(
        self,
        server_round: int,
        layout: Layout,
        outcome: SegmentOutcome,
        book: _Book,
        attempt: int,
    ) -> None:
        """After a failed segment: drop lost members, pick the restart step."""
        for node_id in outcome.failed_members:
            self.lost.add(node_id)
            self.planner.forget(node_id)
        for node_id, reason in outcome.errors.items():
            if node_id not in outcome.port_errors and node_id in layout.members:
                # The plan suited the others: this board cannot run it.
                self.refused[node_id] = reason
                self.lost.add(node_id)
                self.planner.forget(node_id)
        reports = {
            node_id: MemberReport(
                ok=reply.ok,
                steps=int(_num(reply.metrics.get(keys.NUM_STEPS, 0))),
                failed_step=int(_num(reply.metrics.get(keys.SPAN_FAILED_STEP, -1))),
                holds=_ints(reply.metrics.get(keys.SPAN_HOLDS, [])),
            )
            for node_id, reply in outcome.replies.items()
        }
        survivors = [m for m in self.members if m not in self.lost]
        found = recover(self.holdings, self.step, reports, outcome.errors, survivors)
        book.lost_steps += found.lost_steps
        book.recoveries += 1
        # The attempt's time not kept: its set-up, the lost steps, the detection.
        per_step = max(
            (
                _num(r.metrics.get(keys.SPAN_STEP_S, 0))
                for r in outcome.replies.values()
            ),
            default=0.0,
        )
        kept = max(0, found.restart - self.step)
        book.failure_s += max(0.0, outcome.seconds - kept * per_step)
        self.holdings = found.holdings
        self._event(
            f"step {found.reached}: attempt {attempt} of round {server_round} failed "
            f"(lost members {sorted(outcome.failed_members)}, errors "
            f"{sorted(outcome.errors)}); restart at step {found.restart}, "
            f"{found.lost_steps} steps lost"
            + (" (from the central copy)" if found.from_central else "")
        )
        self.step = found.restart


def _num(value: Any) -> float:
    """A checked metric (check_segment_reply made it finite) as a float."""
    return float(value) if isinstance(value, int | float) else 0.0


def _ints(values: Any) -> list[int]:
    return [int(v) for v in values] if isinstance(values, list) else []


def _layer_times(metrics: Mapping[str, Any], key: str, layers: int) -> list[float]:
    values = metrics.get(key)
    if not isinstance(values, list) or len(values) != layers:
        raise ReplyRejected(f"{key!r} must list {layers} per-layer seconds")
    out = [float(v) for v in values]
    if any(not math.isfinite(v) or v < 0 for v in out):
        raise ReplyRejected(f"{key!r} holds a negative or non-finite time")
    return out
