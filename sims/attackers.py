"""Hostile nodes: a grid that turns some nodes' train replies into an attack.

The simulated nodes train honestly; :class:`HostileGrid` sits between the fleet
and the strategy and rewrites the replies of the hostile ones before the
strategy sees them, as a compromised device would: it reads the model it was
sent and the update it honestly computed, and sends instead

    x_sent + s * v,    s = norm_factor * median(its last ``window`` honest ||d||)

where ``d = x_honest - x_sent`` and ``v`` is a unit vector: ``-d / ||d||``
(``"flip"``: the model pushed against the direction training would move it,
the directed deviation of Fang, Cao, Jia, Gong, "Local Model Poisoning Attacks
to Byzantine-Robust Federated Learning", USENIX Security 2020) or one fixed
random direction for the whole run (``"random"``), with ``num-examples``
``weight_factor`` times its honest count. With ``norm_factor`` just under a
strategy's length bound and ``weight_factor`` within its weight cap nothing of
the reply is cut, round after round: small perturbations that stay inside what
honest replies look like and add up over time (Baruch, Baruch, Goldberg, "A
Little Is Enough: Circumventing Defenses For Distributed Learning", NeurIPS
2019).

Only float arrays move; ``num-steps`` and the times are the honest ones, so the
update's FedNova scale ``1/tau`` is the honest one too.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from flowerbed import keys
from flowerbed.arrays import encode_record, record_views
from flowerbed.grid import GridWrapper
from flwr.app import ArrayRecord, Message, MessageType, MetricRecord
from flwr.serverapp import Grid

DIRECTIONS = ("flip", "random")
"""Valid values of :attr:`DriftAttack.direction`."""


@dataclass(frozen=True)
class DriftAttack:
    """What a hostile node sends instead of its honest update (see module).

    Parameters
    ----------
    direction : str (default: "flip")
        ``"flip"``: against its honest update; ``"random"``: one fixed random
        direction, drawn from ``seed``.
    norm_factor : float (default: 2.95)
        The update's length, in medians of the node's own recent honest lengths.
    weight_factor : float (default: 2.0)
        ``num-examples`` reported, in multiples of the honest count.
    window : int (default: 6)
        Honest lengths the node's median is taken over (about the rounds a
        strategy's history of recent replies spans with ten nodes).
    seed : int (default: 0)
        Seeds the random direction.
    """

    direction: str = "flip"
    norm_factor: float = 2.95
    weight_factor: float = 2.0
    window: int = 6
    seed: int = 0

    def __post_init__(self) -> None:
        if self.direction not in DIRECTIONS:
            raise ValueError(
                f"unknown attack direction {self.direction!r}; valid: "
                f"{', '.join(DIRECTIONS)}"
            )
        for name, value in (
            ("norm_factor", self.norm_factor),
            ("weight_factor", self.weight_factor),
        ):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be finite and > 0, got {value}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")


class HostileGrid(GridWrapper):
    """``inner`` with the train replies of ``hostile`` nodes rewritten by ``attack``.

    ``attacked`` counts the replies rewritten. Error replies, replies without
    metrics or arrays and replies of zero steps pass unchanged.
    """

    def __init__(
        self, inner: Grid, hostile: Iterable[int], attack: DriftAttack
    ) -> None:
        super().__init__(inner)
        self.hostile = frozenset(hostile)
        self.attack = attack
        self.attacked = 0
        self._sent: dict[str, ArrayRecord] = {}
        self._lengths: dict[int, deque[float]] = {}
        self._direction: dict[str, np.ndarray] | None = None

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        batch = list(messages)
        ids = list(self.inner.push_messages(batch))
        for message, message_id in zip(batch, ids, strict=True):
            if (
                message.metadata.dst_node_id in self.hostile
                and message.metadata.message_type == MessageType.TRAIN
            ):
                sent = message.content.get(keys.ARRAYS)
                if isinstance(sent, ArrayRecord):
                    self._sent[message_id] = sent
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = list(self.inner.pull_messages(message_ids))
        for reply in replies:
            sent = self._sent.pop(reply.metadata.reply_to_message_id, None)
            if sent is not None and not reply.has_error():
                self._rewrite(reply, sent)
        return replies

    def _rewrite(self, reply: Message, sent: ArrayRecord) -> None:
        metrics = reply.content.get(keys.METRICS)
        trained = reply.content.get(keys.ARRAYS)
        if not isinstance(metrics, MetricRecord) or not isinstance(
            trained, ArrayRecord
        ):
            return
        if float(metrics.get(keys.NUM_STEPS, 1)) <= 0:  # type: ignore[arg-type]
            return
        base = record_views(sent)
        honest = record_views(trained)
        delta = {
            name: np.subtract(honest[name], value, dtype=np.float64)
            for name, value in base.items()
            if value.dtype.kind == "f"
        }
        length = _norm(delta)
        lengths = self._lengths.setdefault(
            reply.metadata.src_node_id, deque(maxlen=self.attack.window)
        )
        lengths.append(length)
        size = self.attack.norm_factor * float(np.median(np.fromiter(lengths, float)))
        if self.attack.direction == "random":
            unit = self._random_direction(delta)
        else:
            unit = {name: -d / length for name, d in delta.items()} if length else delta
        sends = dict(base)
        for name, direction in unit.items():
            sends[name] = (base[name] + size * direction).astype(base[name].dtype)
        reply.content[keys.ARRAYS] = encode_record(sends)
        claims = MetricRecord(dict(metrics))
        if keys.NUM_EXAMPLES in metrics:
            examples = float(metrics[keys.NUM_EXAMPLES])  # type: ignore[arg-type]
            claims[keys.NUM_EXAMPLES] = round(self.attack.weight_factor * examples)
        reply.content[keys.METRICS] = claims
        self.attacked += 1

    def _random_direction(
        self, like: Mapping[str, np.ndarray]
    ) -> dict[str, np.ndarray]:
        if self._direction is None:
            rng = np.random.default_rng(self.attack.seed)
            draw = {name: rng.standard_normal(v.shape) for name, v in like.items()}
            length = _norm(draw)
            self._direction = {name: v / length for name, v in draw.items()}
        return self._direction


def _norm(arrays: Mapping[str, np.ndarray]) -> float:
    return math.sqrt(sum(float(np.vdot(v, v)) for v in arrays.values()))
