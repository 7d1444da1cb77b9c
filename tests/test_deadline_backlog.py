"""A late reply already pulled into the backlog still finds its round's base model."""

from flowerbed.sims.scenario import run_scenario
from flowerbed.strategies import DeadlineFedAvg


def test_adaptive_deadline_with_late_updates_runs_a_large_unequal_fleet() -> None:
    # Reproduces a KeyError: the base model of a round was dropped once no ticket
    # of that round was in flight, although a reply of it sat in the backlog.
    strategy = DeadlineFedAvg(
        adaptive_deadline=True,
        fraction_evaluate=0.0,
        min_train_nodes=1,
        min_available_nodes=1,
        seed=1,
    )
    config = {"fleet": "phones-10x", "num-nodes": 50, "num-rounds": 4, "seed": 1}
    records = run_scenario({**config, "dropout": 0.0}, strategy=strategy, write=False)
    assert [r.round for r in records.records] == [1, 2, 3, 4]
    assert records.records[-1].accuracy > 0.5
