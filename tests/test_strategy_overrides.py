"""Flower's subclassing recipes work on every flowerbed strategy.

``start()`` is a template method, as in Flower: it calls ``configure_train``,
``aggregate_train``, ``configure_evaluate`` and ``aggregate_evaluate``, so a
subclass that overrides one of them changes the run. Fleet: two nodes that add
1 to the model after 1 s and 2 s, evaluations answered at once.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pytest
from flowerbed.strategies import (
    ClusterSelection,
    DeadlineFedAvg,
    FedBuff,
    RuntimeWeightedFedAvg,
)
from flowerbed.strategies.accumulation import to_arrayrecord
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords
from test_strategies_fakes import FakeGrid, config_of, node, weights

BASES: dict[str, type[RuntimeWeightedFedAvg]] = {
    "RuntimeWeightedFedAvg": RuntimeWeightedFedAvg,
    "DeadlineFedAvg": DeadlineFedAvg,
    "FedBuff": FedBuff,
}
ROUNDS = 5


def fleet() -> FakeGrid:
    return FakeGrid({1: node(1.0, seconds=1.0), 2: node(1.0, seconds=2.0)})


def make(base: type[RuntimeWeightedFedAvg], **kwargs: object) -> RuntimeWeightedFedAvg:
    kwargs.setdefault("fraction_evaluate", 0.0)
    if issubclass(base, FedBuff):
        kwargs.setdefault("buffer_size", 2)
    return base(weighting="examples", **kwargs)  # type: ignore[arg-type]


def lr_decay(base: type[RuntimeWeightedFedAvg]) -> type[RuntimeWeightedFedAvg]:
    """Flower's tutorial recipe: halve the learning rate every 2 rounds."""

    class Decaying(base):  # type: ignore[valid-type,misc]
        def configure_train(
            self,
            server_round: int,
            arrays: ArrayRecord,
            config: ConfigRecord,
            grid: Grid,
        ) -> Iterable[Message]:
            if server_round % 2 == 0 and server_round > 0:
                config["lr"] *= 0.5  # type: ignore[operator]
            return super().configure_train(server_round, arrays, config, grid)

    return Decaying


@pytest.mark.parametrize("name", sorted(BASES))
def test_learning_rate_decay_recipe_reaches_the_nodes(name: str) -> None:
    grid = fleet()
    make(lr_decay(BASES[name])).start(
        grid, weights(), num_rounds=ROUNDS, train_config=ConfigRecord({"lr": 0.8})
    )
    # Round (model version) r trains with 0.8 / 2 ** (r // 2): the in-place edit
    # of the shared config accumulates once per round, as under Flower's FedAvg.
    sent = {
        (int(config_of(m)["server-round"]), config_of(m)["lr"])
        for _, m in grid.pushed
        if m.metadata.message_type == "train"
    }
    assert sorted(sent) == [(1, 0.8), (2, 0.4), (3, 0.4), (4, 0.2), (5, 0.2)]


def test_learning_rate_decay_recipe_through_cluster_selection() -> None:
    grid = fleet()
    strategy = ClusterSelection(strategy=make(lr_decay(RuntimeWeightedFedAvg)))
    strategy.start(
        grid,
        weights(),
        num_rounds=4,
        train_config=ConfigRecord({"lr": 0.8, "local-steps": 2}),
    )
    trained = {
        (int(config_of(m)["server-round"]), config_of(m)["lr"])
        for _, m in grid.pushed
        if m.metadata.message_type == "train" and "server-round" in config_of(m)
    }
    assert {lr for r, lr in trained if r == 4} == {0.2}


@pytest.mark.parametrize("name", sorted(BASES))
def test_overridden_aggregate_train_is_called_every_round(name: str) -> None:
    calls: list[int] = []

    class Tagged(BASES[name]):  # type: ignore[valid-type,misc]
        def aggregate_train(
            self, server_round: int, replies: Iterable[Message]
        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
            calls.append(server_round)
            arrays, metrics = super().aggregate_train(server_round, replies)
            assert metrics is not None
            metrics["tagged"] = 1
            return arrays, metrics

    result = make(Tagged).start(fleet(), weights(), num_rounds=3)
    plain = make(BASES[name]).start(fleet(), weights(), num_rounds=3)
    assert calls == [1, 2, 3]
    assert all(m["tagged"] == 1 for m in result.train_metrics_clientapp.values())
    assert np.array_equal(result.arrays["w"].numpy(), plain.arrays["w"].numpy())


@pytest.mark.parametrize("name", sorted(BASES))
def test_aggregate_train_replaced_by_flowers_own_averaging(name: str) -> None:
    # An override that never calls super: it reads the replies as a list and
    # halves Flower's average; its result is what the run keeps.
    class Halving(BASES[name]):  # type: ignore[valid-type,misc]
        def aggregate_train(
            self, server_round: int, replies: Iterable[Message]
        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
            contents = [r.content for r in replies if not r.has_error()]
            mean = aggregate_arrayrecords(contents, self.weighted_by_key)
            return to_arrayrecord({k: v.numpy() / 2 for k, v in mean.items()}), None

    # Each reply is the model it got plus 1, so each round (model version)
    # x <- (x + 1) / 2 from 0: 0.5, 0.75, 0.875 (FedBuff with one node at work
    # and K = 1, so every reply answers the newest version).
    extra = {"concurrency": 1, "buffer_size": 1} if name == "FedBuff" else {}
    result = make(Halving, **extra).start(fleet(), weights(), num_rounds=3)
    assert float(result.arrays["w"].numpy()[0]) == pytest.approx(0.875)


@pytest.mark.parametrize("name", sorted(BASES))
def test_overridden_evaluation_methods_are_used(name: str) -> None:
    seen: list[int] = []

    class Evaluating(BASES[name]):  # type: ignore[valid-type,misc]
        def configure_evaluate(
            self,
            server_round: int,
            arrays: ArrayRecord,
            config: ConfigRecord,
            grid: Grid,
        ) -> Iterable[Message]:
            config["split"] = "val"
            return super().configure_evaluate(server_round, arrays, config, grid)

        def aggregate_evaluate(
            self, server_round: int, replies: Iterable[Message]
        ) -> MetricRecord | None:
            seen.append(server_round)
            return MetricRecord({"replies": len(list(replies))})

    grid = fleet()
    result = make(Evaluating, fraction_evaluate=1.0).start(
        grid, weights(), num_rounds=2
    )
    assert seen == [1, 2]
    assert {r: m["replies"] for r, m in result.evaluate_metrics_clientapp.items()} == {
        1: 2,
        2: 2,
    }
    evaluations = [m for _, m in grid.pushed if m.metadata.message_type == "evaluate"]
    assert evaluations and all(config_of(m)["split"] == "val" for m in evaluations)


@pytest.mark.parametrize("name", sorted(BASES))
def test_evaluation_only_run_evaluates_every_round(name: str) -> None:
    # fraction_train=0.0: Flower's FedAvg skips training and still evaluates.
    strategy = BASES[name](fraction_train=0.0, fraction_evaluate=1.0)
    grid = fleet()
    result = strategy.start(grid, weights(5.0), num_rounds=3)
    assert sorted(result.evaluate_metrics_clientapp) == [1, 2, 3]
    assert result.train_metrics_clientapp == {}
    assert np.array_equal(result.arrays["w"].numpy(), [5.0])
    assert all(m.metadata.message_type == "evaluate" for _, m in grid.pushed)
