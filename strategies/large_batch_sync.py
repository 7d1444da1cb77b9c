"""LargeBatchSync: large-batch synchronous data parallelism across boards (S1).

Flower is the control plane, DDP over gloo the data plane (docs/architecture.md,
"Jobs that span devices"): the strategy profiles the boards, forms a cohort,
gives each member its rank, the rendezvous, its share of the global batch and
the optimiser settings with the weights; members run ``DistributedDataParallel``
for a segment of ``steps_per_round`` steps (one Flower round,
:mod:`flowerbed.parallel.large_batch.allreduce`) and reply with the weights and per-step
compute and communication seconds.

- **Shares by speed**: ``B_i = B s_i / sum_j s_j`` with ``s_i`` the member's
  measured samples per second (profiled, then smoothed over segments:
  ``s <- a s_new + (1 - a) s``), so unequal devices finish each step together
  (:func:`flowerbed.parallel.large_batch.recipe.batch_shares`); the loss is scaled so
  the gradient is exactly the large batch's.
- **Recipe**: linear LR scaling with gradual warm-up (Goyal et al. 2017) and
  momentum SGD, LARS (You et al. 2017) or LAMB (You et al. 2020),
  :mod:`flowerbed.parallel.large_batch.optimizers`; optional fp16 or PowerSGD gradient
  compression (DDP's communication hooks).
- **Failures**: a member lost mid-segment makes the segment fail fast (the
  survivors' collectives raise within ``timeout_s``); the strategy drops the lost
  member and repeats the segment with the rest, re-sharing the batch, from the
  last weights (at most ``max_attempts`` tries per round). A board that comes
  back registers as a new Flower node and is profiled and admitted again.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable, Iterable, Mapping
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flowerbed import keys
from flowerbed.parallel.large_batch.optimizers import OPTIMIZERS
from flowerbed.parallel.large_batch.recipe import LrSchedule, batch_shares, share_bounds
from flowerbed.parallel.plan import MemberPlan
from flowerbed.parallel.reference import ReferenceJob
from flowerbed.parallel.user_code import Training, build_module
from flowerbed.replies import ReplyRejected
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.supercore import log

from .span import (
    DEFAULT_JOIN_TIMEOUT_S,
    DEFAULT_RENDEZVOUS_PORT,
    DEFAULT_RENDEZVOUS_PORTS,
    DEFAULT_REPLY_MARGIN_S,
    DEFAULT_TIMEOUT_S,
    SegmentOutcome,
    SegmentReply,
    SpanJobStrategy,
    arrayrecord,
    check_initial_arrays,
    check_segment_reply,
)
from .span_sizing import (
    DEFAULT_SETUP_SHARE,
    SegmentSizer,
)

COMPRESSIONS = ("none", "fp16", "powersgd")
DEFAULT_STEPS_PER_ROUND = 10
"""Steps of the first round's segment when the strategy sizes segments."""
ROUND_MEMBERS = "members"
ROUND_ATTEMPTS = "attempts"
ROUND_STEP_S = "step-s"
ROUND_COMPUTE_S = "compute-s"
ROUND_COMM_S = "comm-s"
ROUND_SAMPLES_PER_S = "samples-per-s"
ROUND_REPLICA_DIFF = "replica-max-diff"
ROUND_LR = "lr"
REPLICA_TOLERANCE = 1e-4
"""Largest absolute difference between replicas before a warning is logged."""


class LargeBatchSync(SpanJobStrategy):
    """Large-batch synchronous training with all-reduce across boards (module doc).

    Parameters
    ----------
    fraction_train, fraction_evaluate, min_train_nodes, min_evaluate_nodes,
    min_available_nodes, weighted_by_key, arrayrecord_key, configrecord_key,
    train_metrics_aggr_fn, evaluate_metrics_aggr_fn
        As in Flower's FedAvg (same defaults). ``fraction_train`` and
        ``min_train_nodes`` bound the cohort; ``fraction_evaluate`` > 0 sends
        the whole model to that share of members for evaluation after a round.
    model : str (default: "deep-mlp")
        Any ``nn.Module``: a name of ``flowerbed.models.SEQUENTIAL_MODELS`` or a
        factory ``"package.module:function"`` importable on every board
        (:func:`flowerbed.parallel.user_code.build_module`); data parallelism
        cuts nothing, so it need not be an ``nn.Sequential``.
    model_args : dict, optional
        Its arguments.
    dataset : str (default: "digits")
        A job dataset (``flowerbed.parallel.job_data``) or ``"local"`` (each board's
        node_config ``dataset-path``).
    batch_size : int (default: 256)
        ``B``, the global batch per step.
    steps_per_round : int, optional (default: None)
        ``K``, steps per segment (one Flower round), fixed. None: the strategy
        sizes segments itself, starting at 10 steps and growing them after
        each round so that set-up (Flower's delivery, the ClientApps' start,
        the rendezvous) is at most ``setup_share`` of a round
        (:mod:`flowerbed.strategies.span_sizing`; each round's metrics say
        its ``setup-s`` and ``setup-share``).
    setup_share : float or None (default: 0.1)
        Largest share of a round set-up may take when ``steps_per_round`` is
        None; None keeps 10 steps per round.
    optimizer : str (default: "lars")
        ``"sgd"`` (momentum), ``"lars"`` or ``"lamb"`` (ignored when
        ``training`` names an optimiser factory).
    base_lr : float (default: 0.1)
        ``eta`` for ``base_batch`` (Goyal et al.'s ResNet-50: 0.1 for 256).
    base_batch : int (default: 256)
        ``B_ref``; the peak rate is ``base_lr * batch_size / base_batch``.
    warmup_steps : int (default: 0)
        Gradual warm-up length ``T_w`` in steps.
    decay_steps : int (default: 0)
        Total steps of the polynomial decay after warm-up (0: none).
    momentum, weight_decay : float (default: 0.9, 0.0)
        Optimiser settings (LAMB ignores momentum).
    trust : float (default: 0.001)
        LARS's trust coefficient.
    compression : str (default: "none")
        ``"none"``, ``"fp16"`` or ``"powersgd"``.
    powersgd_rank : int (default: 1)
        PowerSGD's approximation rank.
    profile_batch, profile_repeats : int (default: 8, 3)
        Samples per timed step and steps timed when profiling a board.
    speed_smoothing : float (default: 0.5)
        ``a``, weight of a segment's speed measurement.
    max_attempts : int (default: 3)
        Segments tried per round before the run stops.
    seed : int (default: 0)
        Data order (the batch of step ``t`` depends on ``seed`` and ``t``).
    training : flowerbed.parallel.Training, optional
        A loss function and a ``torch.optim`` optimiser factory of your own, by
        ``"package.module:function"`` name (default: cross-entropy and
        ``optimizer``); a factory steps at the schedule's rate.
    query_timeout_s : float (default: 60)
        How long to wait for profiling answers.
    rendezvous_port, rendezvous_ports, join_timeout_s, timeout_s, reply_margin_s,
    checkpoint_path
        As in :class:`~flowerbed.strategies.span.SpanJobStrategy` (a resumed job
        profiles the boards connected then).

    Attributes
    ----------
    model, model_args, dataset, seed
        The parameters of the same names, as given.
    schedule : flowerbed.parallel.large_batch.recipe.LrSchedule
        The learning-rate schedule built from ``base_lr``, ``base_batch``,
        ``batch_size``, ``warmup_steps`` and ``decay_steps``.
    speeds : dict of int to float
        Smoothed samples per second of each member.
    cohort : list of int
        The members of the last planned segment, in rank order.
    lost : set of int
        Members dropped after a failed segment, no longer planned.
    refused : dict of int to str
        Nodes that cannot take part, and why.
    step : int
        Global steps completed.
    """

    mode = "allreduce"

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
        model: str = "deep-mlp",
        model_args: Mapping[str, Any] | None = None,
        dataset: str = "digits",
        batch_size: int = 256,
        steps_per_round: int | None = None,
        setup_share: float | None = DEFAULT_SETUP_SHARE,
        optimizer: str = "lars",
        base_lr: float = 0.1,
        base_batch: int = 256,
        warmup_steps: int = 0,
        decay_steps: int = 0,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust: float = 0.001,
        compression: str = "none",
        powersgd_rank: int = 1,
        profile_batch: int = 8,
        profile_repeats: int = 3,
        speed_smoothing: float = 0.5,
        max_attempts: int = 3,
        seed: int = 0,
        training: Training | None = None,
        query_timeout_s: float = 60.0,
        rendezvous_port: int = DEFAULT_RENDEZVOUS_PORT,
        rendezvous_ports: int = DEFAULT_RENDEZVOUS_PORTS,
        join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        reply_margin_s: float = DEFAULT_REPLY_MARGIN_S,
        checkpoint_path: str | Path | None = None,
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
            rendezvous_port=rendezvous_port,
            rendezvous_ports=rendezvous_ports,
            join_timeout_s=join_timeout_s,
            timeout_s=timeout_s,
            reply_margin_s=reply_margin_s,
            checkpoint_path=checkpoint_path,
        )
        checks = [
            (
                optimizer in OPTIMIZERS,
                f"optimizer {optimizer!r}; valid choices: {', '.join(OPTIMIZERS)}",
            ),
            (
                compression in COMPRESSIONS,
                f"compression {compression!r}; valid choices: "
                f"{', '.join(COMPRESSIONS)}",
            ),
            (
                batch_size >= max(1, min_train_nodes),
                f"batch_size {batch_size} cannot give min_train_nodes "
                f"({min_train_nodes}) members one sample each per step",
            ),
            (
                steps_per_round is None or steps_per_round >= 1,
                "steps_per_round must be >= 1 (or None: sized by setup_share)",
            ),
            (powersgd_rank >= 1, "powersgd_rank must be >= 1"),
            (profile_batch >= 1 and profile_repeats >= 1, "profiling needs >= 1"),
            (0 < speed_smoothing <= 1, "speed_smoothing must be in (0, 1]"),
            (max_attempts >= 1, "max_attempts must be >= 1"),
            (query_timeout_s > 0, "query_timeout_s must be > 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self.schedule = LrSchedule(
            base_lr=base_lr,
            base_batch=base_batch,
            batch_size=batch_size,
            warmup_steps=warmup_steps,
            total_steps=decay_steps,
        )
        self.model = model
        self.model_args = dict(model_args or {})
        self.training = Training() if training is None else training
        self.training.check()  # a name that does not import fails here
        reference = build_module(model, self.model_args, seed=0)
        self.reference_state = {
            k: tuple(v.shape) for k, v in reference.state_dict().items()
        }
        self.dataset = dataset
        self.batch_size = batch_size
        self.sizer = SegmentSizer(
            DEFAULT_STEPS_PER_ROUND if steps_per_round is None else steps_per_round,
            setup_share if steps_per_round is None else None,
        )
        self.optimizer = optimizer
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.trust = trust
        self.compression = compression
        self.powersgd_rank = powersgd_rank
        self.profile_batch = profile_batch
        self.profile_repeats = profile_repeats
        self.speed_smoothing = speed_smoothing
        self.max_attempts = max_attempts
        self.seed = seed
        self.query_timeout_s = query_timeout_s
        self.speeds: dict[int, float] = {}
        """Smoothed samples per second of each member."""
        self.addresses: dict[int, str] = {}
        self.job = ""
        self.cohort: list[int] = []
        self._plans: dict[int, MemberPlan] = {}

    def reference_job(self) -> ReferenceJob:
        """This job as one device would train it: pass it to
        :func:`flowerbed.parallel.reference.single_device` to check a run."""
        return ReferenceJob(
            model=self.model,
            model_args=self.model_args,
            dataset=self.dataset,
            batch_size=self.batch_size,
            seed=self.seed,
            lr=self.schedule.lr(0),
            schedule=self.schedule.to_config(),
            optimizer="sgd-large-batch" if self.optimizer == "sgd" else self.optimizer,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            trust=self.trust,
            training=self.training,
        )

    def summary(self) -> None:
        super().summary()
        log(INFO, "\t└──> LargeBatchSync:")
        log(
            INFO,
            "\t\t├── %s on %s, batch %d, %d steps per round",
            self.model,
            self.dataset,
            self.batch_size,
            self.steps_per_round,
        )
        log(INFO, "\t\t├── %s", self.training.describe(self.optimizer))
        log(
            INFO,
            "\t\t├── lr %.4g -> %.4g over %d warm-up steps",
            self.schedule.base_lr,
            self.schedule.peak_lr,
            self.schedule.warmup_steps,
        )
        log(INFO, "\t\t└── compression %s", self.compression)

    # ------------------------------------------------------------------ members
    def _request(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "model": self.model,
            "model_args": self.model_args,
            "dataset": self.dataset,
            "batch": self.profile_batch,
            "repeats": self.profile_repeats,
        }

    def admit(self, grid: Grid, node_ids: Iterable[int]) -> list[int]:
        """Profile nodes not yet known; keep the ones that answer with a speed."""
        ids = [
            n
            for n in node_ids
            if n not in self.speeds and n not in self.lost and n not in self.refused
        ]
        if not ids:
            return []
        found, errors = self.profile_members(
            grid, ids, self._request(), self.query_timeout_s
        )
        self.refused.update(errors)
        admitted = []
        for node_id, member in found.items():
            speed = member.metrics.get(keys.SAMPLES_PER_S)
            if not isinstance(speed, int | float) or not speed > 0:
                self.refused[node_id] = f"profile without a speed ({speed!r})"
                log(WARNING, "node %d: %s", node_id, self.refused[node_id])
                continue
            self.speeds[node_id] = float(speed)
            self.addresses[node_id] = member.address
            admitted.append(node_id)
        if admitted:
            log(
                INFO,
                "LargeBatchSync: admitted %s (samples/s %s)",
                sorted(admitted),
                [round(self.speeds[n], 1) for n in sorted(admitted)],
            )
        return sorted(admitted)

    def choose_cohort(self) -> list[int]:
        """The members of the next segment: the fastest ``fraction_train`` share
        of the live members (at least ``min_train_nodes`` when there are; at most
        ``batch_size``, one sample each)."""
        alive = sorted(n for n in self.speeds if n not in self.lost)
        take = max(self.min_train_nodes, math.ceil(len(alive) * self.fraction_train))
        take = min(take, self.batch_size)
        fastest = sorted(alive, key=lambda n: -self.speeds[n])[:take]
        return sorted(fastest)

    def plans(self, cohort: list[int], steps: int) -> dict[int, MemberPlan]:
        """One plan per member: rank, rendezvous (rank 0's address), batch share,
        the recipe (pure: the tests check it)."""
        segment, port = self.next_segment()
        shares = batch_shares(self.batch_size, [self.speeds[n] for n in cohort])
        options: dict[str, Any] = {
            "optimizer": self.optimizer,
            "trust": self.trust,
            "compression": self.compression,
            "powersgd-rank": self.powersgd_rank,
            "schedule": self.schedule.to_config(),
            **self.training.to_options(),
        }
        return {
            node: MemberPlan(
                mode=self.mode,
                job=self.job or "large-batch",
                segment=segment,
                rank=rank,
                world_size=len(cohort),
                host=self.addresses[cohort[0]],
                port=port,
                start_step=self.step,
                steps=steps,
                batch_size=self.batch_size,
                seed=self.seed,
                join_timeout_s=self.join_timeout_s,
                timeout_s=self.timeout_s,
                model=self.model,
                model_args=self.model_args,
                dataset=self.dataset,
                lr=self.schedule.lr(self.step),
                momentum=self.momentum,
                weight_decay=self.weight_decay,
                batch_share=bounds,
                options=options,
            )
            for rank, (node, bounds) in enumerate(
                zip(cohort, share_bounds(shares), strict=True)
            )
        }

    # ------------------------------------------------------------------ Flower API
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The planned segment's messages: each member's plan, the whole model and
        the optimiser state (the cohort and plans come from :meth:`plans`)."""
        del grid
        config = ConfigRecord(dict(config))
        config[keys.SERVER_ROUND] = server_round
        weights = {k: v.numpy() for k, v in arrays.items()}
        return self.segment_messages(
            self._plans,
            dict.fromkeys(self._plans, weights),
            dict.fromkeys(self._plans, self.central_optimizer),
            config,
            self._timeout,
        )

    def check_reply(self, reply: SegmentReply) -> None:
        """A finished member must return every model array with its shape."""
        if not reply.ok:
            return
        missing = sorted(set(self.reference_state) - set(reply.arrays))
        if missing:
            raise ReplyRejected(f"reply lacks arrays {missing[:5]}")
        for name, array in reply.arrays.items():
            if self.reference_state.get(name) != tuple(array.shape):
                raise ReplyRejected(
                    f"array {name!r} has shape {tuple(array.shape)}, expected "
                    f"{self.reference_state.get(name)}"
                )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The replicas' weights (all equal after a segment) and the round's figures.

        Every reply must report a finished segment with the whole model;
        otherwise ``(None, None)`` and the reason is logged. The first reply's
        arrays are the result; how far the others are from it is reported
        (``replica-max-diff``) and a difference above 1e-4 logged.
        """
        checked: list[SegmentReply] = []
        for reply in replies:
            try:
                if reply.has_error():
                    raise ReplyRejected(reply.error.reason or "error reply")
                item = check_segment_reply(reply)
                if not item.ok:
                    raise ReplyRejected(f"segment stopped: {item.failure}")
                self.check_reply(item)
            except ReplyRejected as err:
                log(WARNING, "round %d: rejected reply: %s", server_round, err.reason)
                return None, None
            checked.append(item)
        return self.combine(server_round, checked)

    def combine(
        self, server_round: int, checked: list[SegmentReply]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The first checked reply's weights, the optimiser state, the figures."""
        if not checked:
            return None, None
        first = checked[0]
        diff = max(
            (
                float(np.max(np.abs(other.arrays[k] - v))) if v.size else 0.0
                for other in checked[1:]
                for k, v in first.arrays.items()
            ),
            default=0.0,
        )
        if diff > REPLICA_TOLERANCE:
            log(
                WARNING,
                "round %d: replicas differ by up to %.3g after the segment",
                server_round,
                diff,
            )
        self.central_optimizer = dict(first.optimizer)
        return arrayrecord(first.arrays), self._round_metrics(checked, diff)

    def _round_metrics(self, replies: list[SegmentReply], diff: float) -> MetricRecord:
        compute = [r.metrics.get(keys.SPAN_STEP_COMPUTE_S, []) for r in replies]
        comm = [r.metrics.get(keys.SPAN_STEP_COMM_S, []) for r in replies]
        steps = min((len(c) for c in compute), default=0)
        walls = [
            max(c[t] + m[t] for c, m in zip(compute, comm, strict=True))
            for t in range(steps)
        ]
        examples = sum(float(r.metrics.get(keys.NUM_EXAMPLES, 0)) for r in replies)
        losses = [
            (float(r.metrics[keys.TRAIN_LOSS]), float(r.metrics[keys.NUM_EXAMPLES]))
            for r in replies
            if keys.TRAIN_LOSS in r.metrics
        ]
        record = MetricRecord(
            {
                keys.NUM_EXAMPLES: int(examples),
                ROUND_MEMBERS: len(replies),
                ROUND_REPLICA_DIFF: diff,
                ROUND_LR: float(replies[0].metrics.get(keys.SPAN_LR, 0.0)),
            }
        )
        if walls:
            record[ROUND_STEP_S] = float(np.mean(walls))
            record[ROUND_COMPUTE_S] = float(
                np.mean([max(c[t] for c in compute) for t in range(steps)])
            )
            record[ROUND_COMM_S] = float(
                np.mean([min(m[t] for m in comm) for t in range(steps)])
            )
            record[ROUND_SAMPLES_PER_S] = examples / max(sum(walls), 1e-9)
        if losses:
            total = sum(n for _, n in losses)
            record[keys.TRAIN_LOSS] = sum(v * n for v, n in losses) / total
        return record

    def evaluation_query(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "model": self.model,
            "model_args": self.model_args,
            "dataset": self.dataset,
        }

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Evaluation messages to ``fraction_evaluate`` of the last cohort's live
        members (at least ``min_evaluate_nodes`` when there are) with the whole
        model and :meth:`evaluation_query`."""
        del grid
        if self.fraction_evaluate <= 0:
            return []
        alive = [n for n in self.cohort if n not in self.lost]
        count = max(
            self.min_evaluate_nodes, math.ceil(len(alive) * self.fraction_evaluate)
        )
        record = ConfigRecord(dict(config))
        record[keys.SPAN_QUERY] = json.dumps(self.evaluation_query())
        record[keys.SERVER_ROUND] = server_round
        return [
            Message(
                RecordDict(
                    {self.arrayrecord_key: arrays, self.configrecord_key: record}
                ),
                dst_node_id=node,
                message_type=MessageType.EVALUATE,
                ttl=self._timeout,
            )
            for node in alive[: min(count, len(alive))]
        ]

    # ------------------------------------------------------------------ the rounds
    def _check_initial(self, initial_arrays: ArrayRecord) -> None:
        check_initial_arrays(initial_arrays, self.reference_state, self.model)

    def _prepare_run(self, grid: Grid, done: int) -> None:
        """A new job; admit every connected node that profiles with a speed."""
        del done
        self.job = f"lb-{uuid.uuid4().hex[:12]}"
        self.admit(grid, self.discover(grid, 10**6, self._timeout))
        self._require_members(len(self.speeds))

    def _segment_round(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> tuple[ArrayRecord | None, MetricRecord | None] | None:
        """Segments until one completes (at most ``max_attempts``): each failure
        drops the lost members."""
        for attempt in range(1, self.max_attempts + 1):
            self.admit(grid, grid.get_node_ids())  # newcomers and returning boards
            cohort = self.choose_cohort()
            if len(cohort) < max(1, self.min_train_nodes):
                log(
                    WARNING,
                    "round %d: %d member(s) left, min_train_nodes is %d",
                    server_round,
                    len(cohort),
                    self.min_train_nodes,
                )
                return None
            self.cohort = cohort
            steps = self.steps_per_round
            self._plans = self.plans(cohort, steps)
            messages = self.configure_train(server_round, arrays, config, grid)
            outcome = self.run_segment(
                messages, server_round, self._timeout, self.check_reply
            )
            if outcome.complete:
                replies = sorted(
                    outcome.replies.values(), key=lambda r: self._plans[r.node_id].rank
                )
                new, metrics = self._accept(server_round, replies, attempt)
                if new is not None and metrics is not None:
                    return new, self._sized(server_round, outcome, steps, metrics)
            # A member that only found the rendezvous port taken stays in.
            self.lost.update(outcome.dropped_members)
            log(
                WARNING,
                "round %d: segment %d failed (lost %s, errors %s): re-forming "
                "without %s from step %d",
                server_round,
                attempt,
                sorted(outcome.failed_members),
                sorted(outcome.errors),
                sorted(outcome.dropped_members) or "anyone (a taken port only)",
                self.step,
            )
        return None

    def _sized(
        self,
        server_round: int,
        outcome: SegmentOutcome,
        steps: int,
        metrics: MetricRecord,
    ) -> MetricRecord:
        """The round's metrics with its set-up; the next segments sized by it."""
        step = metrics.get(ROUND_STEP_S, 0.0)
        metrics.update(
            self._measure_setup(
                server_round,
                outcome.seconds,
                steps,
                float(step) if isinstance(step, int | float) else 0.0,
                (r.metrics for r in outcome.replies.values()),
            )
        )
        return metrics

    @property
    def steps_per_round(self) -> int:
        """The steps of the next round's segment (see ``steps_per_round``)."""
        return self.sizer.steps

    def _accept(
        self, server_round: int, replies: list[SegmentReply], attempt: int
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        new, metrics = self.combine(server_round, replies)
        if new is None or metrics is None:
            return None, None
        a = self.speed_smoothing
        for reply in replies:
            speed = reply.metrics.get(keys.SAMPLES_PER_S)
            if isinstance(speed, int | float) and speed > 0:
                old = self.speeds[reply.node_id]
                self.speeds[reply.node_id] = a * float(speed) + (1 - a) * old
        self.step += self.steps_per_round
        metrics[ROUND_ATTEMPTS] = attempt
        return new, metrics
