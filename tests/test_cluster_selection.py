"""ClusterSelection: estimates by hand, search, selection on the engine, evaluation.

Hand-computed fleet (sync, W = 6 steps per round, R = 10 rounds, kappa = 1):

    node  s (s/step)  c (s)  Pb (W)  Pi (W)
    A     0.1         0.5    4       1
    B     0.2         0.2    2       0.5
    C     0.4         1.0    3       1

{A, B}: n = 3 steps each; t_A = 0.5 + 0.3 = 0.8, t_B = 0.2 + 0.6 = 0.8, T = 0.8;
E_round = (4 x 0.3 + 1 x 0.5) + (2 x 0.6 + 0.5 x 0.2) = 1.7 + 1.3 = 3.0;
time 8, energy 30, EDP 240, time to accuracy 8 x (1 + 1/2) = 12.
{A}: n = 6; T = 1.1; E = 4 x 0.6 + 1 x 0.5 = 2.9: time 11, energy 29, EDP 319, TTA 22.
{B}: n = 6; T = 1.4; E = 2 x 1.2 + 0.5 x 0.2 = 2.5: time 14, energy 25, EDP 350.
{A, B, C}: n = 2; T = t_C = 1.8; E = (0.8 + 1.6) + (0.8 + 0.7) + (2.4 + 1.0) = 7.3.
{A, C}, {B, C}: T = 2.2, energy 77 and 66; {C}: T = 3.4, energy 82.
Best: time, EDP and time to accuracy {A, B}; energy {B}.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from flowerbed.bench.selection_eval import evaluate_selection
from flowerbed.sims.config import Scenario
from flowerbed.sims.devices import DEVICES as CATALOGUE
from flowerbed.sims.scenario import build_fleet_grid, run_scenario, run_server
from flowerbed.sims.vclock import NodeDropout
from flowerbed.strategies.cluster_selection import (
    OBJECTIVES,
    SELECTION_ESTIMATED_S,
    SELECTION_MEASURED_S,
    SELECTION_SIZE,
    ClusterSelection,
    NodeModel,
    Observation,
    SelectionGoal,
    Tracking,
    Workload,
    all_masks,
    estimate,
    estimate_masks,
    fit_node,
    select,
)
from flowerbed.strategies.runtime_weighted import RuntimeWeightedFedAvg
from flowerbed.strategies.wrappers import DifferentialPrivacyServerSideFixedClipping
from flwr.app import Context, Message
from flwr.serverapp.strategy import FedAvg

A = NodeModel(0, step_s=0.1, overhead_s=0.5, busy_w=4.0, idle_w=1.0)
B = NodeModel(1, step_s=0.2, overhead_s=0.2, busy_w=2.0, idle_w=0.5)
C = NodeModel(2, step_s=0.4, overhead_s=1.0, busy_w=3.0, idle_w=1.0)
FLEET3 = [A, B, C]
SYNC = Workload(mode="sync", steps=6, num_rounds=10, kappa=1.0)


pytestmark = pytest.mark.usefixtures("quiet_single_threaded")


# --- estimates by hand ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("members", "round_s", "time_s", "energy_j", "tta_s"),
    [
        ((0, 1), 0.8, 8.0, 30.0, 12.0),
        ((0,), 1.1, 11.0, 29.0, 22.0),
        ((1,), 1.4, 14.0, 25.0, 28.0),
        ((0, 1, 2), 1.8, 18.0, 73.0, 24.0),
        ((1, 2), 2.2, 22.0, 66.0, 33.0),
    ],
)
def test_sync_estimates_match_the_hand_computation(
    members: tuple[int, ...],
    round_s: float,
    time_s: float,
    energy_j: float,
    tta_s: float,
) -> None:
    est = estimate(FLEET3, members, SYNC)
    assert est.round_s == pytest.approx(round_s)
    assert est.time_s == pytest.approx(time_s)
    assert est.energy_j == pytest.approx(energy_j)
    assert est.edp == pytest.approx(time_s * energy_j)
    assert est.time_to_accuracy_s == pytest.approx(tta_s)


@pytest.mark.parametrize(
    ("objective", "best"),
    [("time", (0, 1)), ("energy", (1,)), ("edp", (0, 1)), ("time-to-accuracy", (0, 1))],
)
def test_each_objective_selects_its_hand_computed_best(
    objective: str, best: tuple[int, ...]
) -> None:
    for search in ("exhaustive", "polynomial"):
        assert select(FLEET3, SYNC, objective, search=search).members == best


def test_more_weight_on_participation_makes_time_to_accuracy_take_all_nodes() -> None:
    # kappa = 10: {A, B} 8 x 6 = 48; {A, B, C} 18 x (1 + 10/3) = 78; {A} 11 x 11.
    heavy = Workload(mode="sync", steps=6, num_rounds=10, kappa=10.0)
    assert select(FLEET3, heavy, "time-to-accuracy").time_to_accuracy_s == (
        pytest.approx(48.0)
    )
    # kappa = 0: time to accuracy is time.
    none = Workload(mode="sync", steps=6, num_rounds=10, kappa=0.0)
    assert estimate(FLEET3, (0,), none).time_to_accuracy_s == pytest.approx(11.0)


def test_async_throughputs_add_up() -> None:
    # L = 2 steps per task, R = 5 versions, K = max(1, 2 // 2) = 1.
    # t_A = 0.5 + 0.2 = 0.7, t_B = 0.2 + 0.4 = 0.6; rate = 1/0.7 + 1/0.6 = 1.3/0.42.
    # time = 5 x 1 / rate = 2.1 / 1.3; mean power A 1.3/0.7, B 0.9/0.6 = 1.5.
    fedbuff = Workload(mode="async", steps=2, num_rounds=5, kappa=1.0)
    est = estimate(FLEET3, (0, 1), fedbuff)
    assert est.round_s == pytest.approx(0.42 / 1.3)
    assert est.time_s == pytest.approx(2.1 / 1.3)
    assert est.energy_j == pytest.approx(2.1 / 1.3 * (1.3 / 0.7 + 1.5))
    assert est.time_to_accuracy_s == pytest.approx(2.1 / 1.3 * 1.5)


# --- fitting the node models ----------------------------------------------------------


def test_fit_separates_step_time_overhead_busy_and_idle_power() -> None:
    # s = 0.1, c = 0.6, Pb = 4, Pi = 1: 1 step -> rtt 0.7, E = 0.4 + 0.6 = 1.0;
    # 3 steps -> rtt 0.9, E = 1.2 + 0.6 = 1.8.
    model = fit_node(
        7,
        [
            Observation(steps=1, round_trip_s=0.7, train_time_s=0.1, energy_j=1.0),
            Observation(steps=3, round_trip_s=0.9, train_time_s=0.3, energy_j=1.8),
        ],
    )
    assert model.step_s == pytest.approx(0.1)
    assert model.overhead_s == pytest.approx(0.6)
    assert model.busy_w == pytest.approx(4.0)
    assert model.idle_w == pytest.approx(1.0)


def test_fit_from_round_trips_alone_for_plain_flower_clients() -> None:
    model = fit_node(
        1,
        [
            Observation(steps=1, round_trip_s=0.7),
            Observation(steps=3, round_trip_s=0.9),
        ],
    )
    assert (model.step_s, model.overhead_s) == pytest.approx((0.1, 0.6))
    assert model.busy_w is None
    with pytest.raises(ValueError, match="two lengths"):
        fit_node(1, [Observation(steps=2, round_trip_s=0.7)])


def test_a_query_moves_the_model_once_so_its_overhead_counts_twice() -> None:
    model = fit_node(
        1, [Observation(steps=5, round_trip_s=0.8, train_time_s=0.5, transfers=1)]
    )
    assert model.overhead_s == pytest.approx(2 * 0.3)


def test_energy_needs_power_and_says_which_nodes_lack_it() -> None:
    # Time needs no power: {0} 0.1 + 6 x 0.1 = 0.7 s; {0, 1} max(0.4, 0.55) s.
    no_power = [NodeModel(0, 0.1, 0.1), NodeModel(1, 0.15, 0.1)]
    with pytest.raises(ValueError, match=r"nodes \[0, 1\].*'time'"):
        select(no_power, SYNC, "energy")
    assert select(no_power, SYNC, "time").members == (0, 1)


def test_bad_choices_name_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid choices: time, energy, edp"):
        ClusterSelection(goal=SelectionGoal(objective="speed"))
    with pytest.raises(ValueError, match="valid choices: sync, async"):
        ClusterSelection(goal=SelectionGoal(mode="both"))
    with pytest.raises(ValueError, match="valid choices: auto, exhaustive"):
        select(FLEET3, SYNC, "time", search="greedy")


def test_flat_keywords_still_work_with_a_deprecation_warning() -> None:
    with pytest.warns(DeprecationWarning, match=r"goal=SelectionGoal\(objective="):
        strategy = ClusterSelection(objective="energy", min_nodes=3)
    assert strategy.goal == SelectionGoal(objective="energy", min_nodes=3)
    assert strategy.objective == "energy"  # the fields stay attributes
    with pytest.raises(TypeError, match="goal= and its field"):
        ClusterSelection(goal=SelectionGoal(), objective="energy")
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) objectve"):
        ClusterSelection(objectve="energy")
    # Flower's FedAvg arguments build the wrapped FedAvg.
    assert ClusterSelection(fraction_train=0.5).strategy.fraction_train == 0.5


# --- search ---------------------------------------------------------------------------


def random_nodes(
    rng: np.random.Generator, more: Callable[[np.random.Generator], dict[str, float]]
) -> list[NodeModel]:
    """2 to 9 nodes, each with lognormal step and overhead seconds (medians e^-3 and
    e^-1 s) and the further fields ``more`` draws for it."""
    return [
        NodeModel(
            i,
            step_s=float(rng.lognormal(-3, 1)),
            overhead_s=float(rng.lognormal(-1, 1)),
            **more(rng),
        )
        for i in range(int(rng.integers(2, 10)))
    ]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_exhaustive_and_prefix_search_agree_on_time(mode: str) -> None:
    rng = np.random.default_rng(3)
    for trial in range(40):
        nodes = random_nodes(
            rng,
            lambda rng: {
                "busy_w": float(rng.uniform(2, 10)),
                "idle_w": float(rng.uniform(0.5, 2)),
            },
        )
        workload = Workload(mode=mode, steps=int(rng.integers(1, 60)), num_rounds=10)
        min_size = int(rng.integers(1, len(nodes) + 1))
        for objective in ("time", "time-to-accuracy"):
            full = select(
                nodes, workload, objective, min_size=min_size, search="exhaustive"
            )
            fast = select(
                nodes, workload, objective, min_size=min_size, search="polynomial"
            )
            assert fast.value(objective) == pytest.approx(full.value(objective)), trial


# --- on the in-process engine ---------------------------------------------------------

RUN: dict[str, Any] = {
    "dataset": "digits",
    "model": "lenet",
    "local-steps": 4,
    "batch-size": 16,
    "num-rounds": 3,
    "dropout": 0.0,
    "seed": 3,
}
DEVICES = ["low-end-phone", "pixel-7", "rpi3b", "jetson-nano", "galaxy-s10"]
SLOW = {1000, 1002}  # low-end-phone and rpi3b: 7x to 10x slower than the others
FAST = {1001, 1003, 1004}


def test_selection_picks_fast_nodes_trains_and_logs_estimate_against_measurement() -> (
    None
):
    strategy = ClusterSelection(strategy=FedAvg(fraction_evaluate=0.0))
    outcome = run_scenario(RUN, strategy=strategy, devices=DEVICES, write=False)
    models = strategy.node_models
    # The profile orders the nodes as their devices' speeds (Geekbench 5).
    by_speed = sorted(models, key=lambda n: models[n].step_s)
    by_score = sorted(
        models, key=lambda n: -CATALOGUE[DEVICES[n - 1000]].geekbench5_multi
    )
    assert by_speed == by_score
    assert strategy.profile_s > 0
    assert strategy.choice is not None
    chosen = set(strategy.choice.members)
    assert len(chosen) >= 2  # FedAvg's min_available_nodes
    assert chosen <= FAST and not chosen & SLOW
    # Rounds 2 and 3 trained only the chosen nodes (round 1 also counts profiling).
    for record in outcome.records[1:]:
        assert {1000 + p for p in record.participants} == chosen
    assert [r.round for r in strategy.selection_log] == [1, 2, 3]
    for record in strategy.selection_log:
        # The engine's durations are the estimate's own formulas without noise.
        assert record.measured_s == pytest.approx(record.estimated_s, rel=1e-6)
    metrics = outcome.results  # the run finished and was summarised
    assert metrics["final_accuracy"] > 0


def test_round_metrics_carry_estimate_measurement_and_size() -> None:
    from flowerbed.models import build_model
    from flwr.app import ArrayRecord, ConfigRecord

    grid = build_fleet_grid(RUN, DEVICES)
    strategy = ClusterSelection(strategy=FedAvg(fraction_evaluate=0.0))
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(build_model("lenet", 1, 8, 10).state_dict()),
        num_rounds=2,
        train_config=ConfigRecord({"local-steps": 4, "batch-size": 16}),
    )
    for server_round in (1, 2):
        metrics = result.train_metrics_clientapp[server_round]
        assert metrics[SELECTION_SIZE] == len(strategy.choice.members)
        assert metrics[SELECTION_MEASURED_S] == pytest.approx(
            metrics[SELECTION_ESTIMATED_S]
        )


def test_a_flowerbed_strategy_runs_the_selection_as_its_run_scope(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from flowerbed.models import build_model
    from flwr.app import ArrayRecord, ConfigRecord

    scopes: list[object] = []

    class Watched(RuntimeWeightedFedAvg):
        def _prepare_run(self, grid: Any, done: int) -> None:
            super()._prepare_run(grid, done)
            scopes.append(self.run_scope)  # the template's hooks run inside it

    caplog.set_level(logging.INFO, logger="flwr")
    wrapped = Watched(fraction_evaluate=0.0)
    strategy = ClusterSelection(strategy=wrapped)
    result = strategy.start(
        grid=build_fleet_grid(RUN, DEVICES),
        initial_arrays=ArrayRecord(build_model("lenet", 1, 8, 10).state_dict()),
        num_rounds=2,
        train_config=ConfigRecord({"local-steps": 4, "batch-size": 16}),
    )
    assert scopes == [strategy] and wrapped.run_scope is None
    assert SELECTION_SIZE in result.train_metrics_clientapp[2]
    # Inside flowerbed's differential-privacy wrapper, the wrapped loop runs it.
    inner = Watched(fraction_evaluate=0.0)
    ClusterSelection(
        strategy=DifferentialPrivacyServerSideFixedClipping(
            inner, noise_multiplier=0.0, clipping_norm=1e6, num_sampled_clients=2
        )
    ).start(
        grid=build_fleet_grid(RUN, DEVICES),
        initial_arrays=ArrayRecord(build_model("lenet", 1, 8, 10).state_dict()),
        num_rounds=1,
    )
    assert len(scopes) == 2 and inner.run_scope is None
    lines = [r.getMessage() for r in caplog.records]
    assert not any("not a flowerbed round loop" in m for m in lines)
    # Flower's own FedAvg runs its own start(), and the log says so.
    caplog.clear()
    ClusterSelection(strategy=FedAvg(fraction_evaluate=0.0)).start(
        grid=build_fleet_grid(RUN, DEVICES),
        initial_arrays=ArrayRecord(build_model("lenet", 1, 8, 10).state_dict()),
        num_rounds=1,
    )
    warned = [r for r in caplog.records if "not a flowerbed round loop" in r.message]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING


def test_wraps_a_flowerbed_strategy() -> None:
    wrapped = RuntimeWeightedFedAvg(fraction_evaluate=0.0)
    strategy = ClusterSelection(
        strategy=wrapped, goal=SelectionGoal(objective="time-to-accuracy")
    )
    outcome = run_scenario(RUN, strategy=strategy, devices=DEVICES, write=False)
    chosen = set(strategy.choice.members)
    assert not chosen & SLOW
    assert {1000 + p for p in outcome.records[-1].participants} == chosen
    assert len(strategy.selection_log) == 3


def test_reselects_when_a_chosen_node_goes_offline() -> None:
    victim = 3  # the Jetson Nano, the fastest node: always chosen
    # one ClientApp call per message, so that the wrapped ClientApp below runs
    grid = build_fleet_grid(RUN, DEVICES, batch=False)
    client_app = grid.client_app

    def goes_offline_after_round_1(message: Message, context: Context) -> Message:
        config = message.content.config_records.get("config", {})
        if (
            context.node_config["partition-id"] == victim
            and int(config.get("server-round", 0)) >= 2
        ):
            raise NodeDropout("unplugged", silent=True, after_s=0.0)
        return client_app(message, context)

    grid.client_app = goes_offline_after_round_1  # type: ignore[assignment]
    strategy = ClusterSelection(
        strategy=FedAvg(fraction_evaluate=0.0), tracking=Tracking(drop_after_failures=1)
    )
    scenario = Scenario.from_run_config({**RUN, "num-rounds": 4, "round-timeout-s": 30})
    outcome = run_server(grid, scenario, strategy=strategy, write=False)
    log = strategy.selection_log
    assert 1000 + victim in log[0].members
    assert "[1003]" in log[1].event  # round 2: no reply from the Jetson
    assert all(1000 + victim not in r.members for r in log[2:])
    assert 1000 + victim not in strategy.choice.members
    assert len(outcome.records) == 4
    assert outcome.records[-1].participants  # training went on


def test_a_batch_of_node_parameters_is_estimated_as_each_alone() -> None:
    from flowerbed.strategies.cluster_selection.model import estimate_batch

    nodes = [
        [
            NodeModel(0, 0.1 * g, 1.0, 5.0, 2.0, step_var=1e-4, overhead_var=0.01),
            NodeModel(1, 0.3, 0.5 * g, 4.0, None, step_var=4e-4, overhead_var=0.0),
            NodeModel(2, 0.2, 2.0, 6.0 * g, 3.0, step_var=0.0, overhead_var=0.04),
        ]
        for g in (1.0, 1.5)
    ]
    masks = all_masks(3)
    for mode in ("sync", "async"):
        work = Workload(mode=mode, steps=30, num_rounds=10)
        params = [
            np.array([[getattr(n, f) or np.nan for n in row] for row in nodes])
            for f in ("step_s", "overhead_s", "busy_w", "idle_w")
        ]
        v = np.array([n.step_var for n in nodes[0]])
        u = np.array([n.overhead_var for n in nodes[0]])
        batch = estimate_batch(*params, v, u, masks, work)
        for d, row in enumerate(nodes):
            alone = estimate_masks(row, masks, work)
            for name, values in alone.items():
                assert np.array_equal(batch[name][d], values, equal_nan=True)


# --- the bench's evaluation -----------------------------------------------------------


def test_evaluate_selection_returns_the_benchs_structure() -> None:
    result = evaluate_selection(
        num_fleets=3, seed=1, truth_rounds=5, confidence_draws=10
    )
    assert result["num_fleets"] == 3
    assert len(result["fleet_sizes"]) == 3
    assert all(2 <= n <= 12 for n in result["fleet_sizes"])
    assert sum(result["device_counts"].values()) == sum(result["fleet_sizes"])
    assert set(result["objectives"]) == set(OBJECTIVES)
    for figures in result["objectives"].values():
        for key in ("best_fraction", "near_best_fraction", "polynomial_best_fraction"):
            assert figures[key] in (0.0, 1 / 3, 2 / 3, 1.0)
        assert figures["near_best_fraction"] >= figures["best_fraction"]
        assert figures["max_regret_pct"] >= figures["mean_regret_pct"] >= 0
        assert 0 < figures["profiling_overhead_pct"] < 100
    assert result["paper_best_fraction"] == 0.7667


def test_evaluation_shares_fleets_between_settings_and_workers() -> None:
    common = dict(num_fleets=3, seed=1, truth_rounds=5, confidence_draws=10)
    together = evaluate_selection(**common, also=[(0.01, ("energy", "edp"))], jobs=2)
    alone = evaluate_selection(**common)
    meters = evaluate_selection(
        **common, power_gain_error=0.01, objectives=("energy", "edp")
    )
    (also,) = together.pop("also")
    # a second setting on the same fleets, and worker processes, change no figure
    assert alone.pop("also") == []
    assert together == alone
    assert also["power_gain_error"] == 0.01
    assert also["objectives"] == meters["objectives"]
    assert also["profiling"] == meters["profiling"]


def test_evaluation_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="num_fleets must be >= 1"):
        evaluate_selection(num_fleets=0)
    with pytest.raises(ValueError, match="valid choices: time"):
        evaluate_selection(num_fleets=1, objectives=["speed"])
