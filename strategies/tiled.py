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

import ipaddress
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flowerbed import keys
from flowerbed.parallel.plan import MemberPlan, PlanError
from flowerbed.parallel.reference import ReferenceJob
from flowerbed.parallel.tiles.grouping import Cluster, TilePlan, plan_tiles
from flowerbed.parallel.tiles.layout import layout
from flowerbed.parallel.tiles.regions import TileError
from flowerbed.parallel.tiles.speed import DEFAULT_SMOOTHING, SpeedModel
from flowerbed.parallel.user_code import Training
from flowerbed.replies import ReplyRejected
from flowerbed.strategies.accumulation import to_numpy
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
    SpanMember,
    arrayrecord,
    check_segment_reply,
)

MODE = "tiles"
DEFAULT_LINK_MBPS = 100.0
"""Raspberry Pi 3 Ethernet (docs/references.md, "Devices")."""
DEFAULT_LATENCY_S = 1e-3
DEFAULT_SUBNET_PREFIX = 24
DEFAULT_MAX_DEVICES = 6
MEMORY_HEADROOM = 0.8
"""Share of a board's reported free memory a plan may use (the rest: the
ClientApp process, torch's allocator slack, the OS)."""
SEGMENT_OK = "tiles-segment-ok"
DEVICES = "tiles-devices"
FRONT = "tiles-front"
GROUPS = "tiles-groups"
PREDICTED_STEP_S = "tiles-predicted-step-s"
TILE_AREAS = "tiles-areas"
"""Pixels of each rank's tile of the first tiled group's output (the largest
map), in rank order."""


def subnet_of(address: str, prefix: int) -> str:
    """The network an address belongs to (``/prefix`` for IPv4, ``/64`` for
    IPv6); a host name's domain (after its first dot) stands for its network."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return "dns:" + address.partition(".")[2]
    bits = prefix if ip.version == 4 else 64
    return str(ipaddress.ip_network(f"{address}/{bits}", strict=False))


def colocated(
    members: Iterable[SpanMember], prefix: int, speed: Callable[[SpanMember], float]
) -> list[SpanMember]:
    """The largest group of members on one subnet (ties: the faster group)."""
    groups: dict[str, list[SpanMember]] = {}
    for member in members:
        groups.setdefault(subnet_of(member.address, prefix), []).append(member)
    if not groups:
        return []
    return max(
        groups.values(),
        key=lambda g: (len(g), sum(speed(m) for m in g)),
    )


@dataclass
class Board:
    """A selected member with what the planner needs."""

    node_id: int
    address: str
    speed: float
    """Forward MACs per second of forward + backward (profiled, then measured)."""
    memory: float
    """Bytes this job may use on the board."""
    label: str = ""


@dataclass
class SegmentPlan:
    """What one segment sends: the plan, its boards in rank order, the layout."""

    tile_plan: TilePlan
    boards: list[Board]
    plans: dict[int, MemberPlan] = field(default_factory=dict)


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
    training : flowerbed.parallel.Training, optional
        A loss function and a ``torch.optim`` optimiser factory of your own, by
        ``"package.module:function"`` name (default: cross-entropy and SGD with
        the settings above; a factory gets ``lr`` and its own arguments).
    speed_smoothing : float (default: 0.5)
        Weight of a segment's speed estimate against the previous one
        (:class:`flowerbed.parallel.tiles.speed.SpeedModel`), in (0, 1].
    max_devices : int (default: 6)
        Most boards one job takes.
    front : int, optional
        Tile exactly this many top-level layers (default: the DP chooses).
    bounds : sequence of int, optional
        Fix the grouping, e.g. ``(0, 4, 8)`` (default: the DP chooses).
    bands : int, optional
        Bands of rows of the tile grid (default: least halo).
    norm : str (default: "sync")
        Batch norm in the tiled layers: ``"sync"`` (full-map statistics summed
        across boards) or ``"frozen"`` (running statistics).
    link_mbps : float (default: 100)
        Each board's link speed (megabits/s), for the planner.
    latency_s : float (default: 0.001)
        Seconds per message, for the planner.
    memory_budget_mb : float, optional
        Cap on the memory a board may use (MiB), e.g. 900 for a 1 GB Pi 3
        (default: 80% of what the board reports free).
    emulate_link : bool (default: False)
        Members sleep to emulate ``link_mbps`` (local runs on one machine).
    subnet_prefix : int (default: 24)
        Boards whose IPv4 addresses share this prefix count as co-located.
    profile_size : int (default: 64)
        Side of the square crop each board times when profiled.
    eval_samples : int (default: 0)
        Test samples rank 0 evaluates after each round (0: all); only with a
        dataset that has a test split and ``fraction_evaluate > 0``.

    ``train_config`` entries travel to every member with its plan. Metrics per
    round (``Result.train_metrics_clientapp``): ``train-loss``, ``num-examples``,
    ``tiles-segment-ok``, ``tiles-devices``, ``tiles-front``, ``tiles-groups``,
    ``tiles-predicted-step-s``, and the slowest member's ``span-step-s``,
    ``tiles-compute-s``, ``tiles-link-s``, ``tiles-activation-bytes``,
    ``tiles-peak-rss-bytes``.

    Attributes
    ----------
    model, model_args, input_shape, dataset, seed
        The parameters of the same names, as given (``input_shape`` a tuple).
    boards : list of Board
        The selected members, with their measured speed and memory budget.
    segment : SegmentPlan or None
        The last planned segment: its tile plan and its boards in rank order.
    step : int
        Global steps completed.
    """

    mode = MODE

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
        max_devices: int = DEFAULT_MAX_DEVICES,
        front: int | None = None,
        bounds: Sequence[int] | None = None,
        bands: int | None = None,
        norm: str = "sync",
        link_mbps: float = DEFAULT_LINK_MBPS,
        latency_s: float = DEFAULT_LATENCY_S,
        memory_budget_mb: float | None = None,
        emulate_link: bool = False,
        subnet_prefix: int = DEFAULT_SUBNET_PREFIX,
        profile_size: int = 64,
        eval_samples: int = 0,
        training: Training | None = None,
        speed_smoothing: float = DEFAULT_SMOOTHING,
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
        from flowerbed.parallel.tiles.region_ops import check_norm

        self.model = model
        self.model_args = dict(model_args or {})
        self.input_shape = tuple(int(v) for v in input_shape)
        if len(self.input_shape) != 3 or min(self.input_shape) < 1:
            raise ValueError(
                f"input_shape {list(input_shape)} must be (channels, height, width)"
            )
        self.dataset = dataset
        classes = num_classes or int(self.model_args.get("num_classes", 20))
        self.num_classes = classes
        positive = {
            "batch_size": batch_size,
            "steps_per_round": steps_per_round,
            "max_devices": max_devices,
            "profile_size": profile_size,
            "num_classes": classes,
        }
        for name, value in positive.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name, number in (("link_mbps", link_mbps), ("lr", lr)):
            if not (math.isfinite(number) and number > 0):
                raise ValueError(f"{name} must be > 0, got {number}")
        for name, number in (
            ("latency_s", latency_s),
            ("momentum", momentum),
            ("weight_decay", weight_decay),
        ):
            if not (math.isfinite(number) and number >= 0):
                raise ValueError(f"{name} must be >= 0, got {number}")
        if memory_budget_mb is not None and not memory_budget_mb > 0:
            raise ValueError(f"memory_budget_mb must be > 0, got {memory_budget_mb}")
        if not 0 <= subnet_prefix <= 32:
            raise ValueError(f"subnet_prefix must be 0..32, got {subnet_prefix}")
        try:
            check_norm(norm)
        except TileError as err:
            raise ValueError(str(err)) from None
        self.batch_size = batch_size
        self.steps_per_round = steps_per_round
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.training = Training() if training is None else training
        self.training.check()  # a name that does not import fails here
        if not 0 < speed_smoothing <= 1:
            raise ValueError(
                f"speed_smoothing must be in (0, 1], got {speed_smoothing}"
            )
        self.speed_smoothing = float(speed_smoothing)
        self.speed_models: dict[int, SpeedModel] = {}
        """Node -> its speed model (profiled, then measured every segment)."""
        self.seed = seed
        self.max_devices = max_devices
        self.front = front
        self.bounds = tuple(bounds) if bounds is not None else None
        self.bands = bands
        self.norm = norm
        self.link_mbps = link_mbps
        self.latency_s = latency_s
        self.memory_budget_mb = memory_budget_mb
        self.emulate_link = emulate_link
        self.subnet_prefix = subnet_prefix
        self.profile_size = profile_size
        self.eval_samples = eval_samples
        self.job = f"tiles-{int(time.time() * 1000) % 10**9}"
        """Global steps done (the next segment starts here)."""
        self.boards: list[Board] = []
        self.segment: SegmentPlan | None = None
        self.round_timeout = 3600.0
        """Seconds a round may take (``start``'s ``timeout``)."""
        self._geometry: Any = None
        self._state_shapes: dict[str, tuple[int, ...]] = {}

    # ------------------------------------------------------------------ info
    def reference_job(self) -> ReferenceJob:
        """This job as one device would train it: pass it to
        :func:`flowerbed.parallel.reference.single_device` to check a run. With
        ``norm="frozen"`` the front's batch norms run in eval mode, so the job
        must have planned a segment (its front) first."""
        front = 0
        if self.norm == "frozen":
            if self.segment is None:
                raise ValueError(
                    "norm='frozen': the reference needs the planned front; call "
                    "reference_job() after start()"
                )
            front = self.segment.tile_plan.front
        return ReferenceJob(
            model=self.model,
            model_args=self.model_args,
            dataset=self.dataset or "synthetic",
            batch_size=self.batch_size,
            seed=self.seed,
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
            self.max_devices,
            self.link_mbps,
        )
        log(INFO, "\t└── %s", self.training.describe("SGD"))

    # ------------------------------------------------------------------ model
    def geometry(self) -> Any:
        """The planner's view of the model (built once, on the server)."""
        if self._geometry is None:
            from flowerbed.parallel.tiles.region_ops import front_geometry
            from flowerbed.parallel.user_code import build_layers

            model = build_layers(self.model, self.model_args, seed=self.seed)
            self._geometry = front_geometry(model, self.input_shape, self.norm)
            self._state_shapes = {
                k: tuple(v.shape) for k, v in model.state_dict().items()
            }
        return self._geometry

    def check_arrays(self, arrays: Mapping[str, np.ndarray], what: str) -> None:
        """Raise ValueError unless ``arrays`` is the model's state (names, shapes)."""
        self.geometry()
        wanted = self._state_shapes
        missing = sorted(set(wanted) - set(arrays))
        extra = sorted(set(arrays) - set(wanted))
        if missing or extra:
            raise ValueError(
                f"{what} do not match model {self.model!r}: missing {missing[:4]}, "
                f"unexpected {extra[:4]} (build initial_arrays from "
                "flowerbed.parallel.user_code.build_layers(model, model_args)"
                ".state_dict())"
            )
        for name, shape in wanted.items():
            if tuple(np.shape(arrays[name])) != shape:
                raise ValueError(
                    f"{what}: {name!r} has shape {list(np.shape(arrays[name]))}, "
                    f"the model's is {list(shape)}"
                )

    # ------------------------------------------------------------------ boards
    def profile_query(self) -> dict[str, Any]:
        return {
            "mode": MODE,
            "model": self.model,
            "model_args": self.model_args,
            "input-shape": list(self.input_shape),
            "profile-size": self.profile_size,
        }

    def select_boards(self, grid: Grid, timeout: float) -> list[Board]:
        """Discover, profile and pick co-located boards (module docstring)."""
        nodes = self.discover(grid, 10**6, timeout)
        members, errors = self.profile_members(
            grid, nodes, self.profile_query(), timeout
        )
        budget = self.memory_budget_mb * 2**20 if self.memory_budget_mb else math.inf
        boards: dict[int, Board] = {}
        for node_id, member in members.items():
            speed = member.metrics.get(keys.TILES_SPEED)
            free = member.metrics.get(keys.TILES_MEMORY_BYTES)
            if not isinstance(speed, int | float) or not speed > 0:
                errors[node_id] = f"profile reply has no positive {keys.TILES_SPEED}"
                continue
            memory = MEMORY_HEADROOM * float(free) if free else math.inf
            model = self.speed_models.get(node_id)
            if model is None:  # a board measured before keeps its measurements
                model = SpeedModel(float(speed), smoothing=self.speed_smoothing)
                self.speed_models[node_id] = model
            boards[node_id] = Board(
                node_id, member.address, model.rate, min(memory, budget), member.label
            )
        group = colocated(
            (members[n] for n in boards), self.subnet_prefix, lambda m: 1.0
        )
        chosen = sorted(
            (boards[m.node_id] for m in group), key=lambda b: (-b.speed, b.node_id)
        )
        count = max(self.min_train_nodes, int(self.fraction_train * len(chosen)))
        chosen = chosen[: min(count, self.max_devices)]
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
            subnet_of(chosen[0].address, self.subnet_prefix),
            f" ({left_out} elsewhere or beyond max_devices)" if left_out else "",
        )
        return chosen

    @staticmethod
    def rank_order(boards: Sequence[Board]) -> list[Board]:
        """Rank 0 holds the head: the most memory, then the fastest."""
        head = max(boards, key=lambda b: (b.memory, b.speed, -b.node_id))
        rest = sorted((b for b in boards if b is not head), key=lambda b: b.node_id)
        return [head, *rest]

    def cluster(self, boards: Sequence[Board]) -> Cluster:
        return Cluster(
            speeds=tuple(b.speed for b in boards),
            memory=tuple(b.memory for b in boards),
            link_bytes_per_s=self.link_mbps * 1e6 / 8,
            latency_s=self.latency_s,
            bands=self.bands,
        )

    def plan_segment(self, boards: Sequence[Board]) -> SegmentPlan:
        """Plan tiles and groups for ``boards`` (PlanError/TileError if none fits)."""
        ordered = self.rank_order(boards)
        tile_plan = plan_tiles(
            self.geometry(),
            self.cluster(ordered),
            self.batch_size,
            front=self.front,
            bounds=self.bounds,
        )
        return SegmentPlan(tile_plan, ordered)

    def tile_areas(self, segment: SegmentPlan) -> list[int]:
        """Pixels of each rank's tile of the first tiled group's output (the
        largest map), in rank order."""
        tp = segment.tile_plan
        lay = layout(self.geometry(), tp.bounds, tp.weights, tp.bands)
        return [int(tile.area) for tile in lay.tiles[0]]

    def member_plans(self, segment: SegmentPlan) -> dict[int, MemberPlan]:
        from flowerbed.parallel.tiles.exact_step import TileSettings

        number, port = self.next_segment()
        tp = segment.tile_plan
        settings = TileSettings(
            input_shape=(
                self.input_shape[0],
                self.input_shape[1],
                self.input_shape[2],
            ),
            bounds=tp.bounds,
            weights=tp.weights,
            bands=tp.bands,
            norm=self.norm,
            emulate_link=self.emulate_link,
            link_bytes_per_s=self.link_mbps * 1e6 / 8,
            latency_s=self.latency_s,
            num_classes=self.num_classes,
        )
        lay = layout(self.geometry(), tp.bounds, tp.weights, tp.bands)
        host = segment.boards[0].address
        plans = {}
        for rank, board in enumerate(segment.boards):
            plans[board.node_id] = MemberPlan(
                mode=MODE,
                job=self.job,
                segment=number,
                rank=rank,
                world_size=len(segment.boards),
                host=host,
                port=port,
                start_step=self.step,
                steps=self.steps_per_round,
                batch_size=self.batch_size,
                seed=self.seed,
                join_timeout_s=self.join_timeout_s,
                timeout_s=self.timeout_s,
                model=self.model,
                model_args=self.model_args,
                dataset=self.dataset,
                lr=self.lr,
                momentum=self.momentum,
                weight_decay=self.weight_decay,
                tile=lay.tiles[-1][rank].as_tuple(),
                options={**settings.options(), **self.training.to_options()},
            )
        return plans

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
        front = [n for n in state if int(n.split(".", 1)[0]) < tp.front]
        payload: dict[int, dict[str, np.ndarray]] = {}
        momentum: dict[int, dict[str, np.ndarray]] = {}
        for node_id, plan in self.segment.plans.items():
            names = list(state) if plan.rank == 0 else front
            payload[node_id] = {n: state[n] for n in names}
            momentum[node_id] = {
                n: self.central_optimizer[n]
                for n in names
                if n in self.central_optimizer
            }
        return self.segment_messages(
            self.segment.plans, payload, momentum, config, ttl=self.round_timeout
        )

    def check_reply(self, reply: SegmentReply) -> None:
        """Reject a member reply that cannot be used (raises ReplyRejected)."""
        assert self.segment is not None
        plan = self.segment.plans.get(reply.node_id)
        if plan is None:
            raise ReplyRejected(f"node {reply.node_id} is not a member of the segment")
        if not reply.ok:
            return
        for key in (keys.TILES_COMPUTE_S, keys.TILES_MACS):
            value = reply.metrics.get(key)
            if not isinstance(value, int | float) or value < 0:
                raise ReplyRejected(f"metric {key!r} missing or negative: {value!r}")
        if plan.rank != 0:
            return
        if keys.TRAIN_LOSS not in reply.metrics:
            raise ReplyRejected(f"rank 0's reply has no {keys.TRAIN_LOSS!r}")
        try:
            self.check_arrays(reply.arrays, "rank 0's reply arrays")
        except ValueError as err:
            raise ReplyRejected(str(err)) from None
        from flowerbed.parallel.member import OPTIMIZER_SEP  # torch: not at import

        for name, value in reply.optimizer.items():
            param, _, key = name.partition(OPTIMIZER_SEP)
            shape = self._state_shapes.get(param)
            # a moment buffer has its parameter's shape; a step count none
            if (
                shape is None
                or tuple(np.shape(value)) not in (shape, ())
                or (not key and tuple(np.shape(value)) != shape)
            ):
                raise ReplyRejected(
                    f"optimiser state {name!r} does not match the model"
                )

    def aggregate_segment(
        self, server_round: int, outcome: SegmentOutcome
    ) -> tuple[ArrayRecord | None, MetricRecord]:
        """The new weights (rank 0's) and the round's metrics; on a failed segment
        no weights, and the failed boards leave the job."""
        assert self.segment is not None
        seg = self.segment
        replies = outcome.replies
        metrics: dict[str, int | float | list[int] | list[float]] = {
            SEGMENT_OK: int(outcome.complete),
            DEVICES: len(seg.boards),
            FRONT: seg.tile_plan.front,
            GROUPS: len(seg.tile_plan.bounds) - 1,
            PREDICTED_STEP_S: seg.tile_plan.cost.total_s,
            TILE_AREAS: self.tile_areas(seg),
            keys.NUM_EXAMPLES: 0,
        }
        for key in (
            keys.SPAN_STEP_S,
            keys.TILES_COMPUTE_S,
            keys.TILES_LINK_S,
            keys.TILES_ACTIVATION_BYTES,
            keys.TILES_PEAK_RSS_BYTES,
        ):
            values = [
                float(r.metrics[key]) for r in replies.values() if key in r.metrics
            ]
            if values:
                metrics[key] = max(values)
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
        by_node = {b.node_id: b for b in self.boards}
        for node_id, reply in replies.items():
            macs = float(reply.metrics.get(keys.TILES_MACS, 0.0))
            seconds = float(reply.metrics.get(keys.TILES_COMPUTE_S, 0.0))
            model = self.speed_models.get(node_id)
            if macs > 0 and seconds > 0 and node_id in by_node and model is not None:
                model.observe(macs, seconds)
                by_node[node_id].speed = model.rate
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
        record = ConfigRecord(dict(config))
        record[keys.SPAN_QUERY] = json.dumps(query)
        head = self.rank_order(self.boards)[0].node_id
        return [
            Message(
                RecordDict(
                    {self.configrecord_key: record, self.arrayrecord_key: arrays}
                ),
                dst_node_id=head,
                message_type=MessageType.EVALUATE,
                ttl=ttl,
            )
        ]

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
