"""ClusterSelection under noise: expected round time, variances, confidence, profiling.

Hand-computed expectations:

- The largest of 2 and 3 independent standard normals has mean 1/sqrt(pi) =
  0.564190 and 1.5/sqrt(pi) = 0.846284 (David and Nagaraja, Order Statistics,
  table of normal order statistics), so two members with task time
  Normal(0.8, 0.1^2) take 0.8 + 0.0564190 per round in expectation.
- Fit, tasks of 1 and 3 steps with train times 0.12 and 0.28 s and 0.5 and 0.7 s
  outside compute: s = 0.4 / 4 = 0.1; v = (0.02^2 / 1 + 0.02^2 / 3) / 1 =
  0.000533; se(s) = sqrt(v / 4) = 0.011547; c = 1.2 / 2 = 0.6; u = sample
  variance of (0.5, 0.7) = 0.02; se(c) = sqrt(0.02 / 2) = 0.1.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from flowerbed.bench.selection_eval import evaluate_selection
from flowerbed.models import build_model, model_num_bytes
from flowerbed.sims.devices import DEVICES as CATALOGUE
from flowerbed.sims.scenario import build_fleet_grid
from flowerbed.sims.vclock import transfer_seconds
from flowerbed.strategies.cluster_selection import (
    Certainty,
    ClusterSelection,
    NodeModel,
    Observation,
    Profiling,
    Workload,
    all_masks,
    confidence,
    estimate,
    expected_max,
    expected_round_trip,
    fit_node,
    profiling_end,
    select,
)
from flwr.app import ArrayRecord, ConfigRecord
from test_cluster_selection import DEVICES, SYNC, random_nodes
from test_cluster_selection import RUN as ENGINE_RUN

pytestmark = pytest.mark.usefixtures("quiet_single_threaded")


# --- the expected maximum -------------------------------------------------------------


def test_expected_max_of_identical_normals_is_the_order_statistic() -> None:
    masks = np.array([[1, 1, 0], [1, 1, 1], [0, 1, 0]], dtype=bool)
    mu = np.array([1.0, 1.0, 1.0])
    sd = np.array([0.1, 0.1, 0.1])
    got = expected_max(mu, sd, masks)
    assert got == pytest.approx([1.0564190, 1.0846284, 1.0], abs=2e-6)


def test_expected_max_without_jitter_is_the_slowest_mean() -> None:
    masks = np.array([[1, 1, 1], [1, 0, 1]], dtype=bool)
    got = expected_max(np.array([1.0, 2.0, 0.5]), np.zeros(3), masks)
    assert got == pytest.approx([2.0, 1.0], rel=1e-5)


def test_expected_max_of_two_normals_matches_clarks_closed_form() -> None:
    # Clark (1961): E max(X1, X2) = m1 Phi(a) + m2 Phi(-a) + t phi(a),
    # t = sqrt(s1^2 + s2^2), a = (m1 - m2) / t. m = (1.0, 0.9), s = (0.1, 0.2):
    # t = 0.223607, a = 0.447214, Phi(a) = 0.672640, phi(a) = 0.360978
    # -> 0.672640 + 0.9 x 0.327360 + 0.223607 x 0.360978 = 1.047981.
    got = expected_max(
        np.array([1.0, 0.9]), np.array([0.1, 0.2]), np.ones((1, 2), bool)
    )
    assert got[0] == pytest.approx(1.047981, abs=2e-6)


def test_jitter_makes_a_round_slower_than_its_slowest_mean() -> None:
    # A and B both take 0.8 s for 3 steps (see test_cluster_selection.py); with
    # overhead sd 0.1 s each the round takes 0.8 + 0.1 / sqrt(pi) = 0.856419 s.
    # Energy: 4 x 0.3 + 1 x (0.856419 - 0.3) + 2 x 0.6 + 0.5 x (0.856419 - 0.6)
    # = 3.084629 J per round.
    a = NodeModel(0, 0.1, 0.5, 4.0, 1.0, overhead_var=0.01)
    b = NodeModel(1, 0.2, 0.2, 2.0, 0.5, overhead_var=0.01)
    est = estimate([a, b], (0, 1), SYNC)
    assert est.round_s == pytest.approx(0.856419, abs=2e-6)
    assert est.time_s == pytest.approx(8.56419, abs=2e-5)
    assert est.energy_j == pytest.approx(30.84629, abs=2e-4)
    # Alone, A's round is its mean: jitter adds nothing without a maximum.
    assert estimate([a, b], (0,), SYNC).round_s == pytest.approx(1.1, rel=1e-5)


def test_a_jittery_pair_loses_to_a_steady_pair_with_a_higher_mean() -> None:
    # Two steps per round, at least two members, so every member takes 1 step.
    # Steady C, D: 0.75 + 0.25 = 1.0 s. Jittery E, F: 0.7 + 0.25 = 0.95 s, sd 0.2.
    # The slowest mean would pick {E, F} (0.95 < 1.0); the expected maximum is
    # 0.95 + 0.2 / sqrt(pi) = 1.0628 for {E, F} and 1.0 for {C, D}.
    steady = [NodeModel(i, 0.25, 0.75) for i in (0, 1)]
    jittery = [NodeModel(i, 0.25, 0.7, overhead_var=0.04) for i in (2, 3)]
    two = Workload(mode="sync", steps=2, num_rounds=1)
    # Trapezoidal rule on a non-uniform grid: within 5e-4 sd (1e-4 s here).
    assert estimate(steady + jittery, (2, 3), two).round_s == pytest.approx(
        1.062838, abs=1e-4
    )
    assert select(steady + jittery, two, "time", min_size=2).members == (0, 1)


# --- fitting variances ----------------------------------------------------------------


def test_fit_estimates_step_and_overhead_variance_from_all_samples() -> None:
    model = fit_node(
        3,
        [
            Observation(steps=1, round_trip_s=0.62, train_time_s=0.12, comm_time_s=0.5),
            Observation(steps=3, round_trip_s=0.98, train_time_s=0.28, comm_time_s=0.7),
        ],
    )
    assert model.step_s == pytest.approx(0.1)
    assert model.step_var == pytest.approx(0.0016 / 3)
    assert model.step_se == pytest.approx(math.sqrt(0.0016 / 12))
    assert model.overhead_s == pytest.approx(0.6)
    assert model.overhead_var == pytest.approx(0.02)
    assert model.overhead_se == pytest.approx(0.1)
    assert model.tasks == 2
    # A task of 4 steps: mean 0.6 + 0.4, variance 0.02 + 4 x 0.000533.
    mean, sd = model.task_mean_sd(4)
    assert (mean, sd) == pytest.approx((1.0, math.sqrt(0.02 + 0.0064 / 3)))


def test_one_task_leaves_the_variances_unknown() -> None:
    model = fit_node(
        1, [Observation(steps=2, round_trip_s=0.7, train_time_s=0.2, comm_time_s=0.5)]
    )
    assert (model.step_var, model.overhead_var) == (0.0, 0.0)


def test_a_query_times_compute_but_not_the_upload() -> None:
    # The query (one transfer, 0.1 s) would make c = 0.2; the training tasks'
    # two transfers took 0.5 and 0.7 s, so c = 0.6; compute uses all three.
    model = fit_node(
        1,
        [
            Observation(
                steps=3,
                round_trip_s=0.4,
                train_time_s=0.3,
                comm_time_s=0.1,
                transfers=1,
            ),
            Observation(steps=1, round_trip_s=0.6, train_time_s=0.1, comm_time_s=0.5),
            Observation(steps=3, round_trip_s=1.0, train_time_s=0.3, comm_time_s=0.7),
        ],
    )
    assert model.overhead_s == pytest.approx(0.6)
    assert model.overhead_var == pytest.approx(0.02)
    assert model.step_s == pytest.approx(0.1)
    assert model.tasks == 3


# --- search under jitter --------------------------------------------------------------


def test_prefix_search_is_exact_for_time_when_task_times_are_ordered() -> None:
    # Equal overhead variance and no step variance: every node's task time is its
    # mean plus the same noise, so they are stochastically ordered by the mean.
    rng = np.random.default_rng(5)
    for trial in range(25):
        nodes = random_nodes(rng, lambda rng: {"overhead_var": 0.01})
        workload = Workload(steps=int(rng.integers(1, 60)), num_rounds=10)
        full = select(nodes, workload, "time", search="exhaustive")
        fast = select(nodes, workload, "time", search="polynomial")
        assert fast.time_s == pytest.approx(full.time_s), trial


# --- confidence -----------------------------------------------------------------------


def test_confidence_is_certain_for_a_clear_winner() -> None:
    fast = NodeModel(0, 0.1, 0.1, step_se=0.001, overhead_se=0.001)
    slow = NodeModel(1, 1.0, 1.0, step_se=0.001, overhead_se=0.001)
    one = Workload(steps=1, num_rounds=1)
    sure = confidence([fast, slow], one, "time", all_masks(2), draws=50)["time"]
    # {0}: 0.2 s; {1} and {0, 1}: 2.0 s, nine times slower.
    assert sure.probability == 1.0
    assert sure.gap == pytest.approx(9.0)
    assert not sure.within_uncertainty


def test_confidence_flags_a_tie_within_the_uncertainty() -> None:
    # Two identical nodes, one step per round: {0} and {1} tie exactly and a
    # pair is slower (a maximum), so each single node wins about half the draws.
    twin = [NodeModel(i, 0.1, 0.1, step_se=0.01, overhead_se=0.01) for i in (0, 1)]
    one = Workload(steps=1, num_rounds=1)
    sure = confidence(twin, one, "time", all_masks(2), draws=200, seed=1)["time"]
    assert 0.3 < sure.probability < 0.7
    assert sure.gap == pytest.approx(0.0)
    assert sure.within_uncertainty
    assert sure.rivals == ((1,),)


def test_power_gain_error_makes_energy_less_certain() -> None:
    # Energy per job: node 0 4 x 0.6 + 1 x 0.5 = 2.9 J, node 1 2.5 J (see
    # test_cluster_selection.py): 16% apart. Exact timings, so only the power
    # sensors' gain error can reorder them.
    a = NodeModel(0, 0.1, 0.5, 4.0, 1.0)
    b = NodeModel(1, 0.2, 0.2, 2.0, 0.5)
    masks = np.array([[1, 0], [0, 1]], dtype=bool)
    exact = confidence([a, b], SYNC, "energy", masks, draws=100)["energy"]
    noisy = confidence([a, b], SYNC, "energy", masks, power_gain_error=0.2, draws=100)[
        "energy"
    ]
    assert exact.probability == 1.0
    assert noisy.probability < 1.0


# --- adaptive profiling on the engine -------------------------------------------------

RUN = {**ENGINE_RUN, "num-rounds": 1}


def _profile(strategy: ClusterSelection) -> dict[int, NodeModel]:
    grid = build_fleet_grid(RUN, DEVICES)
    return strategy.profile(
        grid,
        ArrayRecord(build_model("lenet", 1, 8, 10).state_dict()),
        ConfigRecord({"local-steps": 4, "batch-size": 16}),
    )


def test_fast_nodes_keep_profiling_while_the_slowest_finishes() -> None:
    models = _profile(ClusterSelection(profiling=Profiling(profile_max_tasks=6)))
    # Every node: one query, then training tasks of 1 and 3 steps; the slowest
    # (the low-end phone, 0.18 s of transfers) runs just those two.
    assert models[1000].tasks == 1 + 2
    # The Jetson (1.5 ms of transfers) repeats them up to the cap.
    assert models[1003].tasks == 1 + 6
    assert all(m.tasks >= 3 for m in models.values())


def test_profiling_lasts_as_long_as_the_slowest_nodes_own_tasks() -> None:
    # The low-end phone: its query (download + 3 steps), then its tasks of 1
    # and 3 steps (each c = download + upload, plus compute); nobody else's
    # repeats may outlast it.
    strategy = ClusterSelection()
    phone = _profile(strategy)[1000]
    down = transfer_seconds(
        model_num_bytes(build_model("lenet", 1, 8, 10)),
        CATALOGUE["low-end-phone"].downlink_mbps,
    )
    slowest = (down + 3 * phone.step_s) + 2 * phone.overhead_s + 4 * phone.step_s
    assert strategy.profile_s == pytest.approx(slowest, rel=1e-9)


def test_expected_round_trip_and_projected_end_by_hand() -> None:
    # Tasks of 1 and 3 steps: round trips 0.62 and 0.98 s, train 0.12 and 0.28 s:
    # s = 0.1, outside compute (0.52 + 0.68) / 2 = 0.6; 2 steps -> 0.8 s.
    seen = [
        Observation(steps=1, round_trip_s=0.62, train_time_s=0.12),
        Observation(steps=3, round_trip_s=0.98, train_time_s=0.28),
    ]
    assert expected_round_trip(seen, 2) == pytest.approx(0.8)
    assert expected_round_trip([], 2) == math.inf
    # X: started at 1.0, owes a 3-step task: 1.0 + 0.9 = 1.9. Y: started at
    # 0.5, owes 1 and 3 steps: 0.5 + 0.7 + 0.9 = 2.1. Z has no reply yet.
    x, y = (1.0, [3], seen), (0.5, [1, 3], seen)
    assert profiling_end([x, y]) == pytest.approx(2.1)
    assert profiling_end([x, (0.0, [1], [])]) == math.inf


def test_profile_max_tasks_caps_the_repeats() -> None:
    models = _profile(ClusterSelection(profiling=Profiling(profile_max_tasks=2)))
    assert {m.tasks for m in models.values()} == {3}


def test_selection_records_its_confidence() -> None:
    strategy = ClusterSelection(certainty=Certainty(confidence_draws=20))
    grid = build_fleet_grid(RUN, DEVICES)
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(build_model("lenet", 1, 8, 10).state_dict()),
        num_rounds=1,
        train_config=ConfigRecord({"local-steps": 4, "batch-size": 16}),
    )
    assert strategy.confidence is not None
    assert 0.0 <= strategy.confidence.probability <= 1.0


def test_bad_profiling_and_confidence_settings_are_named() -> None:
    with pytest.raises(ValueError, match="profile_max_tasks must be >= len"):
        ClusterSelection(profiling=Profiling(profile_max_tasks=1))
    with pytest.raises(ValueError, match="confidence_draws must be >= 2"):
        ClusterSelection(certainty=Certainty(confidence_draws=1))
    with pytest.raises(ValueError, match="power_gain_error must be >= 0"):
        ClusterSelection(certainty=Certainty(power_gain_error=-0.1))


# --- the evaluation's new figures -----------------------------------------------------


def test_evaluation_reports_oracle_confidence_and_profiling() -> None:
    result = evaluate_selection(
        num_fleets=2, seed=4, truth_rounds=3, confidence_draws=10
    )
    profiling = result["profiling"]
    assert profiling["probe_min_tasks_per_node"] == 2  # the slowest runs (1, 3) once
    assert profiling["probe_max_tasks_per_node"] <= 32
    assert result["setup"]["profile_max_tasks"] == 32
    assert result["noise"]["network_jitter"] == 0.20
    for figures in result["objectives"].values():
        assert 0.0 <= figures["mean_confidence"] <= 1.0
        assert figures["oracle_best_fraction"] in (0.0, 0.5, 1.0)
        assert 0.0 <= figures["within_uncertainty_fraction"] <= 1.0


def test_without_noise_the_oracle_and_the_selection_agree_and_are_sure() -> None:
    # With no noise the profile sees the virtual clock's exact costs.
    result = evaluate_selection(
        num_fleets=4,
        seed=2,
        step_jitter=0.0,
        network_jitter=0.0,
        power_gain_error=0.0,
        power_noise=0.0,
        truth_rounds=2,
        confidence_draws=10,
    )
    for figures in result["objectives"].values():
        assert figures["best_fraction"] == 1.0
        assert figures["mean_regret_pct"] == pytest.approx(0.0, abs=1e-9)
        assert figures["oracle_best_fraction"] == 1.0
