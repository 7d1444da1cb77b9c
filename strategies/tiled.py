"""TiledTraining: fused-tile training of a CNN's early layers across co-located boards.

The Flower side of S2 (Rama, Threadgill, Gerstlauer, "Distributed Convolutional
Neural Network Training on Mobile and Edge Clusters", arXiv 2409.09083): the
feature-map-heavy early layers of one model are split into spatial tiles, one per
board, fused into groups, and trained exactly
(:mod:`flowerbed.parallel.tiles.exact_step`); the weight-heavy rest runs on one
board. Flower is the control plane (docs/architecture.md, "Jobs that span
devices"): per round this strategy

1. (first round, and after a loss) selects co-located boards: the connected
   nodes that answer a ``tiles`` profiling query (their training speed on the
   model's first layers and their free memory) and share the largest IP subnet
   (``subnet_prefix``), at most ``max_devices``;
2. plans: rank 0 is the board with the most memory (it holds the head), tiles
   are sized to the measured speeds, the grouping and the number of tiled layers
   come from the cost model's DP
   (:func:`flowerbed.parallel.tiles.grouping.plan_tiles`) under every board's
   memory; a plan that fits nowhere is a clear error before anything is sent;
3. sends each member its plan and weights (rank 0 the whole model and momentum,
   the others the tiled front's), runs one segment of ``steps_per_round`` steps
   and takes the new weights from rank 0's reply;
4. when a board is lost the segment fails fast (peers see the closed
   connection; :class:`~flowerbed.strategies.span.SpanJobStrategy`), nothing is
   applied, and the next round re-plans the same steps without the lost board.

After every complete segment each member's MACs and compute seconds per step
update its speed model, ``seconds = fixed_s + MACs / rate``
(:class:`~flowerbed.parallel.tiles.speed.SpeedModel`: the fixed cost of a step
apart from the cost per MAC, smoothed), and tiles are sized by ``rate``: they
follow the boards' real speed, and equal boards keep equal tiles (a small tile's
fixed cost is not taken for slowness).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flowerbed import keys
from flowerbed.parallel.plan import MemberPlan, PlanError
from flowerbed.parallel.reference import ReferenceJob
from flowerbed.parallel.tiles.grouping import Cluster, plan_tiles
from flowerbed.parallel.tiles.layout import layout
from flowerbed.parallel.tiles.regions import TileError
from flowerbed.parallel.tiles.speed import SpeedModel
from flowerbed.parallel.user_code import Training
from flowerbed.replies import ReplyRejected
from flowerbed.strategies.accumulation import to_numpy
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MetricRecord,
)
from flwr.serverapp import Grid
from flwr.supercore import log

from .options import take_options
from .span import (
    SegmentOutcome,
    SegmentReply,
    SpanJobStrategy,
    arrayrecord,
    check_segment_reply,
)
from .span_evaluation import evaluate_messages, query_config
from .tile_boards import (
    MEMORY_HEADROOM,
    Board,
    colocated,
    colocated_boards,
    observe_speeds,
    profiled_boards,
    rank_order,
    subnet_of,
)
from .tile_figures import (
    DEVICES,
    FRONT,
    GROUPS,
    PREDICTED_STEP_S,
    SEGMENT_OK,
    TILE_AREAS,
    segment_figures,
)
from .tile_model import TileModel
from .tile_options import (
    DEFAULT_LATENCY_S,
    DEFAULT_LINK_MBPS,
    DEFAULT_MAX_DEVICES,
    DEFAULT_SUBNET_PREFIX,
    TileLinks,
    TilePlanning,
    check_count,
)
from .tile_segment import (
    SegmentPlan,
    cluster_of,
    segment_payloads,
    tile_areas,
    tile_options,
)

__all__ = [  # the names this module held before its concerns moved out
    "DEFAULT_LATENCY_S",
    "DEFAULT_LINK_MBPS",
    "DEFAULT_MAX_DEVICES",
    "DEFAULT_SUBNET_PREFIX",
    "DEVICES",
    "FRONT",
    "GROUPS",
    "MEMORY_HEADROOM",
    "PREDICTED_STEP_S",
    "SEGMENT_OK",
    "TILE_AREAS",
    "Board",
    "SegmentPlan",
    "TiledTraining",
    "colocated",
    "subnet_of",
]

MODE = "tiles"


def check_input_shape(input_shape: Sequence[int]) -> tuple[int, int, int]:
    """``input_shape`` as a tuple; ValueError unless (channels, height, width)."""
    shape = tuple(int(v) for v in input_shape)
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(
            f"input_shape {list(input_shape)} must be (channels, height, width)"
        )
    return shape[0], shape[1], shape[2]


def check_counts(batch_size: int, steps_per_round: int, num_classes: int) -> None:
    """Raise ValueError unless each is an integer >= 1."""
    check_count("batch_size", batch_size)
    check_count("steps_per_round", steps_per_round)
    check_count("num_classes", num_classes)


def check_sgd(lr: float, momentum: float, weight_decay: float) -> None:
    """Raise ValueError unless ``lr`` > 0 and ``momentum`` and ``weight_decay``
    >= 0 (all finite)."""
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be > 0, got {lr}")
    for name, number in (("momentum", momentum), ("weight_decay", weight_decay)):
        if not (math.isfinite(number) and number >= 0):
            raise ValueError(f"{name} must be >= 0, got {number}")


class TiledTraining(SpanJobStrategy):
    """Fused-tile training across co-located boards (see the module docstring).

    Parameters
    ----------
    (FedAvg's parameters, same defaults; ``fraction_train`` and
    ``min_train_nodes`` bound how many boards a job takes; ``min_train_nodes``
    is also the fewest boards the first plan accepts), the span parameters of
    :class:`~flowerbed.strategies.span.SpanJobStrategy`, and:
    model : str (default: "yolo-tiny")
        A layered model (:func:`flowerbed.models.build_sequential`): a name or
        ``"package.module:function"``; ``initial_arrays`` must be its state.
    model_args : dict, optional
        Arguments of the model's function.
    input_shape : sequence of int (default: (3, 416, 416))
        Shape of one sample, ``(channels, height, width)``.
    dataset : str (default: "synthetic")
        A job dataset every board reads (``digits32`` ...,
        :mod:`flowerbed.parallel.job_data`) or ``"synthetic"`` (Gaussian images,
        uniform labels: timing runs).
    num_classes : int, optional
        Classes of the synthetic labels (default: ``model_args["num_classes"]``
        or 20).
    batch_size : int (default: 4)
        Samples per step (every board works on every sample, on its tile).
    steps_per_round : int (default: 5)
        Steps per segment (one Flower round).
    lr, momentum, weight_decay : float (defaults: 0.01, 0.9, 0.0)
        SGD's settings.
    seed : int (default: 0)
        Data order: the batch of global step ``t`` is a function of (seed, t).
    eval_samples : int (default: 0)
        Test samples rank 0 evaluates after each round (0: all); only with a
        dataset that has a test split and ``fraction_evaluate > 0``.
    training : flowerbed.parallel.Training, optional
        A loss function and a ``torch.optim`` optimiser factory of your own, by
        ``"package.module:function"`` name (default: cross-entropy and SGD with
        the settings above; a factory gets ``lr`` and its own arguments).
    planning : TilePlanning, optional (default: TilePlanning())
        Which boards a job takes and how its tiles are planned
        (:mod:`flowerbed.strategies.tile_options`).
    links : TileLinks, optional (default: TileLinks())
        The boards' links, as the planner models them.

    ``train_config`` entries travel to every member with its plan. Metrics per
    round (``Result.train_metrics_clientapp``;
    :mod:`flowerbed.strategies.tile_figures`): ``train-loss``, ``num-examples``,
    ``tiles-segment-ok``, ``tiles-devices``, ``tiles-front``, ``tiles-groups``,
    ``tiles-predicted-step-s``, and the slowest member's ``span-step-s``,
    ``tiles-compute-s``, ``tiles-link-s``, ``tiles-activation-bytes``,
    ``tiles-peak-rss-bytes``.

    Attributes
    ----------
    model, model_args, input_shape, dataset, seed, planning, links
        The parameters of the same names, as given (``input_shape`` a tuple).
    tile_model : TileModel
        The model's geometry and state shapes, as the server plans and checks.
    boards : list of Board
        The selected members, with their measured speed and memory budget.
    segment : SegmentPlan or None
        The last planned segment: its tile plan and its boards in rank order.
    step : int
        Global steps completed.
    """

    mode = MODE

    def __init__(  # pylint: disable=too-many-arguments
        self,
        *args: Any,
        model: str = "yolo-tiny",
        model_args: Mapping[str, Any] | None = None,
        input_shape: Sequence[int] = (3, 416, 416),
        dataset: str = "synthetic",
        num_classes: int | None = None,
        batch_size: int = 4,
        steps_per_round: int = 5,
        lr: float = 0.01,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        seed: int = 0,
        eval_samples: int = 0,
        training: Training | None = None,
        planning: TilePlanning | None = None,
        links: TileLinks | None = None,
        **kwargs: Any,
    ) -> None:
        wanted = {"planning": (planning, TilePlanning()), "links": (links, TileLinks())}
        options = take_options(type(self).__name__, kwargs, wanted)
        super().__init__(*args, **kwargs)
        self.planning, self.links = options["planning"], options["links"]
        self.model, self.model_args = model, dict(model_args or {})
        self.input_shape = check_input_shape(input_shape)
        self.num_classes = num_classes or int(self.model_args.get("num_classes", 20))
        check_counts(batch_size, steps_per_round, self.num_classes)
        check_sgd(lr, momentum, weight_decay)
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.batch_size, self.steps_per_round = batch_size, steps_per_round
        self.training = Training() if training is None else training
        self.training.check()  # a name that does not import fails here
        self.dataset, self.seed, self.eval_samples = dataset, seed, eval_samples
        self.tile_model = TileModel(
            model, self.model_args, seed, self.input_shape, self.planning.norm
        )
        self.speed_models: dict[int, SpeedModel] = {}
        """Node -> its speed model (profiled, then measured every segment)."""
        self.job = f"tiles-{int(time.time() * 1000) % 10**9}"
        self.boards: list[Board] = []
        self.segment: SegmentPlan | None = None
        self.round_timeout = 3600.0
        """Seconds a round may take (``start``'s ``timeout``)."""

    # ------------------------------------------------------------------ info
    def reference_job(self) -> ReferenceJob:
        """This job as one device would train it: pass it to
        :func:`flowerbed.parallel.reference.single_device` to check a run. With
        ``norm="frozen"`` the front's batch norms run in eval mode, so the job
        must have planned a segment (its front) first."""
        front = 0
        if self.planning.norm == "frozen":
            if self.segment is None:
                raise ValueError(
                    "norm='frozen': the reference needs the planned front; call "
                    "reference_job() after start()"
                )
            front = self.segment.tile_plan.front
        return ReferenceJob(
            **{**self.job_fields(), "dataset": self.dataset or "synthetic"},
            lr=self.lr,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            training=self.training,
            input_shape=tuple(self.input_shape),
            num_classes=self.num_classes,
            eval_norm_layers=front,
            layered=True,
        )

    def summary(self) -> None:
        log(
            INFO,
            "\t├── TiledTraining: model %s %s, batch %d, %d steps per round, up to "
            "%d boards, %g Mb/s links",
            self.model,
            list(self.input_shape),
            self.batch_size,
            self.steps_per_round,
            self.planning.max_devices,
            self.links.link_mbps,
        )
        log(INFO, "\t└── %s", self.training.describe("SGD"))

    # ------------------------------------------------------------------ model
    def geometry(self) -> Any:
        """The planner's view of the model (built once, on the server)."""
        return self.tile_model.geometry()

    def check_arrays(self, arrays: Mapping[str, np.ndarray], what: str) -> None:
        """Raise ValueError unless ``arrays`` is the model's state (names, shapes)."""
        self.tile_model.check_arrays(arrays, what)

    # ------------------------------------------------------------------ boards
    def profile_query(self) -> dict[str, Any]:
        return {
            "mode": MODE,
            "model": self.model,
            "model_args": self.model_args,
            "input-shape": list(self.input_shape),
            "profile-size": self.planning.profile_size,
        }

    def select_boards(self, grid: Grid, timeout: float) -> list[Board]:
        """Discover, profile and pick co-located boards (module docstring)."""
        nodes = self.discover(grid, 10**6, timeout)
        members, errors = self.profile_members(
            grid, nodes, self.profile_query(), timeout
        )
        boards = profiled_boards(members, errors, self.speed_models, self.planning)
        chosen = colocated_boards(
            boards, members, self.planning, self.min_train_nodes, self.fraction_train
        )
        if len(chosen) < self.min_train_nodes:
            raise RuntimeError(
                f"TiledTraining needs {self.min_train_nodes} co-located boards, found "
                f"{len(chosen)} (of {len(nodes)} connected); left out: "
                + "; ".join(f"node {n}: {why}" for n, why in sorted(errors.items()))
            )
        left_out = len(boards) - len(chosen)
        log(
            INFO,
            "tiles: %d boards on %s%s",
            len(chosen),
            subnet_of(chosen[0].address, self.planning.subnet_prefix),
            f" ({left_out} elsewhere or beyond max_devices)" if left_out else "",
        )
        return chosen

    rank_order = staticmethod(rank_order)
    """Rank 0 holds the head: the most memory, then the fastest."""

    def cluster(self, boards: Sequence[Board]) -> Cluster:
        """The planner's view of ``boards`` (in rank order) and their links."""
        return cluster_of(boards, self.links, self.planning.bands)

    def plan_segment(self, boards: Sequence[Board]) -> SegmentPlan:
        """Plan tiles and groups for ``boards`` (PlanError/TileError if none fits)."""
        ordered = self.rank_order(boards)
        tile_plan = plan_tiles(
            self.geometry(),
            self.cluster(ordered),
            self.batch_size,
            front=self.planning.front,
            bounds=self.planning.bounds,
        )
        return SegmentPlan(tile_plan, ordered)

    def tile_areas(self, segment: SegmentPlan) -> list[int]:
        """Pixels of each rank's tile of the first tiled group's output (the
        largest map), in rank order."""
        return tile_areas(self.geometry(), segment.tile_plan)

    def member_plans(self, segment: SegmentPlan) -> dict[int, MemberPlan]:
        """One plan per board of ``segment``: its rank, its tile, the job."""
        tp = segment.tile_plan
        options = tile_options(
            tp, self.input_shape, self.num_classes, self.planning.norm, self.links
        )
        lay = layout(self.geometry(), tp.bounds, tp.weights, tp.bands)
        return self.segment_plans(
            [board.node_id for board in segment.boards],
            segment.boards[0].address,
            self.steps_per_round,
            lambda rank: {"tile": lay.tiles[-1][rank].as_tuple()},
            lr=self.lr,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            options={**options, **self.training.to_options()},
        )

    # ------------------------------------------------------------------ rounds
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Plan the round's segment for the current boards and build its messages:
        rank 0 gets every array (and momentum), the others the tiled front's."""
        if self._inflight is None:
            self.attach(grid)
        if not self.boards:
            self.boards = self.select_boards(grid, self.round_timeout)
        state = to_numpy(arrays)
        self.check_arrays(state, "the arrays")
        self.segment = self.plan_segment(self.boards)
        self.segment.plans = self.member_plans(self.segment)
        tp = self.segment.tile_plan
        log(
            INFO,
            "round %d: %d boards, %d tiled layers in groups %s (bands %d), "
            "predicted %.2f s per step",
            server_round,
            len(self.boards),
            tp.front,
            list(tp.bounds),
            tp.bands,
            tp.cost.total_s,
        )
        payload, momentum = segment_payloads(
            state, self.central_optimizer, self.segment.plans, tp.front
        )
        return self.segment_messages(
            self.segment.plans, payload, momentum, config, ttl=self.round_timeout
        )

    def check_reply(self, reply: SegmentReply) -> None:
        """Reject a member reply that cannot be used (raises ReplyRejected)."""
        assert self.segment is not None
        plan = self.segment.plans.get(reply.node_id)
        if plan is None:
            raise ReplyRejected(f"node {reply.node_id} is not a member of the segment")
        if reply.ok:
            self.tile_model.check_reply(reply, plan.rank)

    def aggregate_segment(
        self, server_round: int, outcome: SegmentOutcome
    ) -> tuple[ArrayRecord | None, MetricRecord]:
        """The new weights (rank 0's) and the round's metrics; on a failed segment
        no weights, and the failed boards leave the job."""
        assert self.segment is not None
        seg = self.segment
        replies = outcome.replies
        metrics = segment_figures(seg, outcome.complete, self.tile_areas(seg), replies)
        head = seg.boards[0].node_id
        if not outcome.complete or head not in replies:
            lost = outcome.dropped_members
            self.boards = [b for b in self.boards if b.node_id not in lost]
            log(
                WARNING,
                "round %d: the segment failed (lost %s, errors %s, rejected %s); the "
                "next round repeats steps %d.. without the lost boards (%d left)",
                server_round,
                sorted(outcome.lost),
                sorted(outcome.errors),
                sorted(outcome.rejected),
                self.step,
                len(self.boards),
            )
            return None, MetricRecord(metrics)
        rank0 = replies[head]
        metrics[keys.NUM_EXAMPLES] = self.steps_per_round * self.batch_size
        metrics[keys.TRAIN_LOSS] = float(rank0.metrics[keys.TRAIN_LOSS])
        self.step += self.steps_per_round
        self.central_optimizer = dict(rank0.optimizer)
        observe_speeds(replies, self.boards, self.speed_models)
        return arrayrecord(rank0.arrays), MetricRecord(metrics)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Flower's hook on raw replies: check them and take rank 0's weights."""
        outcome = SegmentOutcome()
        for reply in replies:
            node_id = reply.metadata.src_node_id
            if reply.has_error():
                outcome.errors[node_id] = reply.error.reason or "error reply"
                continue
            try:
                checked = check_segment_reply(reply)
                self.check_reply(checked)
            except ReplyRejected as err:
                outcome.rejected[node_id] = err.reason
                continue
            outcome.replies[node_id] = checked
        if self.segment is not None:
            outcome.lost = set(self.segment.plans) - (
                set(outcome.replies) | set(outcome.errors) | set(outcome.rejected)
            )
        return self.aggregate_segment(server_round, outcome)

    def train_round(
        self,
        grid: Grid,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        timeout: float,
    ) -> tuple[ArrayRecord | None, MetricRecord]:
        """Plan, run and gather one segment (the body of a training round)."""
        messages = self.configure_train(server_round, arrays, config, grid)
        outcome = self.run_segment(messages, server_round, timeout, self.check_reply)
        return self.aggregate_segment(server_round, outcome)

    def _evaluation_messages(
        self,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        ttl: float,
    ) -> list[Message]:
        """Rank 0's evaluation message (none without a dataset or boards)."""
        del server_round
        if (
            self.fraction_evaluate <= 0
            or self.dataset == "synthetic"
            or not self.boards
        ):
            return []
        query = dict(self.profile_query())
        query.update({"dataset": self.dataset, "eval-samples": self.eval_samples})
        record = query_config(config, query)
        head = self.rank_order(self.boards)[0].node_id
        records = {self.configrecord_key: record, self.arrayrecord_key: arrays}
        return evaluate_messages(records, [head], ttl)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Rank 0 evaluates the whole model on the dataset's test split."""
        del grid
        return self._evaluation_messages(
            server_round, arrays, config, self.round_timeout
        )

    def evaluate_round(
        self,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        timeout: float,
    ) -> MetricRecord | None:
        """Rank 0 evaluates the whole model on the dataset's test split."""
        messages = self._evaluation_messages(server_round, arrays, config, timeout)
        return self.evaluate_members(server_round, messages, timeout)

    # ------------------------------------------------------------------ the rounds
    def _check_initial(self, initial_arrays: ArrayRecord) -> None:
        self.check_arrays(to_numpy(initial_arrays), "initial_arrays")

    def _prepare_run(self, grid: Grid, done: int) -> None:
        """Pick the boards; a plan that cannot be made for them fails here."""
        del done
        self.round_timeout = self._timeout
        self.boards = self.select_boards(grid, self._timeout)
        self.plan_segment(self.boards)

    def _segment_round(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> tuple[ArrayRecord | None, MetricRecord | None] | None:
        """One segment: a failed one (a board lost) changes no weights and the
        next round re-plans without the lost boards; no boards left, or no plan
        for those left, ends the run."""
        if self.segment is not None and not self.boards:
            log(WARNING, "no boards left: stopping after round %d", server_round - 1)
            return None
        try:
            return self.train_round(grid, server_round, arrays, config, self._timeout)
        except (PlanError, TileError) as err:
            # only after a loss: the first plan was checked in _prepare_run
            log(WARNING, "round %d: no plan: %s; stopping", server_round, err)
            return None

    def _evaluate_wait(self) -> float:
        return self.round_timeout
