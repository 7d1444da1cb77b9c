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
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from logging import INFO, WARNING
from typing import Any, ClassVar

import numpy as np
from flowerbed import keys
from flowerbed.parallel.pipeline.planner import KEEP, REPARTITION, Layout
from flowerbed.parallel.pipeline.recovery import Holdings, layer_sources, recover
from flowerbed.parallel.pipeline.stage import INPUT_SHAPE, LOCAL_DATASET
from flowerbed.parallel.plan import LayerSource, MemberPlan, PlanError
from flowerbed.parallel.reference import ReferenceJob
from flowerbed.parallel.user_code import Training
from flowerbed.replies import ReplyRejected
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MetricRecord,
)
from flwr.serverapp import Grid
from flwr.supercore import log

from .options import copy_fields, take_options
from .pipeline_members import PipelineMembers
from .pipeline_options import DEFAULT_LINK_BYTES_PER_S, PipelinePlanning, Pipelining
from .pipeline_plan import (
    LayeredModel,
    check_job,
    segment_payloads,
    stage_table,
)
from .pipeline_rounds import (
    ROUND_FAILURE_S,
    ROUND_LOST_STEPS,
    ROUND_MODEL_STEP_S,
    ROUND_PARTITION,
    ROUND_PREDICTED_STEP_S,
    ROUND_RECOVERIES,
    ROUND_REPARTITIONS,
    ROUND_SECONDS,
    ROUND_STAGES,
    ROUND_STEP_S,
    RoundBook,
    check_arrays,
    dropped_members,
    ints,
    link_speeds,
    member_reports,
    num,
    round_figures,
    segment_reply,
    slowest,
    stage_seconds,
    stitch,
)
from .span import (
    SegmentOutcome,
    SegmentReply,
    SpanMember,
    arrayrecord,
    check_initial_arrays,
)
from .span_sizing import DEFAULT_SETUP_SHARE, SegmentSizer

__all__ = [  # the names this module held before its parts moved out
    "DEFAULT_LINK_BYTES_PER_S",
    "DEFAULT_STEPS_PER_ROUND",
    "ROUND_FAILURE_S",
    "ROUND_LOST_STEPS",
    "ROUND_MODEL_STEP_S",
    "ROUND_PARTITION",
    "ROUND_PREDICTED_STEP_S",
    "ROUND_RECOVERIES",
    "ROUND_REPARTITIONS",
    "ROUND_SECONDS",
    "ROUND_STAGES",
    "ROUND_STEP_S",
    "PipelinePlanning",
    "PipelineTraining",
    "Pipelining",
]

DEFAULT_STEPS_PER_ROUND = 20
"""Steps of the first round's segment when the strategy sizes segments."""


class PipelineTraining(PipelineMembers):
    """Pipeline-parallel training over unequal boards (FTPipeHD), with
    recovery: profiling, partition, dynamic re-partition and fault tolerance as
    the module doc describes.

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
        K, synchronous steps per round (segment), fixed. None: sized from 20
        so that set-up is at most ``setup_share`` of a round
        (:mod:`flowerbed.strategies.span_sizing`).
    setup_share : float or None (default: 0.1)
        Largest share of a round set-up may take when ``steps_per_round`` is
        None; None keeps 20 steps per round.
    batch_size : int (default: 32)
        Samples per step (split into ``pipelining.micro_batches``).
    lr, momentum, weight_decay : float (defaults: 0.05, 0.0, 0.0)
        SGD's settings. A train config's ``lr`` overrides ``lr`` for its round.
    training : flowerbed.parallel.Training, optional
        A loss function and a ``torch.optim`` optimiser factory of your own, by
        ``"package.module:function"`` name (default: cross-entropy and SGD with
        the settings above; a factory gets ``lr`` and its own arguments).
    pipelining : Pipelining, optional (default: Pipelining())
        Micro-batches, schedule and replication period
        (:mod:`flowerbed.strategies.pipeline_options`).
    planning : PipelinePlanning, optional (default: PipelinePlanning())
        Members, partition, re-partitioning, profiling and attempts per round.
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
        Round -> its stages: ``{"node": id, "device": label, "layers": [a, b]}``
        (layers ``a .. b-1``), in stage order.
    profiled_power : dict of int to float
        Node -> computing power measured when it was admitted.
    """

    mode = "pipeline"

    OPTION_DEFAULTS: ClassVar[Mapping[str, Any]] = {
        "pipelining": Pipelining(),
        "planning": PipelinePlanning(),
    }

    def __init__(  # pylint: disable=too-many-arguments
        self,
        *args: Any,
        model: str = "",
        input_shape: Sequence[int] = (),
        model_args: Mapping[str, Any] | None = None,
        dataset: str = "digits",
        steps_per_round: int | None = None,
        setup_share: float | None = DEFAULT_SETUP_SHARE,
        batch_size: int = 32,
        lr: float = 0.05,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        seed: int = 0,
        training: Training | None = None,
        pipelining: Pipelining | None = None,
        planning: PipelinePlanning | None = None,
        **kwargs: Any,
    ) -> None:
        given = {"pipelining": pipelining, "planning": planning}
        wanted = {k: (v, self.OPTION_DEFAULTS[k]) for k, v in given.items()}
        options = take_options(type(self).__name__, kwargs, wanted)
        super().__init__(*args, **kwargs)
        self.pipelining: Pipelining = options["pipelining"]
        self.planning: PipelinePlanning = options["planning"]
        copy_fields(self, self.pipelining, self.planning)  # self.micro_batches, ...
        sgd = (lr, momentum, weight_decay)
        micro = self.pipelining.micro_batches
        check_job(model, input_shape, steps_per_round, batch_size, micro, sgd)
        self.model, self.model_args = model, dict(model_args or {})
        self.input_shape = tuple(int(v) for v in input_shape)
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.sizer = SegmentSizer(
            DEFAULT_STEPS_PER_ROUND if steps_per_round is None else steps_per_round,
            setup_share if steps_per_round is None else None,
        )
        self.lr, self.momentum, self.weight_decay = sgd
        self.training = Training() if training is None else training
        self.training.check()  # a name that does not import fails here
        settings = (batch_size, momentum, seed, self.training)
        layered = LayeredModel.build(
            model, self.model_args, self.input_shape, settings, *options.values()
        )
        self.num_layers, self.planner = layered.num_layers, layered.planner
        self.reference_state = layered.reference_state
        self._new_run()

    def _new_run(self) -> None:
        """The run's state, before the first round."""
        self.members: dict[int, SpanMember] = {}
        self.evaluate_timeout_s = self.planning.query_timeout_s
        self.job = ""
        self.layout: Layout | None = None
        self.central: dict[str, np.ndarray] = {}
        self.holdings = Holdings(self.num_layers)
        self.events: list[str] = []
        self.layouts: dict[int, list[dict[str, Any]]] = {}
        self.profiled_power: dict[int, float] = {}
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
            self.pipelining.micro_batches,
            self.pipelining.schedule,
            self.pipelining.replicate_every,
        )
        log(INFO, "\t└── %s", self.training.describe("SGD"))

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
        config = ConfigRecord(dict(config))
        config[keys.SERVER_ROUND] = server_round
        plans, weights, optimizer = segment_payloads(
            self._pending, self._sources, arrays, self.central_optimizer, float(lr)
        )
        return self.segment_messages(plans, weights, optimizer, config, self._timeout)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Stitch the members' layers into the whole model.

        The replies must all report a finished segment and together hold every
        state array of the model exactly once, with its shape; otherwise the
        result is ``(None, None)`` (a failed segment) and the reason logged.
        """
        try:
            checked = [self.check_reply(segment_reply(r)) for r in replies]
        except ReplyRejected as err:
            log(WARNING, "round %d: rejected reply: %s", server_round, err.reason)
            return None, None
        return self._stitch(checked)

    def check_reply(self, reply: SegmentReply) -> SegmentReply:
        """Reject arrays the model does not have, wrong shapes, a bad listing."""
        return check_arrays(reply, self.reference_state)

    def _stitch(
        self, replies: Sequence[SegmentReply]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return stitch(replies, self.reference_state, self.batch_size)

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
        book = RoundBook(began=self.clock.now())
        for attempt in range(1, self.planning.max_attempts + 1):
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
                        server_round, layout, outcome, stitched, metrics, book
                    )
            self._recover(server_round, layout, outcome, book, attempt)
        return None

    def _plans(self, layout: Layout, steps: int) -> dict[int, MemberPlan]:
        segment, port = self.next_segment()
        host = self.members[layout.members[0]].address
        common = MemberPlan(
            mode=self.mode,
            job=self.job,
            segment=segment,
            rank=0,
            world_size=len(layout.members),
            host=host,
            port=port,
            start_step=self.step,
            steps=steps,
            batch_size=self.batch_size,
            seed=self.seed,
            micro_batches=self.pipelining.micro_batches,
            schedule=self.pipelining.schedule,
            replicate_every=self.pipelining.replicate_every,
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
            options={INPUT_SHAPE: list(self.input_shape), **self.training.to_options()},
        )
        return {m: replace(common, rank=r) for r, m in enumerate(layout.members)}

    def _finish(
        self,
        server_round: int,
        layout: Layout,
        outcome: SegmentOutcome,
        stitched: ArrayRecord,
        metrics: MetricRecord,
        book: RoundBook,
    ) -> tuple[ArrayRecord, MetricRecord]:
        """A completed segment: the replies become the central copy."""
        steps = int(num(metrics[keys.NUM_STEPS]))
        first = self.step
        self.step += steps
        self.central = {k: v.numpy() for k, v in stitched.items()}
        self.central_optimizer = {}
        for reply in outcome.replies.values():
            self.central_optimizer.update(reply.optimizer)
        self.holdings = Holdings(self.num_layers, central_step=self.step)
        for node_id, reply in outcome.replies.items():
            self.holdings.add_report(node_id, ints(reply.metrics[keys.SPAN_HOLDS]))
        _, book.predicted = self.planner.predict(layout)
        self.layouts[server_round] = stage_table(layout, self.members)
        replies = outcome.replies
        self.planner.measured(layout, stage_seconds(replies), link_speeds(replies))
        # A step's cost includes its share of the ring replications: they are
        # paid per step, not once per segment like the set-up.
        every = self.pipelining.replicate_every
        replicate = slowest(replies, keys.SPAN_REPLICATE_S)
        per_step = slowest(replies, keys.SPAN_STEP_S) + (
            replicate / every if every else 0.0
        )
        out = dict(metrics)
        out.update(
            self._measure_setup(
                server_round,
                outcome.seconds,
                steps,
                per_step,
                (r.metrics for r in replies.values()),
            )
        )
        segment = (self.batch_size, first, steps)
        out.update(
            round_figures(
                book,
                self.planner,
                layout,
                replies,
                self.pipelining,
                segment,
                self.clock.now(),
            )
        )
        return stitched, MetricRecord(out)

    def _recover(
        self,
        server_round: int,
        layout: Layout,
        outcome: SegmentOutcome,
        book: RoundBook,
        attempt: int,
    ) -> None:
        """After a failed segment: drop lost members, pick the restart step."""
        for node_id, reason in dropped_members(outcome, layout).items():
            if reason is not None:
                self.refused[node_id] = reason
            self.lost.add(node_id)
            self.planner.forget(node_id)
        reports = member_reports(outcome)
        survivors = [m for m in self.members if m not in self.lost]
        found = recover(self.holdings, self.step, reports, outcome.errors, survivors)
        book.lost_steps += found.lost_steps
        book.recoveries += 1
        # The attempt's time not kept: its set-up, the lost steps, the detection.
        per_step = slowest(outcome.replies, keys.SPAN_STEP_S)
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
