"""A late reply already pulled into the backlog still finds its round's base model."""

from flowerbed.sims.scenario import run_scenario
from flowerbed.strategies import DeadlineFedAvg
from flowerbed.strategies.inflight import InFlight
from flwr.app import Message, RecordDict
from test_strategies_fakes import FakeGrid, node, weights


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


def test_replies_pulled_but_not_taken_wait_in_the_backlog() -> None:
    # Both replies arrive at t=1 and are pulled together; the consumer takes one
    # and stops (an aggregate_train override that reads only the first reply):
    # the other is not lost, the next iteration yields it.

    grid = FakeGrid({1: node(1.0, seconds=1.0), 2: node(2.0, seconds=1.0)})
    inflight = InFlight(grid, grid.clock)
    inflight.push(
        [
            Message(RecordDict({"arrays": weights()}), n, "train", ttl=9.0)
            for n in (1, 2)
        ],
        server_round=1,
    )
    first = inflight.replies(until=5.0)
    _, ticket, _ = next(first)
    first.close()
    [(_, other, _)] = list(inflight.replies(until=5.0))
    assert {ticket.node_id, other.node_id} == {1, 2}
