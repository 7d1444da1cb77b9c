"""Every flowerbed strategy runs its rounds through the one template,
``RoundLoop.start()``: none writes a start() of its own (docs/architecture.md,
"Rounds: one template")."""

from __future__ import annotations

import pytest
from flowerbed.strategies import (
    DeadlineFedAvg,
    DifferentialPrivacyServerSideFixedClipping,
    FedBuff,
    LargeBatchRounds,
    LargeBatchSync,
    PipelineTraining,
    RuntimeWeightedFedAvg,
    TiledTraining,
)
from flowerbed.strategies.rounds import RoundLoop
from flowerbed.strategies.span import SpanJobStrategy
from flwr.app import ArrayRecord
from flwr.serverapp.strategy import Strategy

TEMPLATED: list[type[Strategy]] = [
    RuntimeWeightedFedAvg,
    DeadlineFedAvg,
    LargeBatchRounds,
    FedBuff,
    SpanJobStrategy,
    PipelineTraining,
    LargeBatchSync,
    TiledTraining,
]


@pytest.mark.parametrize("strategy", TEMPLATED, ids=lambda s: s.__name__)
def test_the_strategy_starts_with_the_round_template(
    strategy: type[Strategy],
) -> None:
    assert issubclass(strategy, RoundLoop)
    assert strategy.start is RoundLoop.start


def test_a_span_job_refuses_a_privacy_wrapper_instead_of_running_as_fedavg() -> None:
    wrapper = DifferentialPrivacyServerSideFixedClipping(
        SpanJobStrategy(),
        noise_multiplier=1.0,
        clipping_norm=1.0,
        num_sampled_clients=2,
    )
    with pytest.raises(TypeError, match="cannot wrap SpanJobStrategy"):
        wrapper.start(grid=None, initial_arrays=ArrayRecord())  # type: ignore[arg-type]


def test_a_start_that_hands_the_run_on_reads_flowers_arguments() -> None:
    """ClusterSelection and the DP wrappers take ``start(*args, **kwargs)`` and
    hand it on: read by name with Flower's defaults, shown with Flower's
    signature, and refused as Flower's ``start`` would refuse it."""
    import inspect

    from flowerbed.strategies import ClusterSelection
    from flowerbed.strategies.rounds import start_arguments

    run = start_arguments("grid", "arrays", 7, train_config=None)
    assert run == {
        "grid": "grid",
        "initial_arrays": "arrays",
        "num_rounds": 7,
        "timeout": 3600,
        "train_config": None,
        "evaluate_config": None,
        "evaluate_fn": None,
    }
    with pytest.raises(TypeError, match="num_round"):
        start_arguments("grid", "arrays", num_round=7)
    flower = inspect.signature(Strategy.start)
    assert inspect.signature(ClusterSelection.start) == flower
    assert inspect.signature(DifferentialPrivacyServerSideFixedClipping.start) == flower
