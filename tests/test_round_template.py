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
