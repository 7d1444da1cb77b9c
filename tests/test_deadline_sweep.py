"""DeadlineFedAvg with every option on never starves, at any fleet size.

The README's deadline example (``phones-10x``, 20 rounds) at 10, 20, 50 and 100
nodes on the in-process engine: adaptive deadline, 1.3x over-selection, partial
work, late updates and work balancing together. Once the first round has
finished, every round must have usable replies and update the model, and the
final accuracy must be within one point of Flower's FedAvg on the same fleet and
seed (FedAvg waits for every node, so it is the accuracy to match, not the time).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from flowerbed.sims.scenario import run_scenario
from flowerbed.strategies import DeadlineFedAvg
from flowerbed.strategies.round_metrics import ROUND_LATE_UPDATES, ROUND_PARTICIPANTS
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Result

ROUNDS = 20
SHARED = {"fraction_evaluate": 0.0, "min_train_nodes": 1, "min_available_nodes": 1}


class Recorded(DeadlineFedAvg):
    """DeadlineFedAvg that keeps the Result of its run."""

    result = Result()

    def start(  # type: ignore[override]
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        self.result = super().start(
            grid,
            initial_arrays,
            num_rounds,
            timeout,
            train_config,
            evaluate_config,
            evaluate_fn,
        )
        return self.result


def every_option_on() -> Recorded:
    return Recorded(
        **SHARED,
        adaptive_deadline=True,
        over_selection=1.3,
        partial_work=True,
        late_updates=True,
        balance_work=True,
        seed=1,
    )


@pytest.mark.slow
@pytest.mark.usefixtures("quiet_single_threaded")
@pytest.mark.parametrize("nodes", [10, 20, 50, 100])
def test_every_round_trains_and_accuracy_matches_fedavg(nodes: int) -> None:
    config: dict[str, Any] = {
        "fleet": "phones-10x",
        "num-nodes": nodes,
        "num-rounds": ROUNDS,
        "seed": 1,
    }
    deadline = every_option_on()
    ours = run_scenario(config, strategy=deadline, write=False).records
    flower = run_scenario(config, strategy=FedAvg(**SHARED), write=False).records

    train = deadline.result.train_metrics_clientapp
    assert sorted(train) == list(range(1, ROUNDS + 1))  # every round updated
    for r in range(2, ROUNDS + 1):
        assert train[r][ROUND_PARTICIPANTS] + train[r][ROUND_LATE_UPDATES] > 0
    assert ours[-1].accuracy >= flower[-1].accuracy - 0.01
