"""RuntimeWeightedFedAvg: FedAvg weighted by each node's measured runtime."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from logging import INFO, WARNING
from pathlib import Path
from typing import Any, ClassVar, Self

from flowerbed import keys
from flowerbed.replies import (
    ReplyRejected,
    check_evaluate_reply,
)
from flowerbed.strategies.accumulation import (
    MetricsAccumulator,
    to_arrayrecord,
)
from flowerbed.strategies.inflight import Ticket
from flowerbed.strategies.sampling import Quarantine
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
)
from flwr.serverapp import Grid
from flwr.supercore import log

from .dispatch import (
    base_steps,
    log_sampled,
    node_messages,
    sample_free,
    sample_size,
    steps_to_send,
)
from .influence_bound import InfluenceBound
from .learnt_state import LearntState
from .options import (
    Robustness,
    WorkBalance,
    adopt_declared,
    declared_signature,
    group_settings,
)
from .rejections import RejectionLog, log_received
from .reply_weights import ReplyWeights, balanced_steps, smooth
from .robust import (
    Reference,
)
from .rounds import MIN_MESSAGE_TTL_S, RoundLoop
from .train_fold import FOLD_GROUP as FOLD_GROUP  # re-exported: imported from here
from .train_fold import ReplyFolder, TrainFold


class RuntimeWeightedFedAvg(RoundLoop):
    """FedAvg with runtime-aware weights, work balancing and robust rounds.

    Each accepted reply ``i`` gets an unnormalised weight ``w_i`` and the new global
    model is ``x + m * sum_i w_i c_i (x_i - x) / sum_i w_i`` (streamed: replies are
    folded in as they arrive, never held together). With ``t_i`` the node's
    runtime (``train-time-s``, or the measured reply round trip when the node does
    not report it), ``n_i`` its ``num-examples`` and ``tau_i`` its ``num-steps``:

    - ``"runtime"`` (Hemed, Lavie, Kaplan, ICSEE 2018, S0: "factors in the
      contribution from each node according to its run time on a specific training
      task, relative to the other nodes"): ``w_i = (1/t_i) / sum_j (1/t_j)``, so a
      node twice as fast on the same task counts twice as much; ``c_i = m = 1``.
    - ``"throughput"``: ``w_i = n_i / t_i`` samples per second (``samples-per-s``
      when reported), so nodes count by how much data they got through per second.
    - ``"fednova"`` (Wang et al., "Tackling the Objective Inconsistency Problem in
      Heterogeneous Federated Optimization", NeurIPS 2020, Eq. 6 with plain SGD):
      ``w_i = n_i``, ``c_i = 1/tau_i``, ``m = tau_eff = sum_i p_i tau_i`` with
      ``p_i = n_i / sum_j n_j``: each update is normalised by its local steps, which
      removes the bias of unequal local work.
    - ``"examples"``: ``w_i = n_i``, Flower's FedAvg (McMahan et al., 2017).

    Work balancing (``balance_work=True``) assigns node ``i`` the ``local-steps``
    ``L * s_i / mean_j(s_j)`` (clamped), where ``s_i`` is its speed in steps per
    second, exponentially smoothed over rounds: ``s <- a s_new + (1 - a) s``.
    Nodes without an estimate are probed with ``L`` steps. Then every known node
    needs about ``L / mean(s)`` seconds, so they finish together.

    Bad replies (errors, NaN/Inf, missing or extra arrays, wrong shapes or dtypes,
    missing, negative or invalid weights) are rejected and logged with the node id
    and reason; the round goes on. A node with ``quarantine_after`` consecutive
    rejected replies sits out ``quarantine_rounds`` rounds.

    Parameters
    ----------
    *args, **kwargs
        Flower ``FedAvg``'s arguments (``fraction_train``, …,
        ``evaluate_metrics_aggr_fn``), by position or name, with Flower's
        defaults; ``weighted_by_key`` is ``n_i``.
    work : WorkBalance, optional (default: WorkBalance())
        Weighting (default ``"fednova"``) and work balancing
        (:class:`~flowerbed.strategies.options.WorkBalance` lists its fields).
    robustness : Robustness, optional (default: Robustness())
        Reply ceiling, bounded influence (weight cap 2, clip factor 3), robust
        aggregation and quarantine
        (:class:`~flowerbed.strategies.options.Robustness`).
    message_ttl_s : float, optional (default: None)
        Time-to-live of each message; None means ``start``'s ``timeout``.
    checkpoint_path : str or Path, optional (default: None)
        Where to write the global arrays and strategy state after every round;
        an existing checkpoint there is resumed.
    seed : int (default: 0)
        Seeds node sampling (per round, so resumed runs sample the same nodes).
    **flat
        The option objects' fields by name (``weight_cap=3.0``), as in earlier
        versions: deprecated, with a warning naming the object to use
        (:func:`~.options.adopt_declared`).
    """

    # The option objects' fields, read as attributes (copied by copy_fields)
    weighting: str
    balance_work: bool
    local_steps: int | None
    speed_smoothing: float
    min_local_steps: int
    max_local_steps: int | None
    max_num_examples: float
    weight_cap: float | None
    clip_factor: float | None
    aggregation: str
    trim_fraction: float
    quarantine_after: int
    quarantine_rounds: int
    pull_bound: bool

    OPTION_DEFAULTS: ClassVar[Mapping[str, Any]] = {
        "work": WorkBalance(),
        "robustness": Robustness(),
    }
    """Each option argument of this class's constructor and its default
    (:func:`~.options.adopt_declared` adopts them; a subclass may list another
    default)."""
    work: WorkBalance
    """The work balance this strategy runs with."""
    robustness: Robustness
    """The robustness settings this strategy runs with."""
    recent_weights: Reference
    """Weights of recent accepted replies (the weight cap's reference)."""
    recent_norms: Reference
    """Norms of recent accepted updates (the clipping's reference)."""
    speeds: dict[int, float]
    """Smoothed speed of each node, in optimiser steps per second."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # help() and inspect.signature show FedAvg's arguments and the options
        # (None for a subclass whose constructor names its own arguments).
        cls.__signature__ = declared_signature(cls)  # type: ignore[attr-defined]

    def __init__(
        self,
        *args: Any,
        message_ttl_s: float | None = None,
        checkpoint_path: str | Path | None = None,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        adopt_declared(self, kwargs)
        super().__init__(*args, **kwargs)
        if message_ttl_s is not None and message_ttl_s <= 0:
            raise ValueError(f"message_ttl_s must be > 0, got {message_ttl_s}")
        self.message_ttl_s = message_ttl_s
        self.seed = seed
        self.recent_weights = Reference()
        self.recent_norms = Reference()
        self.reply_weights = ReplyWeights(self.weighting, self.weight_cap)
        """The weighting's formulas and what they remember."""
        self.rejections = RejectionLog(self.weighted_by_key)
        """The log lines of refused and bounded replies."""
        self.folder = ReplyFolder(self)
        """How ``aggregate_train`` stages, folds and settles train replies."""
        self.quarantine = Quarantine(self.quarantine_after, self.quarantine_rounds)
        self.speeds: dict[int, float] = {}
        self.influence_bound = InfluenceBound(self.robustness)
        """The sums' bounds, and the memory they are made in."""
        self._init_loop(checkpoint_path)

    @classmethod
    def from_settings(cls, *args: Any, **settings: Any) -> Self:
        """Build the strategy from settings by their field names, grouped here.

        ``DeadlineFedAvg.from_settings(fraction_train=0.5, deadline_s=30.0,
        weight_cap=3.0)`` equals ``DeadlineFedAvg(fraction_train=0.5,
        deadlines=Deadlines(deadline_s=30.0), robustness=Robustness(weight_cap=3.0))``:
        for run configs and harnesses that hold settings by name. Each name goes
        to the option object that has a field of that name (starting from the
        strategy's default object); FedAvg's arguments and the strategy's own
        keywords pass through.
        """
        return cls(*args, **group_settings(cls, settings))

    # ------------------------------------------------------------------ summary
    def summary(self) -> None:
        """Log the configuration: this strategy's branch, then FedAvg's."""
        log(INFO, "\t├──> Runtime weighting:")
        for line in self.work.summary_lines() + self.robustness.summary_lines():
            log(INFO, line)
        log(INFO, "\t│\t└── Checkpoint: %s", self.checkpoint_path or "(none)")
        super().summary()

    # ----------------------------------------------------------------- messages
    def assign_steps(self, node_ids: list[int], base: int) -> dict[int, int]:
        """Work balancing: ``L * s_i / mean(s)`` steps for known nodes, ``L`` else
        (:func:`~.reply_weights.balanced_steps`)."""
        return balanced_steps(
            self.speeds, node_ids, base, self.min_local_steps, self.max_local_steps
        )

    def _message_ttl(self) -> float:
        ttl = self.message_ttl_s if self.message_ttl_s is not None else self._timeout
        return max(ttl, MIN_MESSAGE_TTL_S)

    def _node_config(self, node_id: int, config: ConfigRecord) -> ConfigRecord:
        """Extra per-node config (subclasses add ``deadline-s``)."""
        return config

    def _messages(
        self,
        node_ids: list[int],
        arrays: ArrayRecord,
        config: ConfigRecord,
        message_type: str,
        server_round: int,
        steps: dict[int, int] | None = None,
    ) -> list[Message]:
        """One message per node (:func:`~.dispatch.node_messages`)."""
        content = (self.arrayrecord_key, arrays, self.configrecord_key, config)
        return node_messages(
            node_ids,
            content,
            message_type,
            server_round,
            steps,
            self._node_config,
            self._message_ttl,
        )

    def _sample(
        self, grid: Grid, server_round: int, count: int, purpose: str
    ) -> list[int]:
        """Nodes neither quarantined nor (for training) busy
        (:func:`~.dispatch.sample_free`)."""
        inflight = self._inflight
        return sample_free(
            grid,
            server_round,
            count,
            quarantine=self.quarantine,
            busy=inflight.busy_nodes(MessageType.TRAIN)
            if inflight is not None and purpose == "train"
            else set(),
            seed=self.seed,
            draw=self._draw_name(purpose),
            min_available=self.min_available_nodes,
            timeout=self._timeout,
        )

    def _draw_name(self, purpose: str) -> str:
        """What seeds a sampling's draw with the seed and the round."""
        return purpose

    def _sample_size(self, grid: Grid, fraction: float, minimum: int) -> int:
        """FedAvg's sample size (:func:`~.dispatch.sample_size`)."""
        return sample_size(grid, fraction, minimum)

    def _sampling_log_level(self) -> int:
        return INFO

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample nodes (skipping quarantined and busy ones); build train messages.

        As Flower's FedAvg: nothing when ``fraction_train`` is 0, and
        ``server-round`` is written into ``config``. ``arrays`` becomes the model
        ``aggregate_train`` checks replies against.
        """
        self._say_if_driven_elsewhere()
        if self.fraction_train == 0.0:
            return []
        config[keys.SERVER_ROUND] = server_round
        count = self._sample_size(grid, self.fraction_train, self.min_train_nodes)
        return self._train_messages(server_round, arrays, config, grid, count)

    def _train_messages(
        self,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        grid: Grid,
        count: int,
    ) -> list[Message]:
        node_ids = self._sample(grid, server_round, count, "train")
        log_sampled("configure_train", node_ids, grid, self._sampling_log_level())
        self._set_global(arrays)
        base = base_steps(self.local_steps, config)
        steps = steps_to_send(node_ids, base, self.balance_work, self.assign_steps)
        return self._messages(
            node_ids, arrays, config, MessageType.TRAIN, server_round, steps
        )

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample nodes (skipping quarantined ones) and build evaluate messages."""
        count = self._sample_size(grid, self.fraction_evaluate, self.min_evaluate_nodes)
        if count == 0:
            return []
        config[keys.SERVER_ROUND] = server_round
        node_ids = self._sample(grid, server_round, count, "evaluate")
        log_sampled("configure_evaluate", node_ids, grid, INFO)
        return self._messages(
            node_ids, arrays, config, MessageType.EVALUATE, server_round
        )

    # ------------------------------------------------------------------ replies
    def reply_weight(
        self,
        metrics: MetricRecord,
        num_examples: float,
        ticket: Ticket | None = None,
        arrived: float | None = None,
    ) -> tuple[float, float, float]:
        """Return ``(w_i, c_i, tau_i)`` of one reply under ``self.weighting``
        (:meth:`~.reply_weights.ReplyWeights.weigh`).

        Raises
        ------
        ReplyRejected
            When the metrics the weighting needs are zero or unavailable.
        """
        return self.reply_weights.weigh(metrics, num_examples, ticket, arrived)

    def _update_speed(
        self,
        node_id: int,
        metrics: MetricRecord,
        ticket: Ticket | None,
        arrived: float | None,
    ) -> None:
        """Smooth the reply's steps per second into ``speeds[node_id]``."""
        speed = self.reply_weights.speed(metrics, ticket, arrived)
        if speed is not None:
            smooth(self.speeds, node_id, speed, self.speed_smoothing)

    def fold_train_reply(
        self, reply: Message, server_round: int, fold: TrainFold
    ) -> bool:
        """Validate one train reply and fold it into ``fold``; False if rejected.

        A reply the round loop handed over comes with its :class:`Arrival`: the
        model it trained from, when it arrived, its staleness discount. Any other
        reply counts as fresh work on the last global model, or, when there is
        none (a direct call, as in Flower's tests), is checked against the first
        accepted reply and averaged as it is. A rejected reply is logged with its
        node id and reason, and counted towards quarantine when it is the node's
        fault.

        ``aggregate_train`` folds replies :data:`FOLD_GROUP` at a time through
        the same steps (:class:`~.train_fold.ReplyFolder`); a subclass that
        overrides this method has it called for every reply instead.
        """
        staged = self.folder.stage(reply, server_round, fold)
        if staged is None:
            return False
        return self.folder.fold([staged], server_round, fold)[0]

    def _server_step_size(self) -> float:
        """Server learning rate applied to the averaged update (FedBuff's eta_g)."""
        return 1.0

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate and fold replies one at a time; (None, None) if none is usable.

        Stateless enough to be called on its own, as Flower's tests call FedAvg's:
        replies are checked against the last global model when there is one
        (the arrays of the last ``configure_train`` or round), otherwise against
        each other, and then their arrays are averaged with FedAvg's weights
        (FedNova's step normalisation and a server learning rate need the model
        the nodes started from).
        """
        # Without a global model the replies are whole models, not updates: no
        # update norm to clip (the weight cap still applies).
        fold = TrainFold(
            MetricsAccumulator(self.weighted_by_key),
            self.influence_bound.new_sum(
                self.recent_weights, self.recent_norms, clip=bool(self._global_np)
            ),
        )
        if type(self).fold_train_reply is RuntimeWeightedFedAvg.fold_train_reply:
            self.folder.fold_all(replies, server_round, fold)
        else:  # a subclass's own fold_train_reply: one reply at a time
            for reply in replies:
                self.fold_train_reply(reply, server_round, fold)
        log_received("aggregate_train", fold.results, fold.failures)
        if fold.updates.count == 0:
            if fold.results or fold.failures:
                log(WARNING, "round %d: no usable train replies", server_round)
            return None, None
        self.influence_bound.say_bounded(server_round, fold.updates)
        new = fold.model(
            self._global_np,
            fednova=self.weighting == "fednova",
            step_size=self._server_step_size(),
            warn=self.reply_weights.fallback_once,
        )
        self.influence_bound.cap_metrics(fold.metrics, self.recent_weights)
        record = to_arrayrecord(new)  # a copy: ``new`` is free from here on
        base = fold.base(self._global_np)
        self.influence_bound.memory.keep(new, base, fold.updates)
        return record, fold.metrics.result(self.train_metrics_aggr_fn)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        """Aggregate evaluation metrics, rejecting bad replies (logged)."""
        metrics_acc = MetricsAccumulator(self.weighted_by_key)
        results = failures = 0
        for reply in replies:
            failures += reply.has_error()
            results += not reply.has_error()
            self.fold_evaluate_reply(reply, server_round, metrics_acc)
        log_received("aggregate_evaluate", results, failures)
        self.influence_bound.cap_evaluation(server_round, metrics_acc)
        return metrics_acc.result(self.evaluate_metrics_aggr_fn)

    def fold_evaluate_reply(
        self, reply: Message, server_round: int, metrics_acc: MetricsAccumulator
    ) -> bool:
        """Validate one evaluate reply and keep its metrics; False if rejected."""
        try:
            metrics = check_evaluate_reply(
                reply, self.weighted_by_key, max_weight=self.max_num_examples
            )
        except ReplyRejected as rejection:
            self.rejections.evaluate(reply, server_round, rejection)
            return False
        metrics_acc.add(metrics, float(metrics[self.weighted_by_key]))  # type: ignore[arg-type]
        return True

    # ---------------------------------------------------------------- checkpoint
    def state(self) -> dict[str, Any]:
        """JSON-able strategy state (what a checkpoint holds besides arrays:
        :class:`~.learnt_state.LearntState`)."""
        learnt = LearntState(
            self.speeds,
            self.quarantine,
            self.recent_weights,
            self.recent_norms,
            self.reply_weights.recent_steps,
        )
        return learnt.state()

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state` returned; a field out of range raises one
        CheckpointError naming it, and nothing is loaded
        (:meth:`~.learnt_state.LearntState.read`)."""
        saved = LearntState.read(state, self.quarantine, self.max_num_examples)
        self.speeds = saved.speeds
        self.quarantine.failures = saved.quarantine.failures
        self.quarantine.until = saved.quarantine.until
        self.recent_weights, self.recent_norms = saved.weights, saved.norms
        self.reply_weights.recent_steps = saved.steps


RuntimeWeightedFedAvg.__signature__ = declared_signature(  # type: ignore[attr-defined]
    RuntimeWeightedFedAvg
)
