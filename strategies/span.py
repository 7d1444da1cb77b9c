"""SpanJobStrategy: the Flower side of jobs that span devices.

Flower is the control plane of a job whose members exchange tensors peer-to-peer
(:mod:`flowerbed.parallel`): this base class finds the members and their
advertised addresses, profiles them with a query, sends each member its plan and
its share of the weights per segment, gathers the replies, and tells apart the
three ways a segment can end badly:

- a member reports a **lost peer** (``span-ok = 0``), naming the ranks it found
  gone (``span-lost-ranks``: their liveness port refused or did not answer,
  :mod:`flowerbed.parallel.group`): once every member has either answered or
  been named gone by a survivor, the named ones get :data:`LOST_CONFIRM_S` more
  (a member that finished and exited just before a survivor probed it has its
  reply on the way) and are then **lost**, without waiting for Flower's node
  heartbeat (a minute); the server also checks every :data:`LIVENESS_CHECK_S`
  whether the SuperLink still lists the silent members' nodes (one that left or
  missed its heartbeats is gone too); members nobody named are waited for at
  most a grace period: the plan's operation timeout (every survivor leaves the
  group within it once a peer is gone) or, when the loss happened while joining,
  the join timeout, plus ``reply_margin_s`` for Flower's reply path;
- a member answers with an **error** (bad plan, rendezvous port in use, address
  not its own): it is alive, the plan was wrong; a port reported in use is
  skipped from then on;
- a reply that is **malformed** (missing or non-finite metrics, arrays of the
  wrong shape): rejected and logged, its sender treated like a lost member for
  this segment (its layers are recovered from replicas), never the end of the job.

Its rounds run through the one round template,
:meth:`flowerbed.strategies.rounds.RoundLoop.start`: the template's start-up
(Flower's lines, the clock, the initial evaluation) resumes from the span
checkpoint (:meth:`SpanJobStrategy._resume`); a round's work is a segment round
(:meth:`SpanJobStrategy._segment_round`, which ends the run when it returns
None); evaluation pushes ``configure_evaluate``'s messages and hands the replies
to ``aggregate_evaluate``; a completed round is checkpointed.

Subclasses (``PipelineTraining``; the large-batch and fused-tile jobs) decide
what a plan says and how replies combine into the model: they check the
initial arrays in ``_check_initial``, start the job and find its members in
``_prepare_run`` (:meth:`discover`, :meth:`profile_members`), run a round's
segments in ``_segment_round`` (:meth:`run_segment`) and say which evaluation
messages to send in ``configure_evaluate``. Rendezvous
ports rotate over ``rendezvous_port .. rendezvous_port + rendezvous_ports - 1``,
one per segment (a gloo group cannot shrink, so each segment has a new group).

The mechanics live beside it: finding and profiling members in
:mod:`~flowerbed.strategies.span_members`, a reply's checks in
:mod:`~flowerbed.strategies.span_replies`, sending a segment and gathering its
replies in :mod:`~flowerbed.strategies.span_segments`.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping, Sequence
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flowerbed import keys
from flowerbed.clock import Clock, clock_of
from flowerbed.parallel.group import STORE_GRACE_S, segment_port
from flowerbed.parallel.plan import MemberPlan
from flowerbed.parallel.setup_time import member_setup_s
from flowerbed.strategies.inflight import InFlight
from flowerbed.strategies.options import copy_fields, refuse_unknown, take_options
from flowerbed.strategies.rounds import RoundLoop, RoundTally
from flowerbed.strategies.span_checkpoint import Resumed, SpanCheckpoint
from flowerbed.strategies.span_evaluation import average_evaluations, gather_evaluations
from flowerbed.strategies.span_members import SpanMember, discover, profile_members
from flowerbed.strategies.span_options import SpanGroup
from flowerbed.strategies.span_replies import (
    SegmentOutcome,
    SegmentReply,
    check_segment_reply,
)
from flowerbed.strategies.span_segments import (
    GONE_CODES,
    LIVENESS_CHECK_S,
    LOST_CONFIRM_S,
    SegmentGather,
    arrayrecord,
    segment_messages,
)
from flowerbed.strategies.span_sizing import (
    SegmentSizer,
)
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.supercore import log

__all__ = [  # the names this module held before its concerns moved out
    "GONE_CODES",
    "LIVENESS_CHECK_S",
    "LOST_CONFIRM_S",
    "SegmentOutcome",
    "SegmentReply",
    "SpanJobStrategy",
    "SpanMember",
    "arrayrecord",
    "check_initial_arrays",
    "check_segment_reply",
]


def check_initial_arrays(
    arrays: ArrayRecord, reference: Mapping[str, tuple[int, ...]], model: str
) -> None:
    """Raise ValueError unless ``arrays`` hold exactly the model's state, shapes
    included (``reference``: name -> shape); called before anything is sent."""
    missing = sorted(set(reference) - set(arrays))
    extra = sorted(set(arrays) - set(reference))
    if missing or extra:
        raise ValueError(
            f"initial_arrays do not fit model {model!r}: missing "
            f"{missing[:5]}, unexpected {extra[:5]} (pass the state_dict of "
            "the same nn.Sequential)"
        )
    for name, array in arrays.items():
        if tuple(array.shape) != reference[name]:
            raise ValueError(
                f"initial array {name!r} has shape {tuple(array.shape)}, the "
                f"model's is {reference[name]}"
            )


class SpanJobStrategy(RoundLoop):
    """Base of strategies whose members train one job together (see module doc).

    ``start()`` is :meth:`~flowerbed.strategies.rounds.RoundLoop.start` (FedAvg's
    signature and Result: ``arrays`` is the last completed round's model, the
    initial one if none completed). It raises ``ValueError`` before sending
    anything when ``initial_arrays`` do not fit the model, and ``RuntimeError``
    when fewer than ``min_train_nodes`` nodes can take part (each one's reason
    logged and in the message).

    Parameters
    ----------
    (FedAvg's parameters, same defaults; ``fraction_train`` and
    ``min_train_nodes`` bound how many members a job takes), and:
    group : SpanGroup, optional
        Where the members meet and how long everyone waits
        (:class:`~flowerbed.strategies.span_options.SpanGroup`; its fields as
        keywords are deprecated).
    checkpoint_path : str or Path, optional (default: None)
        Where the job's state is saved after every completed round (the model,
        the optimiser state, the step, the metric histories;
        :mod:`flowerbed.strategies.span_checkpoint`); a checkpoint already
        there is resumed: the job goes on from its last completed round.
    """

    mode = "probe"
    """The plan mode this strategy's members run (a key of parallel.modes)."""
    sizer: SegmentSizer
    """How many steps a segment takes (set by the subclasses that size them)."""
    # The job every plan carries, set by the subclasses (:meth:`segment_plans`).
    job: str
    model: str
    model_args: dict[str, Any]
    dataset: str
    batch_size: int
    seed: int

    def _measure_setup(
        self,
        server_round: int,
        wall_s: float,
        steps: int,
        step_s: float,
        members: Iterable[Mapping[str, object]],
    ) -> dict[str, float]:
        """Record a completed segment with :attr:`sizer` and log where its time
        went; return the round's set-up metrics (``members``: the members'
        reply metrics, each with its own time to its first step)."""
        setup = self.sizer.measured(wall_s, steps, step_s)
        slowest = max(member_setup_s(m) for m in members)
        self.sizer.report(type(self).__name__, server_round, wall_s, setup, slowest)
        return setup

    # pylint: disable=too-many-arguments
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
        )
        owner = type(self).__name__
        taken = take_options(owner, legacy, {"group": (group, SpanGroup())})
        refuse_unknown(owner, legacy, ["group", "checkpoint_path"])
        self.group: SpanGroup = taken["group"]
        """Where the members meet and how long everyone waits."""
        copy_fields(self, self.group)  # self.timeout_s, ... as before
        self._init_loop(None)  # the span checkpoint below, not RoundLoop's
        self.checkpoint = (
            None
            if checkpoint_path is None
            else SpanCheckpoint(checkpoint_path, type(self).__name__)
        )
        self.bad_ports: set[int] = set()
        self.step = 0
        """Global optimiser steps the job has completed."""
        self.central_optimizer: dict[str, np.ndarray] = {}
        """The optimiser state between segments (saved in checkpoints)."""
        self.lost: set[int] = set()
        """Members that died or failed a plan the others could run."""
        self.refused: dict[int, str] = {}
        """Nodes that cannot take part, and why."""
        self._segment = 0

    # ------------------------------------------------------------------ plumbing
    def attach(self, grid: Grid) -> None:
        """Use ``grid`` (its clock, its in-flight bookkeeping) from now on."""
        self._clock = clock_of(grid)
        self._inflight = InFlight(grid, self._clock)

    @property
    def clock(self) -> Clock:
        if self._inflight is None:
            raise RuntimeError("call attach(grid) first")
        return self._clock

    @property
    def inflight(self) -> InFlight:
        if self._inflight is None:
            raise RuntimeError("call attach(grid) first")
        return self._inflight

    def next_segment(self) -> tuple[int, int]:
        """A new segment number and its rendezvous port (skipping bad ports)."""
        for _ in range(self.rendezvous_ports):
            self._segment += 1
            port = segment_port(
                self.rendezvous_port, self.rendezvous_ports, self._segment
            )
            if port not in self.bad_ports:
                return self._segment, port
        raise RuntimeError(
            f"every rendezvous port {self.rendezvous_port}.."
            f"{self.rendezvous_port + self.rendezvous_ports - 1} was reported in use; "
            "free some or choose another range (rendezvous_port)"
        )

    def segment_plans(
        self,
        nodes: Sequence[int],
        host: str,
        steps: int,
        per_rank: Callable[[int], Mapping[str, Any]],
        **fields: Any,
    ) -> dict[int, MemberPlan]:
        """One plan per node of a new segment (:meth:`next_segment`), ``nodes``
        in rank order meeting at ``host``: the job (model, data, batch, seed, the
        group's timeouts, ``steps`` from the current step), ``fields`` (which may
        replace any of those) and ``per_rank(rank)``, a member's own share."""
        segment, port = self.next_segment()
        job: dict[str, Any] = {
            "mode": self.mode,
            "job": self.job,
            "segment": segment,
            "world_size": len(nodes),
            "host": host,
            "port": port,
            "start_step": self.step,
            "steps": steps,
            "join_timeout_s": self.join_timeout_s,
            "timeout_s": self.timeout_s,
            **self.job_fields(),
            **fields,
        }
        return {
            node: MemberPlan(rank=rank, **job, **per_rank(rank))
            for rank, node in enumerate(nodes)
        }

    def job_fields(self) -> dict[str, Any]:
        """The job's model, data, batch and seed, by the names plans and
        :class:`~flowerbed.parallel.reference.ReferenceJob` give them."""
        return {
            "model": self.model,
            "model_args": self.model_args,
            "dataset": self.dataset,
            "batch_size": self.batch_size,
            "seed": self.seed,
        }

    def evaluation_query(self) -> dict[str, Any]:
        """The job members build and read to evaluate: mode, model and dataset."""
        return {
            "mode": self.mode,
            "model": self.model,
            "model_args": self.model_args,
            "dataset": self.dataset,
        }

    # ------------------------------------------------------------------ the rounds
    def start_wrapped(self, wrapper: Strategy, *args: Any, **kwargs: Any) -> Result:
        """Refused: a span job trains one model across its members, so there are
        no client updates for a wrapper (differential privacy) to clip or noise."""
        del args, kwargs
        raise TypeError(
            f"{type(wrapper).__name__} cannot wrap {type(self).__name__}: its "
            "members train one model together and return it, not client updates "
            "to clip and noise; run it unwrapped"
        )

    def _resume(self, initial_arrays: ArrayRecord, result: Result) -> int:
        """Resume from the span checkpoint (:meth:`resume`): the model, the step,
        the optimiser state, the strategy's :meth:`state`; return the last
        completed round (0 without a checkpoint)."""
        resumed = self.resume(initial_arrays, result, self._num_rounds)
        if resumed is None:
            return 0
        self.step = resumed.step
        self.central_optimizer = dict(resumed.optimizer)
        self.load_state(dict(resumed.state))
        self._set_global(arrayrecord(resumed.arrays))
        return resumed.round

    def _require_members(self, count: int) -> None:
        """Raise RuntimeError unless ``count`` members (at least one, at least
        ``min_train_nodes``) can take part; the refused nodes' reasons are in
        the message."""
        if count >= max(1, self.min_train_nodes):
            return
        reasons = "; ".join(f"node {n}: {r}" for n, r in sorted(self.refused.items()))
        raise RuntimeError(
            f"only {count} node(s) can take part, min_train_nodes is "
            f"{self.min_train_nodes}" + (f" ({reasons})" if reasons else "")
        )

    def _segment_round(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> tuple[ArrayRecord | None, MetricRecord | None] | None:
        """A round's work: its segments from ``arrays`` (the current model), with
        ``configure_train``'s messages; the new model (None: unchanged) and the
        round's metrics, or None to end the run (the reason logged)."""
        raise NotImplementedError(
            f"{type(self).__name__} does not say what a segment round is: "
            "SpanJobStrategy is the base of PipelineTraining, LargeBatchSync and "
            "TiledTraining"
        )

    def _train_stage(
        self, server_round: int, config: ConfigRecord, grid: Grid, result: Result
    ) -> None:
        """The template's round work: a segment round; None from it ends the run."""
        log(INFO, "%s: step %d", type(self).__name__, self.step)
        done = self._segment_round(server_round, self._global, config, grid)
        if done is None:
            log(WARNING, "round %d did not complete: stopping", server_round)
            self._stop = True
            return
        arrays, metrics = done
        if metrics is not None:
            log(INFO, "\t└──> %s", dict(metrics))
            result.train_metrics_clientapp[server_round] = metrics
        if arrays is not None:
            self._set_global(arrays)
            result.arrays = arrays
            self._updates_applied += 1

    def evaluate_members(
        self, server_round: int, messages: Iterable[Message], wait: float
    ) -> MetricRecord | None:
        """Push evaluation ``messages``, wait at most ``wait`` clock seconds,
        ``aggregate_evaluate`` what came back (None when there is nothing to send)."""
        messages = list(messages)
        if not messages:
            return None
        replies = gather_evaluations(self.inflight, server_round, messages, wait)
        return self.aggregate_evaluate(server_round, replies)

    def _evaluate_stage(
        self, server_round: int, config: ConfigRecord, grid: Grid, result: Result
    ) -> None:
        """``configure_evaluate``'s messages, their replies aggregated."""
        messages = self.configure_evaluate(server_round, self._global, config, grid)
        metrics = self.evaluate_members(server_round, messages, self._evaluate_wait())
        if metrics is not None:
            log(INFO, "\t└──> Aggregated MetricRecord: %s", metrics)
            result.evaluate_metrics_clientapp[server_round] = metrics

    def _write_checkpoint(self, server_round: int, result: Result) -> None:
        self.save_round(
            server_round, self.step, self._global, self.central_optimizer, result
        )

    def _stall_cause(self, tally: RoundTally) -> str:
        del tally
        return "every segment failed: the warnings above name the lost members"

    # ------------------------------------------------------------------ checkpoints
    def resume(
        self, initial_arrays: ArrayRecord, result: Result, num_rounds: int
    ) -> Resumed | None:
        """The checkpoint's state (None without ``checkpoint_path`` or a file
        there; the Result's histories restored), after checking that the next
        checkpoint can be written when rounds remain."""
        if self.checkpoint is None:
            return None
        resumed = self.checkpoint.resume(initial_arrays, result)
        if resumed is None or resumed.round < num_rounds:
            self.checkpoint.check_writable()
        return resumed

    def save_round(
        self,
        server_round: int,
        step: int,
        arrays: ArrayRecord,
        optimizer: Mapping[str, np.ndarray],
        result: Result,
    ) -> None:
        """Checkpoint a completed round (nothing without ``checkpoint_path``)."""
        if self.checkpoint is not None:
            self.checkpoint.save(
                server_round,
                step,
                {k: v.numpy() for k, v in arrays.items()},
                optimizer,
                result,
                self.state(),
            )

    # ------------------------------------------------------------------ members
    def discover(self, grid: Grid, count: int, timeout: float) -> list[int]:
        """Node ids once ``min_available_nodes`` are connected (at most ``count``)."""
        return discover(self.inflight, grid, self.min_available_nodes, count, timeout)

    def profile_members(
        self,
        grid: Grid,
        node_ids: Iterable[int],
        request: Mapping[str, Any],
        timeout: float,
    ) -> tuple[dict[int, SpanMember], dict[int, str]]:
        """Query ``node_ids`` with ``request`` (a span query); return members,
        errors (:func:`~flowerbed.strategies.span_members.profile_members`)."""
        del grid  # the attached grid's in-flight bookkeeping sends the query
        return profile_members(self.inflight, node_ids, request, timeout)

    def profile_newcomers(
        self,
        grid: Grid,
        node_ids: Iterable[int],
        known: Container[int],
        request: Mapping[str, Any],
        timeout: float,
    ) -> dict[int, SpanMember]:
        """Profile the nodes of ``node_ids`` neither ``known`` nor lost nor
        refused (:meth:`profile_members`); the ones that cannot take part are
        added to :attr:`refused`."""
        ids = [
            n
            for n in node_ids
            if n not in known and n not in self.lost and n not in self.refused
        ]
        if not ids:
            return {}
        found, errors = self.profile_members(grid, ids, request, timeout)
        self.refused.update(errors)
        return found

    # ------------------------------------------------------------------ segments
    def segment_messages(
        self,
        plans: Mapping[int, MemberPlan],
        arrays: Mapping[int, Mapping[str, np.ndarray]],
        optimizer: Mapping[int, Mapping[str, np.ndarray]],
        config: ConfigRecord,
        ttl: float,
    ) -> list[Message]:
        """One train message per member: ``config`` plus its plan, and its arrays."""
        where = (self.configrecord_key, self.arrayrecord_key)
        return segment_messages(plans, arrays, optimizer, config, ttl, where)

    def run_segment(
        self,
        messages: Iterable[Message],
        server_round: int,
        timeout: float,
        check: Callable[[SegmentReply], object] | None = None,
    ) -> SegmentOutcome:
        """Push a segment's messages and gather what becomes of every member.

        Waits for every member, at most ``timeout``; once a member reports a lost
        peer or errs, waits at most the grace period (module doc) for the rest,
        who then count as lost; members that survivors name gone are counted lost
        :data:`LOST_CONFIRM_S` after everyone else has answered. ``check`` may
        reject a reply (raise :class:`ReplyRejected`) on mode-specific grounds.
        """
        gather = SegmentGather(
            self.inflight,
            self.configrecord_key,
            lambda join: self._grace(join=join),
            self.bad_ports,
            check,
        )
        return gather.run(messages, server_round, timeout)

    def _grace(self, *, join: bool) -> float:
        bound = self.join_timeout_s + STORE_GRACE_S if join else self.timeout_s
        return bound + self.reply_margin_s

    # ------------------------------------------------------------------ evaluation
    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Average evaluation metrics, rejecting bad replies (logged;
        :func:`~flowerbed.strategies.span_evaluation.average_evaluations`)."""
        return average_evaluations(
            server_round, replies, self.weighted_by_key, self.evaluate_metrics_aggr_fn
        )
