"""LargeBatchRounds: the large-batch recipe as Flower rounds, for phones and any client.

Phones cannot run torch.distributed, so the all-reduce becomes a server round
(S1's recipe through the phone gateway, the board ClientApp or any Flower
client that honours ``batch-size``, ``local-steps`` and ``lr``):

1. every sampled node gets its share ``B_i`` of one large batch ``B``,
   proportional to its measured speed (samples per second, smoothed;
   :func:`flowerbed.parallel.large_batch.recipe.batch_shares`), and trains ``k``
   (``local_steps``, default 1) plain SGD steps at ``client_lr`` on it;
2. the server averages the replies by examples and reads the result as a
   pseudo-gradient (Reddi et al., "Adaptive Federated Optimization", ICLR 2021,
   Algorithm 1, the ``Delta_t`` that FedOpt hands to a server optimiser):

       g = (x - sum_i n_i x_i / sum_i n_i) / (client_lr * k)

   With ``k = 1``, ``x_i = x - client_lr g_i`` and ``n_i = B_i``, so ``g`` is
   exactly the gradient of the whole batch ``sum_i (B_i / B) g_i``
   (:mod:`flowerbed.parallel.large_batch.recipe`); with ``k > 1`` it is the
   examples-weighted mean of each node's average step;
3. the server applies momentum SGD, LARS or LAMB
   (:mod:`flowerbed.parallel.large_batch.optimizers`) at the rate of Goyal et
   al.'s linear scaling with warm-up
   (:class:`flowerbed.parallel.large_batch.recipe.LrSchedule`), one server step
   per round.

It is a :class:`DeadlineFedAvg`, so one slow phone does not stall the cluster:
over-selection closes the round at the first ``K`` usable replies (their
shares then cover about ``B K / ceil(over_selection K)`` samples: an unbiased
smaller batch, the rate stays the schedule's), and a deadline closes it at
``deadline_s``; a node that misses the deadline is given a share it can finish
next time (its rate bounded by the share it did not finish in the time it had).
Late updates are off by default (a late reply is a stale gradient), and so is
partial work (the pseudo-gradient divides by the ``k`` steps asked for).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from logging import INFO
from typing import Any, ClassVar

import numpy as np
from flowerbed import keys
from flowerbed.parallel.large_batch.optimizers import (
    STEP_KEY,
    LargeBatchOptimizer,
)
from flowerbed.parallel.large_batch.recipe import LrSchedule, batch_shares
from flowerbed.strategies.accumulation import to_arrayrecord, to_numpy
from flowerbed.strategies.checkpoints import (
    FINITE,
    NON_NEGATIVE,
    StateReader,
    samples_per_second,
)
from flowerbed.strategies.inflight import Ticket
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
)
from flwr.serverapp.exception import AggregationError
from flwr.supercore import log

from .deadline import DeadlineFedAvg
from .large_batch_options import ServerOptimiser
from .options import Deadlines, WorkBalance
from .reply_weights import smooth

ROUND_SERVER_LR = "server-lr"
ROUND_BATCH = "large-batch"
DEFAULT_SPEED = 1.0
"""Samples per second assumed for a node never measured (before the mean of the
known ones exists)."""


@dataclass(frozen=True)
class LargeBatchRecipe(ServerOptimiser):
    """The large-batch recipe of :class:`LargeBatchRounds` (Goyal et al., 2017;
    You et al., LARS 2017 and LAMB 2020).

    Parameters
    ----------
    batch_size : int (default: 256)
        ``B``, the large batch shared among a round's sampled nodes.
    client_lr : float (default: 1.0)
        Each node's SGD rate (with ``k = 1`` any rate gives the same ``g``).
    optimizer, base_lr, base_batch, warmup_steps, decay_steps, momentum, \
weight_decay, trust
        The server optimiser and its schedule over server steps, keyword-only
        (:class:`~flowerbed.strategies.large_batch_options.ServerOptimiser`).
    """

    batch_size: int = 256
    client_lr: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (math.isfinite(self.client_lr) and self.client_lr > 0):
            raise ValueError(f"client_lr must be > 0, got {self.client_lr}")

    def schedule(self, batch_size: int | None = None) -> LrSchedule:
        """Goyal et al.'s rate over server steps, for this recipe's batch unless
        ``batch_size`` is given."""
        return super().schedule(self.batch_size if batch_size is None else batch_size)

    def server_optimizer(self) -> LargeBatchOptimizer:
        """A fresh server optimiser with these settings."""
        return LargeBatchOptimizer(
            self.optimizer,
            momentum=self.momentum,
            weight_decay=self.weight_decay,
            trust=self.trust,
        )


class LargeBatchRounds(DeadlineFedAvg):
    """Large-batch synchronous training as server rounds (module docstring).

    Parameters
    ----------
    (FedAvg's and DeadlineFedAvg's parameters, same defaults, except
    ``late_updates`` False, ``min_completion`` None, and ``work``'s
    ``weighting`` fixed to ``"examples"`` with ``local_steps`` 1: ``k``, the SGD
    steps each node takes on its share, 1 being one gradient), and:
    recipe : LargeBatchRecipe, optional (default: LargeBatchRecipe())
        The batch, the server optimiser and its schedule.
    """

    OPTION_DEFAULTS: ClassVar[Mapping[str, Any]] = {
        "deadlines": Deadlines(late_updates=False, min_completion=None),
        "work": WorkBalance(weighting="examples", local_steps=1),
        "recipe": LargeBatchRecipe(),
    }
    recipe: LargeBatchRecipe
    """The recipe this strategy runs with."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.weighting != "examples":
            raise ValueError(
                "LargeBatchRounds sums gradients weighted by examples: give "
                f"work=WorkBalance(weighting='examples'), not {self.weighting!r}"
            )
        self.schedule = self.recipe.schedule()
        self.batch_size = self.recipe.batch_size
        self.client_lr = float(self.recipe.client_lr)
        self.server_optimizer = self.recipe.server_optimizer()
        self.sample_rates: dict[int, float] = {}
        """Smoothed samples per second of each node (its batch share's basis)."""
        self._overhead: dict[int, float] = {}
        """Seconds of each node's last answer spent outside training."""
        self.shares: dict[int, int] = {}
        self.server_steps = 0
        self._last_lr = 0.0

    def summary(self) -> None:
        super().summary()
        log(
            INFO,
            "\t\t└── LargeBatchRounds: batch %d, %d local step(s) at %.3g, server %s "
            "lr %.4g -> %.4g over %d warm-up rounds",
            self.batch_size,
            self.local_steps or 1,
            self.client_lr,
            self.server_optimizer.kind,
            self.schedule.base_lr,
            self.schedule.peak_lr,
            self.schedule.warmup_steps,
        )

    # ------------------------------------------------------------ shares
    def share_batch(self, node_ids: list[int]) -> dict[int, int]:
        """``B_i`` of each node, proportional to its smoothed samples per second
        (nodes never measured count as the mean of the measured ones)."""
        known = [self.sample_rates[n] for n in node_ids if n in self.sample_rates]
        fallback = sum(known) / len(known) if known else DEFAULT_SPEED
        speeds = [self.sample_rates.get(n, fallback) for n in node_ids]
        minimum = 1 if self.batch_size >= len(node_ids) else 0
        return dict(
            zip(node_ids, batch_shares(self.batch_size, speeds, minimum), strict=True)
        )

    def _messages(
        self,
        node_ids: list[int],
        arrays: ArrayRecord,
        config: ConfigRecord,
        message_type: str,
        server_round: int,
        steps: dict[int, int] | None = None,
    ) -> list[Message]:
        if message_type == MessageType.TRAIN:
            self.shares = self.share_batch(node_ids)
            node_ids = [n for n in node_ids if self.shares[n] > 0]
        return super()._messages(
            node_ids, arrays, config, message_type, server_round, steps
        )

    def _node_config(self, node_id: int, config: ConfigRecord) -> ConfigRecord:
        config = super()._node_config(node_id, config)
        config[keys.BATCH_SIZE] = self.shares[node_id]
        config[keys.LEARNING_RATE] = self.client_lr
        return config

    def _update_speed(
        self,
        node_id: int,
        metrics: MetricRecord,
        ticket: Ticket | None,
        arrived: float | None,
    ) -> None:
        super()._update_speed(node_id, metrics, ticket, arrived)
        examples = metrics.get(keys.NUM_EXAMPLES)
        seconds = metrics.get(keys.TRAIN_TIME_S)
        if not isinstance(examples, int | float) or not isinstance(
            seconds, int | float
        ):
            return
        if examples <= 0 or seconds <= 0:
            return
        rate = float(examples) / float(seconds)
        smooth(self.sample_rates, node_id, rate, self.speed_smoothing)
        if ticket is not None and arrived is not None:
            self._overhead[node_id] = max(0.0, arrived - ticket.sent_at - seconds)

    def _close_train(
        self,
        server_round: int,
        arrays: ArrayRecord | None,
        metrics: MetricRecord | None,
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        self._bound_stragglers(server_round)
        return super()._close_train(server_round, arrays, metrics)

    def _bound_stragglers(self, server_round: int) -> None:
        """Censored speeds after a deadline: a node that has not answered its
        share ``B_i`` after ``w`` seconds (its last answer spent ``o_i`` of its
        round trip outside training, on transfers; 0 if it never answered)
        trains fewer than ``B_i / (w - o_i)`` samples per second. Its rate
        becomes at most that, and the next round gives it a share it can finish.
        Without this a phone that misses every deadline is never measured and
        keeps a share it cannot finish (its samples lost each round).
        """
        if self._inflight is None or self._deadline is None:
            return  # over-selection alone cuts nodes for being late, not too slow
        now = self._clock.now()
        for ticket in self._inflight.tickets.values():
            if ticket.server_round != server_round or ticket.kind != MessageType.TRAIN:
                continue
            share = self.shares.get(ticket.node_id, 0)
            training = now - ticket.sent_at - self._overhead.get(ticket.node_id, 0.0)
            if share <= 0 or training <= 0:
                continue
            bound = share / training
            old = self.sample_rates.get(ticket.node_id)
            self.sample_rates[ticket.node_id] = (
                bound if old is None else min(old, bound)
            )

    # ------------------------------------------------------------ server step
    def server_step(self, averaged: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Apply the server optimiser to the pseudo-gradient of ``averaged``
        (module docstring, step 2-3); integer arrays take the average as is."""
        base = self._global_np
        scale = self.client_lr * (self.local_steps or 1)
        params = {
            k: np.array(v, dtype=np.float64)
            for k, v in base.items()
            if v.dtype.kind == "f"
        }
        grads = {k: (params[k] - averaged[k]) / scale for k in params}
        lr = self.schedule.lr(self.server_steps)
        self.server_optimizer.step(params, grads, lr)
        self.server_steps += 1
        self._last_lr = lr
        return {
            k: params[k].astype(base[k].dtype) if k in params else averaged[k]
            for k in base
        }

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Average the replies by examples, then take one server optimiser step.

        Like Flower's FedOpt strategies it needs the model the nodes trained
        from (the arrays of the last ``configure_train``): without one it raises
        Flower's ``AggregationError``.
        """
        arrays, metrics = super().aggregate_train(server_round, replies)
        if arrays is None:
            return arrays, metrics
        if not self._global_np:
            raise AggregationError(
                reason="LargeBatchRounds needs the model the nodes trained from to "
                "compute the pseudo-gradient: call configure_train before "
                "aggregate_train"
            )
        new = to_arrayrecord(self.server_step(to_numpy(arrays)))
        metrics = MetricRecord() if metrics is None else metrics
        metrics[ROUND_SERVER_LR] = self._last_lr
        metrics[ROUND_BATCH] = int(sum(self.shares.values()))
        return new, metrics

    # ------------------------------------------------------------ checkpoint
    def state(self) -> dict[str, Any]:
        state = super().state()
        state["large_batch"] = {
            "server_steps": self.server_steps,
            "sample_rates": {str(k): v for k, v in self.sample_rates.items()},
            "optimizer": {
                k: v.tolist() for k, v in self.server_optimizer.state().items()
            },
        }
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state` returned; a field out of range raises one
        CheckpointError naming it. The optimiser's buffers must be finite (its
        second moments >= 0) and shaped as the model's arrays they belong to."""
        saved = StateReader.of(state).section("large_batch")
        server_steps = saved.whole("server_steps")
        rates = saved.by_node("sample_rates", samples_per_second(self.max_num_examples))
        optimizer = saved.section("optimizer")
        shapes = {k: v.shape for k, v in self._global_np.items()}
        buffers = {
            key: np.asarray(optimizer.whole(key))
            if key == STEP_KEY
            else optimizer.array(
                key,
                shapes.get(key.partition("/")[2]) if shapes else None,
                NON_NEGATIVE if key.startswith("exp_avg_sq/") else FINITE,
            )
            for key in optimizer
        }
        super().load_state(state)
        self.server_steps = server_steps
        self.sample_rates = rates
        self.server_optimizer.load_state(buffers)
