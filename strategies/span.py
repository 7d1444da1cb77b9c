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
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, cast

import numpy as np
from flowerbed import keys
from flowerbed.clock import Clock, clock_of
from flowerbed.parallel.group import STORE_GRACE_S, segment_port
from flowerbed.parallel.plan import PLAN_KEY, MemberPlan, check_address
from flowerbed.parallel.setup_time import member_setup_s
from flowerbed.replies import ReplyRejected, check_evaluate_reply
from flowerbed.strategies.accumulation import MetricsAccumulator
from flowerbed.strategies.inflight import InFlight, Ticket
from flowerbed.strategies.options import copy_fields, refuse_unknown, take_options
from flowerbed.strategies.rounds import RoundLoop, RoundTally
from flowerbed.strategies.sampling import WAIT_FOR_NODES_S
from flowerbed.strategies.span_checkpoint import Resumed, SpanCheckpoint
from flowerbed.strategies.span_options import SpanGroup
from flowerbed.strategies.span_sizing import (
    ROUND_SETUP_S,
    ROUND_SETUP_SHARE,
    SegmentSizer,
)
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.supercore import log

GONE_CODES = (
    ErrorCode.MESSAGE_UNAVAILABLE,
    ErrorCode.REPLY_MESSAGE_UNAVAILABLE,
    ErrorCode.NODE_UNAVAILABLE,
    ErrorCode.CLIENT_APP_CRASHED,
)
"""Flower error codes that mean the member's node or process is gone (lost), as
opposed to an error its ClientApp reported (alive, plan or board problem)."""

LOST_CONFIRM_S = 1.0
"""Seconds the server still waits for members that survivors named gone, once
everyone else has answered: a SuperNode pushes a finished ClientApp's reply
within half a second (flwr's SuperNode loop), so a member that left just before
it was probed is heard from in time, while a dead one costs only this."""
LIVENESS_CHECK_S = 1.0
"""Seconds between the server's own liveness checks of members not heard from,
once a member reported a loss (:meth:`SpanJobStrategy.run_segment`)."""


@dataclass
class SpanMember:
    """A node that can take part: its id, advertised address and profile."""

    node_id: int
    address: str
    label: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class SegmentReply:
    """One member's checked segment reply."""

    node_id: int
    ok: bool
    metrics: dict[str, Any]
    arrays: dict[str, np.ndarray]
    optimizer: dict[str, np.ndarray]
    failure: str = ""
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class SegmentOutcome:
    """What became of a segment's members.

    ``replies``: checked replies (``ok`` or a reported lost peer); ``errors``:
    error replies, by node (member alive, plan or board problem); ``rejected``:
    malformed replies, by node; ``lost``: members that never answered.
    """

    replies: dict[int, SegmentReply] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    rejected: dict[int, str] = field(default_factory=dict)
    lost: set[int] = field(default_factory=set)
    seconds: float = 0.0

    @property
    def complete(self) -> bool:
        """Every member finished its segment."""
        return (
            not self.errors
            and not self.rejected
            and not self.lost
            and all(r.ok for r in self.replies.values())
        )

    @property
    def answered(self) -> set[int]:
        """Members heard from: a reply, an error reply or a malformed one."""
        return set(self.replies) | set(self.errors) | set(self.rejected)

    @property
    def failed_members(self) -> set[int]:
        """Members whose state after the segment cannot be used (lost, malformed)."""
        return set(self.lost) | set(self.rejected)

    @property
    def port_errors(self) -> set[int]:
        """Members that answered only that the segment's rendezvous port was in use:
        alive and blameless (the server skips the port from then on)."""
        return {n for n, why in self.errors.items() if _port_in_use(why) is not None}

    @property
    def dropped_members(self) -> set[int]:
        """Members to leave out of the next attempt: lost, malformed, or refusing
        the plan with an error other than a taken port."""
        return self.failed_members | (set(self.errors) - self.port_errors)


def _finite(value: object) -> bool:
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


def check_segment_reply(reply: Message) -> SegmentReply:
    """Validate a span reply; raise :class:`ReplyRejected` saying what is wrong.

    Every metric must be a finite number (or list of them) and ``span-ok`` 0 or 1;
    every array finite. Which arrays a reply must hold is the subclass's check.
    """
    content = reply.content
    if keys.METRICS not in content.metric_records:
        raise ReplyRejected(f"no {keys.METRICS!r} MetricRecord")
    metrics = dict(content.metric_records[keys.METRICS])
    for key, value in metrics.items():
        if not _finite(value):
            raise ReplyRejected(f"metric {key!r} is not a finite number ({value!r})")
    ok = metrics.get(keys.SPAN_OK)
    if ok not in (0, 1):
        raise ReplyRejected(f"metric {keys.SPAN_OK!r} must be 0 or 1, got {ok!r}")
    arrays: dict[str, dict[str, np.ndarray]] = {}
    for name in (keys.ARRAYS, keys.SPAN_OPTIMIZER):
        arrays[name] = {}
        if name in content.array_records:
            for key, array in content.array_records[name].items():
                try:
                    decoded: np.ndarray = array.numpy()
                except Exception as err:
                    raise ReplyRejected(
                        f"array {key!r} cannot be decoded: {err}"
                    ) from err
                if decoded.dtype.kind in "fc" and not np.isfinite(decoded).all():
                    raise ReplyRejected(f"array {key!r} contains NaN or Inf")
                arrays[name][key] = decoded
    info = (
        dict(content.config_records[keys.SPAN_RECORD])
        if keys.SPAN_RECORD in content.config_records
        else {}
    )
    return SegmentReply(
        node_id=reply.metadata.src_node_id,
        ok=ok == 1,
        metrics=metrics,
        arrays=arrays[keys.ARRAYS],
        optimizer=arrays[keys.SPAN_OPTIMIZER],
        failure=str(info.get("failure", "")),
        info=info,
    )


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


def arrayrecord(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(np.asarray(v)) for k, v in arrays.items()})


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
        log(
            INFO,
            "%s: round %d set-up %.1f s of the segment's %.1f s (%.0f%%; slowest "
            "member: %.1f s to its first step); next rounds %d steps",
            type(self).__name__,
            server_round,
            setup[ROUND_SETUP_S],
            wall_s,
            100 * setup[ROUND_SETUP_SHARE],
            max(member_setup_s(m) for m in members),
            self.sizer.steps,
        )
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
        sent = self.inflight.push(messages, server_round)
        until = self.clock.now() + wait
        replies = [
            reply
            for reply, _, _ in self.inflight.replies(until, kind=MessageType.EVALUATE)
        ]
        self.inflight.forget(sent)
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
        give_up = self.clock.now() + timeout
        nodes = sorted(grid.get_node_ids())
        while len(nodes) < self.min_available_nodes and self.clock.now() < give_up:
            log(
                INFO,
                "waiting for nodes: %d connected, %d needed",
                len(nodes),
                self.min_available_nodes,
            )
            self.clock.wait(WAIT_FOR_NODES_S)
            nodes = sorted(grid.get_node_ids())
        return nodes[:count]

    def profile_members(
        self,
        grid: Grid,
        node_ids: Iterable[int],
        request: Mapping[str, Any],
        timeout: float,
    ) -> tuple[dict[int, SpanMember], dict[int, str]]:
        """Query ``node_ids`` with ``request`` (a span query); return members, errors.

        A node whose reply is an error (no or a foreign ``address``, no data ...)
        or malformed, or that does not answer within ``timeout``, is left out
        and its reason logged and returned.
        """
        config = ConfigRecord({keys.SPAN_QUERY: json.dumps(dict(request))})
        ids = list(node_ids)
        messages = [
            Message(
                RecordDict({keys.CONFIG: config}),
                dst_node_id=node_id,
                message_type=MessageType.QUERY,
                ttl=timeout,
            )
            for node_id in ids
        ]
        sent = self.inflight.push(messages, 0)
        members: dict[int, SpanMember] = {}
        errors: dict[int, str] = {}
        for reply, ticket, _ in self.inflight.replies(
            self.clock.now() + timeout, kind=MessageType.QUERY
        ):
            node_id = ticket.node_id
            try:
                if reply.has_error():
                    raise ReplyRejected(reply.error.reason or "error reply")
                checked = check_segment_reply(reply)
                address = check_address(checked.info.get("address"), "reply address")
            except (ReplyRejected, ValueError) as err:
                errors[node_id] = str(err)
                log(WARNING, "node %d cannot take part: %s", node_id, err)
                continue
            members[node_id] = SpanMember(
                node_id=node_id,
                address=address,
                label=str(checked.info.get("device", "")),
                metrics=checked.metrics,
                info=checked.info,
            )
        missing = [n for n in ids if n not in members and n not in errors]
        for node_id in missing:
            errors[node_id] = f"no answer to the profiling query within {timeout:g} s"
            log(WARNING, "node %d: %s", node_id, errors[node_id])
        self.inflight.forget(sent)
        return members, errors

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
        messages = []
        for node_id, plan in plans.items():
            record = ConfigRecord(dict(config))
            record.update(plan.to_config())
            content = RecordDict({self.configrecord_key: record})
            if arrays.get(node_id):
                content[self.arrayrecord_key] = arrayrecord(arrays[node_id])
            if optimizer.get(node_id):
                content[keys.SPAN_OPTIMIZER] = arrayrecord(optimizer[node_id])
            messages.append(
                Message(
                    content,
                    dst_node_id=node_id,
                    message_type=MessageType.TRAIN,
                    ttl=ttl,
                )
            )
        return messages

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
        start = self.clock.now()
        messages = list(messages)
        ranks = _ranks(messages, self.configrecord_key)
        sent = self.inflight.push(messages, server_round)
        members = {self.inflight.tickets[i].node_id for i in sent}
        outcome = SegmentOutcome()
        until = [start + timeout]  # a grace period or a naming brings it forward
        # node -> why it is gone: named by survivors (reporter -> their failure
        # text) or by Flower's error code (reporter 0, the SuperLink)
        gone: dict[int, dict[int, str]] = {}

        check_at = [math.inf]  # the server's next liveness check (after a loss)

        def settle(now: float) -> None:
            silent = members - outcome.answered
            if silent and silent <= set(gone):
                until[0] = min(until[0], now + LOST_CONFIRM_S)

        def bound() -> float:
            return min(until[0], check_at[0])

        while True:
            for reply, ticket in self._segment_replies(bound):
                join = self._file_reply(
                    reply, ticket.node_id, outcome, check, ranks, gone
                )
                now = self.clock.now()
                if join is not None:
                    until[0] = min(until[0], now + self._grace(join=join))
                    check_at[0] = min(check_at[0], now + LIVENESS_CHECK_S)
                settle(now)
            now = self.clock.now()
            silent = members - outcome.answered
            if not silent or now >= until[0]:
                break
            self._check_liveness(silent - set(gone), gone)
            check_at[0] = now + LIVENESS_CHECK_S
            settle(now)
        outcome.lost = members - outcome.answered
        for node_id in sorted(outcome.lost):
            rank = ranks.get(node_id, -1)
            if node_id in gone:
                log(
                    WARNING,
                    "segment: node %d (rank %d) is lost: %s found it gone (%s)",
                    node_id,
                    rank,
                    ", ".join(
                        "the SuperLink" if n == 0 else f"node {n}"
                        for n in sorted(gone[node_id])
                    ),
                    next(iter(gone[node_id].values())),
                )
            else:
                log(
                    WARNING,
                    "segment: no reply from node %d (rank %d) within the grace "
                    "period: counted as lost",
                    node_id,
                    rank,
                )
        self.inflight.forget(sent)
        outcome.seconds = self.clock.now() - start
        return outcome

    def _check_liveness(
        self, silent: set[int], gone: dict[int, dict[int, str]]
    ) -> None:
        """The server's own liveness check of members not heard from: a node the
        SuperLink no longer lists (it deregistered, or missed its heartbeats)
        is gone (reporter 0, the SuperLink)."""
        if not silent:
            return
        listed = set(self.inflight.grid.get_node_ids())
        for node_id in sorted(silent - listed):
            gone.setdefault(node_id, {})[0] = (
                "the SuperLink no longer lists its node (it left, or missed its "
                "heartbeats)"
            )

    def _file_reply(
        self,
        reply: Message,
        node_id: int,
        outcome: SegmentOutcome,
        check: Callable[[SegmentReply], object] | None,
        ranks: Mapping[int, int],
        gone: dict[int, dict[int, str]],
    ) -> bool | None:
        """File one segment reply into ``outcome`` (and ``gone``); return whether
        it starts a grace period for the others (True: a join-phase one), or None."""
        if reply.has_error():
            reason = reply.error.reason or f"error code {reply.error.code}"
            if reply.error.code in GONE_CODES:
                log(WARNING, "segment: node %d is gone: %s", node_id, reason)
                gone.setdefault(node_id, {})[0] = reason
                return None  # counted as lost
            outcome.errors[node_id] = reason
            log(WARNING, "segment: node %d answered with an error: %s", node_id, reason)
            port = _port_in_use(reason)
            if port is not None:
                self.bad_ports.add(port)
            return True
        try:
            checked = check_segment_reply(reply)
            if check is not None:
                check(checked)
        except ReplyRejected as err:
            outcome.rejected[node_id] = err.reason
            log(
                WARNING, "segment: rejected reply from node %d: %s", node_id, err.reason
            )
            return False
        outcome.replies[node_id] = checked
        if checked.ok:
            return None
        log(INFO, "segment: node %d lost a peer: %s", node_id, checked.failure)
        for lost in _named_nodes(checked, ranks, node_id):
            gone.setdefault(lost, {})[node_id] = checked.failure
        return checked.failure.startswith("join")

    def _segment_replies(
        self, until: Callable[[], float]
    ) -> Iterator[tuple[Message, Ticket]]:
        """Train replies as they arrive until ``until()`` (which a grace period
        may bring forward while this runs). Each wait is bounded by the current
        ``until()``, so on the virtual clock a grace period ends the wait when it
        expires instead of at the next arrival (a lost member's TTL expiry)."""
        while True:
            bound = until()
            pulled = cast(
                Generator[tuple[Message, Ticket, float], None, None],
                self.inflight.replies(
                    bound,
                    kind=MessageType.TRAIN,
                    done=lambda: self.clock.now() >= until(),
                ),
            )
            # closing it hands replies pulled but not yet taken back to the backlog
            with contextlib.closing(pulled) as replies:
                for reply, ticket, _ in replies:
                    yield reply, ticket
                    if until() < bound:
                        break  # a grace period began: wait at most until then
                else:
                    return

    def _grace(self, *, join: bool) -> float:
        bound = self.join_timeout_s + STORE_GRACE_S if join else self.timeout_s
        return bound + self.reply_margin_s

    # ------------------------------------------------------------------ evaluation
    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Average evaluation metrics, rejecting bad replies (logged)."""
        acc = MetricsAccumulator(self.weighted_by_key)
        for reply in replies:
            try:
                metrics = check_evaluate_reply(reply, self.weighted_by_key)
            except ReplyRejected as err:
                log(
                    WARNING,
                    "round %d: rejected evaluate reply from node %d: %s",
                    server_round,
                    reply.metadata.src_node_id,
                    err.reason,
                )
                continue
            acc.add(metrics, float(metrics[self.weighted_by_key]))  # type: ignore[arg-type]
        return acc.result(self.evaluate_metrics_aggr_fn)


def _ranks(messages: Iterable[Message], config_key: str) -> dict[int, int]:
    """Node -> rank, from the plans the segment's messages carry."""
    out: dict[int, int] = {}
    for message in messages:
        config = message.content.config_records.get(config_key)
        raw = config.get(PLAN_KEY) if config is not None else None
        if isinstance(raw, str):
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                out[message.metadata.dst_node_id] = int(json.loads(raw)["rank"])
    return out


def _named_nodes(
    reply: SegmentReply, ranks: Mapping[int, int], reporter: int
) -> list[int]:
    """The members a failed reply names gone (``span-lost-ranks``); ranks that are
    not in the segment, or the reporter's own, are ignored and logged."""
    value = reply.metrics.get(keys.SPAN_LOST_RANKS, [])
    values = value if isinstance(value, list) else [value]
    by_rank = {rank: node for node, rank in ranks.items()}
    out = []
    for rank in values:
        node = by_rank.get(int(rank)) if float(rank).is_integer() else None
        if node is None or node == reporter:
            log(
                WARNING,
                "segment: node %d names rank %r gone, which is not a peer of its "
                "segment (ranks %s): ignored",
                reporter,
                rank,
                sorted(by_rank),
            )
            continue
        out.append(node)
    return out


def _port_in_use(reason: str) -> int | None:
    marker = "rendezvous port "
    if marker in reason and "in use" in reason:
        tail = reason.split(marker, 1)[1].split()[0]
        if tail.isdigit():
            return int(tail)
    return None
