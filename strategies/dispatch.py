"""Who gets a task and the message that carries it (the data-parallel strategies).

FedAvg's sample size, a seeded draw among the nodes that are neither quarantined
nor busy, the ``local-steps`` each node is given, and one message per node with
its own copy of the config (``server-round``, its steps, what the strategy adds
for that node).
"""

from __future__ import annotations

from collections.abc import Callable

from flowerbed import keys
from flowerbed.clock import clock_of
from flowerbed.strategies.sampling import Quarantine, round_rng, sample_nodes
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log


def sample_size(grid: Grid, fraction: float, minimum: int) -> int:
    """FedAvg's sample size: ``max(int(connected * fraction), minimum)``; 0 when
    ``fraction`` is 0."""
    if fraction == 0.0:
        return 0
    return max(int(len(list(grid.get_node_ids())) * fraction), minimum)


def log_sampled(stage: str, node_ids: list[int], grid: Grid, level: int) -> None:
    """Flower's line for a sampling: ``<stage>: Sampled n nodes (out of N)``."""
    connected = len(list(grid.get_node_ids()))
    log(level, "%s: Sampled %s nodes (out of %s)", stage, len(node_ids), connected)


def sample_free(
    grid: Grid,
    server_round: int,
    count: int,
    *,
    quarantine: Quarantine,
    busy: set[int],
    seed: int,
    draw: str,
    min_available: int,
    timeout: float,
) -> list[int]:
    """``count`` nodes drawn with ``round_rng(seed, server_round, draw)`` among
    those neither quarantined in ``server_round`` nor ``busy``."""
    benched = {
        n for n in grid.get_node_ids() if quarantine.is_quarantined(n, server_round)
    }
    return sample_nodes(
        grid,
        clock_of(grid),
        count=count,
        min_available=min_available,
        exclude=benched | busy,
        rng=round_rng(seed, server_round, draw),
        timeout=timeout,
    )


def base_steps(local_steps: int | None, config: ConfigRecord) -> int | None:
    """``L``: ``local_steps``, else an integer ``local-steps`` in ``config``."""
    if local_steps is not None:
        return local_steps
    steps = config.get(keys.LOCAL_STEPS)
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


def steps_to_send(
    node_ids: list[int],
    base: int | None,
    balance_work: bool,
    assign: Callable[[list[int], int], dict[int, int]],
) -> dict[int, int] | None:
    """The ``local-steps`` of each node: ``assign``'s shares of ``base`` with
    work balancing, ``base`` for all without, None when there is no ``base``."""
    if balance_work:
        if base is None:
            raise ValueError(
                "balance_work needs a base amount of work: pass local_steps=... "
                f"or put {keys.LOCAL_STEPS!r} in train_config"
            )
        return assign(node_ids, base)
    return None if base is None else dict.fromkeys(node_ids, base)


def node_messages(
    node_ids: list[int],
    content: tuple[str, ArrayRecord, str, ConfigRecord],
    message_type: str,
    server_round: int,
    steps: dict[int, int] | None,
    node_config: Callable[[int, ConfigRecord], ConfigRecord],
    ttl: Callable[[], float],
) -> list[Message]:
    """One message per node: ``content`` is (arrays key, arrays, config key,
    config); each node's config is a copy with ``server-round``, its
    ``local-steps`` and, for train messages, what ``node_config`` adds."""
    arrays_key, arrays, config_key, config = content
    messages = []
    for node in node_ids:
        own = ConfigRecord(dict(config))
        own[keys.SERVER_ROUND] = server_round
        if steps is not None:
            own[keys.LOCAL_STEPS] = steps[node]
        if message_type == MessageType.TRAIN:
            own = node_config(node, own)
        messages.append(
            Message(
                RecordDict({arrays_key: arrays, config_key: own}),
                dst_node_id=node,
                message_type=message_type,
                ttl=ttl(),
                group_id=str(server_round),
            )
        )
    return messages
