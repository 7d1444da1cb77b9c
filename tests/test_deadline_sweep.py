"""DeadlineFedAvg never starves, and is never behind FedAvg at equal time.

A strategy that trades rounds for time is lower per round by design, so the guard
is accuracy at equal *time*: on the in-process engine, Flower's FedAvg (waiting for
every node, no dropouts) runs ``ROUNDS`` rounds, and the recommended default
(``strategy = "deadline"``) must, at FedAvg's last round's virtual time, be no more
than half a point below FedAvg's final accuracy. Fleets of several sizes and
spreads: ``phones-10x`` at 10, 20, 50 and 100 nodes, the ``uniform`` control
(nothing to gain, nothing may be lost), ``boards`` and ``mixed``.

Separately, with every option on (adaptive deadline, 1.3x over-selection, partial
work, late updates, work balancing), every round after the first has usable
replies and updates the model.
"""

from __future__ import annotations

from typing import Any

import pytest
from flowerbed.sims.scenario import run_scenario
from flowerbed.strategies import DeadlineFedAvg
from flowerbed.strategies.round_metrics import ROUND_LATE_UPDATES, ROUND_PARTICIPANTS
from flwr.serverapp.strategy import FedAvg, Result

ROUNDS = 20
OUR_ROUNDS = 10 * ROUNDS
"""Enough of the default's short rounds to outlast FedAvg's ``ROUNDS`` (on 20
mixed phones and boards its rounds are ~1/8 of FedAvg's)."""
SHARED = {"fraction_evaluate": 0.0, "min_train_nodes": 1, "min_available_nodes": 1}


class Recorded(DeadlineFedAvg):
    """DeadlineFedAvg that keeps the Result of its run."""

    result = Result()

    def start(self, *args: Any, **kwargs: Any) -> Result:
        """DeadlineFedAvg's ``start`` with the same arguments; keeps its Result."""
        self.result = super().start(*args, **kwargs)
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
def test_every_round_trains_with_every_option_on(nodes: int) -> None:
    config: dict[str, Any] = {
        "fleet": "phones-10x",
        "num-nodes": nodes,
        "num-rounds": ROUNDS,
        "seed": 1,
    }
    deadline = every_option_on()
    run_scenario(config, strategy=deadline, write=False)
    train = deadline.result.train_metrics_clientapp
    assert sorted(train) == list(range(1, ROUNDS + 1))  # every round updated
    for r in range(2, ROUNDS + 1):
        assert train[r][ROUND_PARTICIPANTS] + train[r][ROUND_LATE_UPDATES] > 0


@pytest.mark.slow
@pytest.mark.usefixtures("quiet_single_threaded")
@pytest.mark.parametrize(
    ("fleet", "nodes"),
    [
        ("phones-10x", 10),
        ("phones-10x", 20),
        ("phones-10x", 50),
        ("phones-10x", 100),
        ("uniform", 20),
        ("boards", 20),
        ("mixed", 20),
    ],
)
def test_the_default_is_not_behind_fedavg_at_equal_time(fleet: str, nodes: int) -> None:
    config: dict[str, Any] = {
        "fleet": fleet,
        "num-nodes": nodes,
        "num-rounds": ROUNDS,
        "seed": 1,
        "dropout": 0.0,
    }
    flower = run_scenario(config, strategy=FedAvg(**SHARED), write=False).records
    budget = flower[-1].virtual_time_s
    ours = run_scenario(
        {**config, "strategy": "deadline", "num-rounds": OUR_ROUNDS}, write=False
    ).records
    assert ours[-1].virtual_time_s >= budget  # it ran at least as long
    at_budget = [r for r in ours if r.virtual_time_s <= budget][-1]
    assert at_budget.accuracy >= flower[-1].accuracy - 0.005
