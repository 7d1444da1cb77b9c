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

import math
import uuid
from collections.abc import Iterable, Mapping
from logging import INFO, WARNING
from typing import Any

from flowerbed import keys
from flowerbed.parallel.large_batch.recipe import batch_shares, share_bounds
from flowerbed.parallel.plan import MemberPlan
from flowerbed.parallel.reference import ReferenceJob
from flowerbed.parallel.user_code import Training, build_module
from flowerbed.replies import ReplyRejected
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MetricRecord,
)
from flwr.serverapp import Grid
from flwr.supercore import log

from .large_batch_figures import (
    REPLICA_TOLERANCE,
    ROUND_ATTEMPTS,
    ROUND_COMM_S,
    ROUND_COMPUTE_S,
    ROUND_LR,
    ROUND_MEMBERS,
    ROUND_REPLICA_DIFF,
    ROUND_SAMPLES_PER_S,
    ROUND_STEP_S,
    replica_difference,
    round_figures,
)
from .large_batch_options import COMPRESSIONS, AllReduceRecipe, MemberProfiling
from .options import take_options
from .span import (
    SegmentOutcome,
    SegmentReply,
    SpanJobStrategy,
    arrayrecord,
    check_initial_arrays,
    check_segment_reply,
)
from .span_evaluation import evaluate_messages, query_config
from .span_sizing import (
    DEFAULT_SETUP_SHARE,
    SegmentSizer,
)

__all__ = [  # the names this module held before its concerns moved out
    "COMPRESSIONS",
    "DEFAULT_STEPS_PER_ROUND",
    "REPLICA_TOLERANCE",
    "ROUND_ATTEMPTS",
    "ROUND_COMM_S",
    "ROUND_COMPUTE_S",
    "ROUND_LR",
    "ROUND_MEMBERS",
    "ROUND_REPLICA_DIFF",
    "ROUND_SAMPLES_PER_S",
    "ROUND_STEP_S",
    "LargeBatchSync",
]

DEFAULT_STEPS_PER_ROUND = 10
"""Steps of the first round's segment when the strategy sizes segments."""


def check_job_sizes(
    batch_size: int, min_train_nodes: int, steps_per_round: int | None, attempts: int
) -> None:
    """Raise ValueError unless the batch gives every member a sample, segments
    have a step and a round may try a segment."""
    if batch_size < max(1, min_train_nodes):
        raise ValueError(
            f"batch_size {batch_size} cannot give min_train_nodes "
            f"({min_train_nodes}) members one sample each per step"
        )
    if steps_per_round is not None and steps_per_round < 1:
        raise ValueError("steps_per_round must be >= 1 (or None: sized by setup_share)")
    if attempts < 1:
        raise ValueError("max_attempts must be >= 1")


def segment_sizer(
    steps_per_round: int | None, setup_share: float | None
) -> SegmentSizer:
    """Fixed segments of ``steps_per_round`` steps, or (None) segments sized
    from 10 steps so that set-up is at most ``setup_share`` of a round."""
    if steps_per_round is None:
        return SegmentSizer(DEFAULT_STEPS_PER_ROUND, setup_share)
    return SegmentSizer(steps_per_round, None)


def state_shapes(
    model: str, model_args: Mapping[str, Any]
) -> dict[str, tuple[int, ...]]:
    """Each array of ``model``'s state and its shape (the model built once here)."""
    reference = build_module(model, dict(model_args), seed=0)
    return {k: tuple(v.shape) for k, v in reference.state_dict().items()}


class LargeBatchSync(SpanJobStrategy):
    """Large-batch synchronous training with all-reduce across boards (module doc).

    Parameters
    ----------
    (FedAvg's parameters, same defaults: ``fraction_train`` and
    ``min_train_nodes`` bound the cohort; ``fraction_evaluate`` > 0 sends the
    whole model to that share of members for evaluation after a round), the span
    parameters of :class:`~flowerbed.strategies.span.SpanJobStrategy` (a resumed
    job profiles the boards connected then), and:
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
    recipe : AllReduceRecipe, optional (default: AllReduceRecipe())
        The optimiser, its schedule and the gradient compression
        (:mod:`flowerbed.strategies.large_batch_options`).
    profiling : MemberProfiling, optional (default: MemberProfiling())
        How boards are timed when they join and their speeds smoothed.
    max_attempts : int (default: 3)
        Segments tried per round before the run stops.
    seed : int (default: 0)
        Data order (the batch of step ``t`` depends on ``seed`` and ``t``).
    training : flowerbed.parallel.Training, optional
        A loss function and a ``torch.optim`` optimiser factory of your own, by
        ``"package.module:function"`` name (default: cross-entropy and
        ``recipe.optimizer``); a factory steps at the schedule's rate.

    Attributes
    ----------
    model, model_args, dataset, seed, recipe, profiling
        The parameters of the same names, as given.
    schedule : flowerbed.parallel.large_batch.recipe.LrSchedule
        The learning-rate schedule of ``recipe`` for ``batch_size``.
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
    RECIPE = AllReduceRecipe()
    PROFILING = MemberProfiling()

    def __init__(  # pylint: disable=too-many-arguments
        self,
        *args: Any,
        model: str = "deep-mlp",
        model_args: Mapping[str, Any] | None = None,
        dataset: str = "digits",
        batch_size: int = 256,
        steps_per_round: int | None = None,
        setup_share: float | None = DEFAULT_SETUP_SHARE,
        recipe: AllReduceRecipe | None = None,
        profiling: MemberProfiling | None = None,
        max_attempts: int = 3,
        seed: int = 0,
        training: Training | None = None,
        **kwargs: Any,
    ) -> None:
        options = take_options(
            type(self).__name__,
            kwargs,
            {"recipe": (recipe, self.RECIPE), "profiling": (profiling, self.PROFILING)},
        )
        super().__init__(*args, **kwargs)
        self.recipe, self.profiling = options["recipe"], options["profiling"]
        check_job_sizes(batch_size, self.min_train_nodes, steps_per_round, max_attempts)
        self.schedule = self.recipe.schedule(batch_size)
        self.model, self.model_args = model, dict(model_args or {})
        self.training = Training() if training is None else training
        self.training.check()  # a name that does not import fails here
        self.reference_state = state_shapes(model, self.model_args)
        self.dataset, self.batch_size = dataset, batch_size
        self.sizer = segment_sizer(steps_per_round, setup_share)
        self.max_attempts, self.seed = max_attempts, seed
        self.speeds: dict[int, float] = {}
        """Smoothed samples per second of each member."""
        self.addresses: dict[int, str] = {}
        self.job = ""
        self.cohort: list[int] = []
        self._plans: dict[int, MemberPlan] = {}

    def reference_job(self) -> ReferenceJob:
        """This job as one device would train it: pass it to
        :func:`flowerbed.parallel.reference.single_device` to check a run."""
        optimizer = self.recipe.optimizer
        return ReferenceJob(
            **self.job_fields(),
            lr=self.schedule.lr(0),
            schedule=self.schedule.to_config(),
            optimizer="sgd-large-batch" if optimizer == "sgd" else optimizer,
            momentum=self.recipe.momentum,
            weight_decay=self.recipe.weight_decay,
            trust=self.recipe.trust,
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
        log(INFO, "\t\t├── %s", self.training.describe(self.recipe.optimizer))
        log(
            INFO,
            "\t\t├── lr %.4g -> %.4g over %d warm-up steps",
            self.schedule.base_lr,
            self.schedule.peak_lr,
            self.schedule.warmup_steps,
        )
        log(INFO, "\t\t└── compression %s", self.recipe.compression)

    # ------------------------------------------------------------------ members
    def _request(self) -> dict[str, Any]:
        """The profiling query: the job (:meth:`evaluation_query`), how to time it."""
        return {
            **self.evaluation_query(),
            "batch": self.profiling.profile_batch,
            "repeats": self.profiling.profile_repeats,
        }

    def admit(self, grid: Grid, node_ids: Iterable[int]) -> list[int]:
        """Profile nodes not yet known; keep the ones that answer with a speed."""
        found = self.profile_newcomers(
            grid, node_ids, self.speeds, self._request(), self.profiling.query_timeout_s
        )
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
        shares = batch_shares(self.batch_size, [self.speeds[n] for n in cohort])
        options: dict[str, Any] = {
            "optimizer": self.recipe.optimizer,
            "trust": self.recipe.trust,
            "compression": self.recipe.compression,
            "powersgd-rank": self.recipe.powersgd_rank,
            "schedule": self.schedule.to_config(),
            **self.training.to_options(),
        }
        bounds = share_bounds(shares)
        return self.segment_plans(
            cohort,
            self.addresses[cohort[0]],
            steps,
            lambda rank: {"batch_share": bounds[rank]},
            job=self.job or "large-batch",
            lr=self.schedule.lr(self.step),
            momentum=self.recipe.momentum,
            weight_decay=self.recipe.weight_decay,
            options=options,
        )

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
        diff = replica_difference(checked)
        if diff > REPLICA_TOLERANCE:
            log(
                WARNING,
                "round %d: replicas differ by up to %.3g after the segment",
                server_round,
                diff,
            )
        self.central_optimizer = dict(first.optimizer)
        return arrayrecord(first.arrays), round_figures(checked, diff)

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
        record = query_config(config, self.evaluation_query())
        record[keys.SERVER_ROUND] = server_round
        records = {self.arrayrecord_key: arrays, self.configrecord_key: record}
        return evaluate_messages(
            records, alive[: min(count, len(alive))], self._timeout
        )

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
        a = self.profiling.speed_smoothing
        for reply in replies:
            speed = reply.metrics.get(keys.SAMPLES_PER_S)
            if isinstance(speed, int | float) and speed > 0:
                old = self.speeds[reply.node_id]
                self.speeds[reply.node_id] = a * float(speed) + (1 - a) * old
        self.step += self.steps_per_round
        metrics[ROUND_ATTEMPTS] = attempt
        return new, metrics
