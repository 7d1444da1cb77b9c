"""RuntimeWeightedFedAvg: each weighting against hand-computed averages.

Fleet used throughout: global model w = [0]. Node 1 answers w = [1] with 10 examples,
4 steps, in 2 s; node 2 answers w = [4] with 30 examples, 12 steps, in 8 s.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flowerbed import keys
from flowerbed.strategies import RuntimeWeightedFedAvg
from flwr.app import ConfigRecord
from test_strategies_fakes import FakeGrid, config_of, node, silent, weights


def two_nodes(**kwargs: bool) -> FakeGrid:
    return FakeGrid(
        {
            1: node(1.0, seconds=2.0, examples=10, steps=4, **kwargs),
            2: node(4.0, seconds=8.0, examples=30, steps=12, **kwargs),
        }
    )


def run_one_round(weighting: str, grid: FakeGrid) -> float:
    strategy = RuntimeWeightedFedAvg(weighting=weighting, fraction_evaluate=0.0)
    result = strategy.start(grid, weights(0.0), num_rounds=1)
    return float(result.arrays["w"].numpy()[0])


@pytest.mark.parametrize(
    ("weighting", "expected"),
    [
        # n_i: (10*1 + 30*4) / 40
        ("examples", 3.25),
        # 1/t_i = 1/2, 1/8: (0.5*1 + 0.125*4) / 0.625
        ("runtime", 1.6),
        # n_i/t_i = 5, 3.75: (5*1 + 3.75*4) / 8.75
        ("throughput", 20 / 8.75),
        # p = 1/4, 3/4; sum p_i d_i/tau_i = 1/4*1/4 + 3/4*4/12 = 0.3125;
        # tau_eff = 1/4*4 + 3/4*12 = 10; x = 0 + 10 * 0.3125
        ("fednova", 3.125),
    ],
)
def test_weighting_matches_hand_computed_average(
    weighting: str, expected: float
) -> None:
    assert run_one_round(weighting, two_nodes()) == pytest.approx(expected, rel=1e-6)


def test_plain_clients_fall_back_to_measured_round_trip(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # No train-time-s on the wire: the replies still arrive after 2 s and 8 s,
    # so the runtime weighting is the same 1.6 as above.
    caplog.set_level(logging.WARNING, logger="flwr")
    grid = two_nodes(report_time=False)
    assert run_one_round("runtime", grid) == pytest.approx(1.6, rel=1e-6)
    fallbacks = [r for r in caplog.records if "round-trip" in r.getMessage()]
    assert len(fallbacks) == 1


def test_throughput_prefers_reported_samples_per_second() -> None:
    def with_rate(value: float, rate: float):  # type: ignore[no-untyped-def]
        base = node(value, seconds=1.0)

        def run(message):  # type: ignore[no-untyped-def]
            reply, delay = base(message)
            reply.content[keys.METRICS][keys.SAMPLES_PER_S] = rate
            return reply, delay

        return run

    grid = FakeGrid({1: with_rate(1.0, 30.0), 2: with_rate(4.0, 10.0)})
    # (30*1 + 10*4) / 40
    assert run_one_round("throughput", grid) == pytest.approx(1.75)


def test_unknown_weighting_is_refused_with_the_valid_choices() -> None:
    with pytest.raises(ValueError, match="runtime, throughput, fednova, examples"):
        RuntimeWeightedFedAvg(weighting="speed")


def test_work_balancing_probes_then_assigns_steps_proportional_to_speed() -> None:
    # Node 1 does 5 steps/s, node 2 1 step/s (reported num-steps = assigned steps).
    def timed(speed: float):  # type: ignore[no-untyped-def]
        def run(message):  # type: ignore[no-untyped-def]
            steps = config_of(message)[keys.LOCAL_STEPS]
            return node(0.0, seconds=steps / speed, steps=steps)(message)

        return run

    grid = FakeGrid({1: timed(5.0), 2: timed(1.0)})
    strategy = RuntimeWeightedFedAvg(
        balance_work=True, local_steps=10, fraction_evaluate=0.0
    )
    strategy.start(grid, weights(), num_rounds=3)
    assigned = [
        [config_of(m)[keys.LOCAL_STEPS] for m in grid.pushed_to(n)] for n in (1, 2)
    ]
    # Round 1 probes with L = 10. Then mean speed 3: 10*5/3 = 16.7 -> 17, 10*1/3 -> 3.
    assert assigned == [[10, 17, 17], [10, 3, 3]]
    assert strategy.speeds == pytest.approx({1: 5.0, 2: 1.0})


def test_work_balancing_without_base_steps_says_what_to_set() -> None:
    strategy = RuntimeWeightedFedAvg(balance_work=True, fraction_evaluate=0.0)
    with pytest.raises(ValueError, match="local_steps"):
        strategy.start(two_nodes(), weights(), num_rounds=1)


def test_base_steps_come_from_train_config() -> None:
    grid = two_nodes()
    strategy = RuntimeWeightedFedAvg(balance_work=True, fraction_evaluate=0.0)
    strategy.start(
        grid, weights(), num_rounds=1, train_config=ConfigRecord({"local-steps": 7})
    )
    assert [config_of(m)[keys.LOCAL_STEPS] for _, m in grid.pushed] == [7, 7]


def test_federated_evaluation_is_aggregated_per_round() -> None:
    grid = FakeGrid(
        {
            1: node(1.0, seconds=1.0, examples=10, evaluate_acc=0.2),
            2: node(1.0, seconds=1.0, examples=30, evaluate_acc=0.6),
        }
    )
    result = RuntimeWeightedFedAvg().start(grid, weights(), num_rounds=2)
    # (10*0.2 + 30*0.6) / 40
    assert result.evaluate_metrics_clientapp[2]["eval-acc"] == pytest.approx(0.5)
    assert np.allclose(result.arrays["w"].numpy(), [2.0])


def test_a_run_whose_messages_all_expire_names_the_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Both nodes never answer: each message comes back expired at the 5 s TTL
    # (an error reply, not a missing one); the cause must still count them.
    caplog.set_level(logging.WARNING, logger="flwr")
    grid = FakeGrid({1: silent, 2: silent})
    result = RuntimeWeightedFedAvg(fraction_evaluate=0.0).start(
        grid, weights(3.0), num_rounds=3, timeout=5.0
    )
    assert float(result.arrays["w"].numpy()[0]) == 3.0
    cause = (
        "2 of 2 sampled nodes did not reply within start()'s timeout=5 s or their "
        "messages expired: raise timeout"
    )
    lines = [r.getMessage() for r in caplog.records]
    for kind in ("NO PROGRESS", "NO TRAINING"):
        assert sum(m.startswith(kind) and m.endswith(cause) for m in lines) == 1


def test_flowers_arguments_land_where_flowers_fedavg_puts_them() -> None:
    from flwr.serverapp.strategy import FedAvg

    def aggregate(records: list, key: str) -> None:  # type: ignore[type-arg]
        return None

    flower = {
        "fraction_train": 0.3,
        "fraction_evaluate": 0.4,
        "min_train_nodes": 5,
        "min_evaluate_nodes": 6,
        "min_available_nodes": 7,
        "weighted_by_key": "w",
        "arrayrecord_key": "a",
        "configrecord_key": "c",
        "train_metrics_aggr_fn": aggregate,
        "evaluate_metrics_aggr_fn": len,
    }
    ours, theirs = RuntimeWeightedFedAvg(**flower), FedAvg(**flower)  # type: ignore[arg-type]
    assert {k: getattr(ours, k) for k in flower} == {
        k: getattr(theirs, k) for k in flower
    }
    assert {k: getattr(ours, k) for k in flower} == flower
