"""ClusterSelection's refinement: pooled variances, who to rehearse, the budget.

Hand-computed expectations:

- Pooled variances (Smyth 2004): node A has relative step variance 0.04 on 1
  degree of freedom, node B 0.01 on 3. The prior is (0.04 + 3 x 0.01) / 4 =
  0.0175; with d0 = 4, A's moderated variance is (4 x 0.0175 + 0.04) / 5 =
  0.022 and B's (4 x 0.0175 + 3 x 0.01) / 7 = 0.0142857.
- Rehearsal steps: a node of 0.02 s per step and 0.5 s of transfers runs at
  least ceil(0.5 / 0.02) = 25 steps; in a 2-node configuration of a 100-step
  round it runs the member's 50.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable

import numpy as np
import pytest
from flowerbed import keys
from flowerbed.bench.selection_eval import evaluate_selection
from flowerbed.grid import GridWrapper
from flowerbed.models import build_model
from flowerbed.sims.scenario import build_fleet_grid
from flowerbed.strategies.cluster_selection import (
    RACE_GREEDY_EVERY,
    Certainty,
    ClusterSelection,
    NodeModel,
    Observation,
    RaceState,
    SelectionGoal,
    Workload,
    all_masks,
    confidence,
    fit_node,
    informative_nodes,
    pool_variances,
    race_next,
    rehearsal_steps,
    settled_confidence,
)
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType

SYNC = Workload(mode="sync", steps=100, num_rounds=100, kappa=1.0)


pytestmark = pytest.mark.usefixtures("quiet_single_threaded")


def test_pooled_variances_by_hand() -> None:
    a = NodeModel(0, 1.0, 0.0, step_var=0.04, steps=4, step_dof=1)
    b = NodeModel(1, 2.0, 0.0, step_var=0.04, steps=16, step_dof=3)
    pa, pb = pool_variances([a, b])
    assert pa.step_var == pytest.approx(0.022)
    assert pa.step_se == pytest.approx(math.sqrt(0.022 / 4))
    assert pb.step_var == pytest.approx(0.0142857 * 4, rel=1e-5)
    assert pb.step_se == pytest.approx(math.sqrt(0.0142857 * 4 / 16), rel=1e-5)


def test_a_node_without_a_variance_of_its_own_takes_the_fleets() -> None:
    lone = NodeModel(0, 1.0, 0.0, steps=3, step_dof=0)
    other = NodeModel(1, 2.0, 0.0, step_var=0.16, steps=8, step_dof=2)
    pooled, _ = pool_variances([lone, other])
    assert pooled.step_var == pytest.approx(0.04)  # the fleet's 4%, at 1 s/step
    untouched = pool_variances([lone])
    assert untouched[0].step_var == 0.0


def test_fit_records_what_the_pooling_needs() -> None:
    seen = [
        Observation(steps=1, round_trip_s=0.62, train_time_s=0.12, energy_j=1.0),
        Observation(steps=3, round_trip_s=0.98, train_time_s=0.28, energy_j=1.9),
        Observation(steps=3, round_trip_s=1.0, train_time_s=0.3, energy_j=2.0),
    ]
    m = fit_node(0, seen)
    assert (m.steps, m.step_dof, m.transfers, m.overhead_dof) == (7, 2, 6, 2)
    assert m.power_dof == 1 and m.power_rel_var > 0
    assert m.power_cov[0] > 0 and m.power_cov[2] > 0


def test_rehearsal_steps_by_hand() -> None:
    phone = NodeModel(0, 0.02, 0.5)
    assert rehearsal_steps(phone, SYNC, 2) == 50
    assert rehearsal_steps(phone, SYNC, 10) == 25


def test_informative_nodes_are_those_the_choice_hinges_on() -> None:
    # Two near-identical candidates for the last seat (1 and 2) beside a fixed,
    # much faster pair; node 3 is far too slow to matter.
    nodes = [
        NodeModel(0, 0.010, 0.1, step_se=1e-5, overhead_se=1e-3, step_var=1e-6),
        NodeModel(1, 0.030, 0.1, step_se=3e-3, overhead_se=1e-2, step_var=1e-6),
        NodeModel(2, 0.031, 0.1, step_se=3e-3, overhead_se=1e-2, step_var=1e-6),
        NodeModel(3, 1.000, 0.1, step_se=1e-1, overhead_se=1e-2, step_var=1e-6),
    ]
    masks = all_masks(4)
    sure = confidence(nodes, SYNC, "time", masks, draws=200)["time"]
    assert sure.probability < 0.99
    chosen = informative_nodes(nodes, SYNC, "time", sure)
    assert 3 not in chosen
    assert {1, 2} & set(chosen)


def test_twins_are_settled_by_the_indifference_zone() -> None:
    twins = [NodeModel(i, 0.1, 0.1, step_se=0.001, overhead_se=0.001) for i in (0, 1)]
    masks = np.array([[True, False], [False, True]])  # one of the two
    strict = confidence(twins, SYNC, "time", masks, draws=200, indifference=0.0)
    loose = confidence(twins, SYNC, "time", masks, draws=200, indifference=0.05)
    assert strict["time"].near_probability == strict["time"].probability
    assert strict["time"].probability < 0.9
    assert loose["time"].near_probability == 1.0


def test_race_next_alternates_within_its_budget_and_settles_when_sure() -> None:
    twins = [NodeModel(i, 0.1, 0.1, step_se=0.01, overhead_se=0.01) for i in (0, 1)]
    masks = np.array([[True, False], [False, True]])
    state = RaceState(budget=2)
    runs = []
    for _ in range(6):
        choice, run = race_next(twins, SYNC, "time", masks, state, draws=50)
        runs.append(run != choice)
        state.tick()
    # rival, choice, rival, then the budget is spent: the choice only
    assert runs == [True, False, True, False, False, False]
    assert state.explored == 2 and not state.settled
    clear = [NodeModel(0, 0.1, 0.1), NodeModel(1, 0.5, 0.1)]
    state = RaceState(budget=5)
    choice, run = race_next(clear, SYNC, "time", masks, state, draws=50)
    assert choice == run == (0,)
    assert state.settled and not state.tick()


def test_after_its_budget_racing_looks_again_every_few_rounds() -> None:
    state = RaceState(budget=0)
    due = [state.tick() for _ in range(10)]
    assert due == [i % RACE_GREEDY_EVERY == 0 for i in range(1, 11)]


def test_a_confidence_at_the_target_is_confirmed_with_more_draws() -> None:
    # A near tie: 100 draws may read >= 90%, the confirmation uses 1,000.
    nodes = [
        NodeModel(0, 0.100, 0.1, step_se=0.004, overhead_se=0.001),
        NodeModel(1, 0.103, 0.1, step_se=0.004, overhead_se=0.001),
    ]
    masks = np.array([[True, False], [False, True]])
    quick = confidence(nodes, SYNC, "time", masks, draws=100)["time"]
    sure = settled_confidence(
        nodes,
        SYNC,
        "time",
        masks,
        target=0.5,
        indifference=0.0,
        draws=100,
        seed=0,
    )
    assert quick.probability >= 0.5
    assert sure.near_probability != quick.near_probability  # re-estimated
    assert abs(sure.near_probability - quick.near_probability) < 0.1
    below = settled_confidence(
        nodes, SYNC, "time", masks, target=0.999, indifference=0.0, draws=100, seed=0
    )
    assert below.near_probability == quick.near_probability  # not confirmed


# --- refinement on the engine, with jittered reports ---------------------------------

RUN = {
    "dataset": "digits",
    "model": "lenet",
    "local-steps": 4,
    "batch-size": 16,
    "num-rounds": 1,
    "dropout": 0.0,
    "seed": 3,
}
# Three units of one board: for energy, every pair ties (the same steps, less
# idle transfer time than all three), so only the jittered fits tell them apart.
DEVICES = ["rpi4b", "rpi4b", "rpi4b"]


class JitteredReports(GridWrapper):
    """Scales each reply's train-time-s by a seeded lognormal factor (10%).

    The in-process engine's virtual clock has no jitter of its own; this gives
    the fits variances, as real devices do. Records every train message.
    """

    def __init__(self, inner: object) -> None:
        super().__init__(inner)  # type: ignore[arg-type]
        self.rng = np.random.default_rng(0)
        self.trains: list[tuple[int, int]] = []

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        for m in messages:
            if m.metadata.message_type == MessageType.TRAIN:
                config = m.content.config_records[keys.CONFIG]
                self.trains.append(
                    (m.metadata.dst_node_id, int(config[keys.LOCAL_STEPS]))
                )
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = list(self.inner.pull_messages(message_ids))
        for reply in replies:
            if reply.has_error():
                continue
            for record in reply.content.metric_records.values():
                if keys.TRAIN_TIME_S in record:
                    factor = math.exp(0.1 * self.rng.standard_normal() - 0.005)
                    seconds = float(record[keys.TRAIN_TIME_S]) * factor
                    record[keys.TRAIN_TIME_S] = seconds
        return replies


def _run(strategy: ClusterSelection, num_rounds: int = 2) -> JitteredReports:
    grid = JitteredReports(build_fleet_grid(RUN, DEVICES))
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(build_model("lenet", 1, 8, 10).state_dict()),
        num_rounds=num_rounds,
        train_config=ConfigRecord({"local-steps": 4, "batch-size": 16}),
    )
    return grid


def test_refinement_rehearses_the_deciding_nodes_within_its_budget() -> None:
    off = ClusterSelection(
        goal=SelectionGoal(objective="energy"),
        certainty=Certainty(profile_budget=0.0, confidence_draws=50),
    )
    _run(off)
    assert off.refine_batches == 0
    strategy = ClusterSelection(
        goal=SelectionGoal(objective="energy"),
        certainty=Certainty(
            profile_budget=10.0, target_confidence=0.999, confidence_draws=50
        ),
    )
    grid = _run(strategy)
    assert strategy.refine_batches > 0
    probe = ClusterSelection(
        goal=SelectionGoal(objective="energy"),
        certainty=Certainty(profile_budget=0.0, confidence_draws=50),
    )
    probe_grid = _run(probe)
    rehearsals = grid.trains[: len(grid.trains) - 2 * 2]
    probes = probe_grid.trains[: len(probe_grid.trains) - 2 * 2]
    extra = rehearsals[len(probes) :]
    assert extra, "refinement sent no rehearsal"
    workload = strategy.workload(ConfigRecord({"local-steps": 4}), 2, 3)
    assert all(
        steps >= workload.member_steps(2) for _, steps in extra
    )  # a rehearsal is at least a pair member's task
    assert strategy.profile_s > probe.profile_s


def test_refinement_respects_its_budget() -> None:
    strategy = ClusterSelection(
        goal=SelectionGoal(objective="energy"),
        certainty=Certainty(
            profile_budget=0.05, target_confidence=1.0, confidence_draws=50
        ),
    )
    _run(strategy)
    assert strategy.choice is not None
    job = strategy.choice.time_s
    assert strategy.profile_s <= 0.05 * job or strategy.refine_batches == 0


def test_racing_trains_rounds_on_the_rival_and_learns_from_them() -> None:
    strategy = ClusterSelection(
        goal=SelectionGoal(objective="energy"),
        certainty=Certainty(
            profile_budget=0.0,
            target_confidence=0.999,
            race_share=0.5,
            confidence_draws=50,
        ),
    )
    _run(strategy, num_rounds=6)
    log = strategy.selection_log
    raced = [r for r in log if r.event == "racing: a round on a rival"]
    assert raced, "no round went to a rival"
    assert len(raced) <= 3  # race_share 0.5 of 6 rounds
    # every other round at most: no two rival rounds in a row
    flags = [r.event == "racing: a round on a rival" for r in log]
    assert not any(a and b for a, b in itertools.pairwise(flags))
    # the rounds' replies joined the fits: more samples than profiling alone took
    still = ClusterSelection(
        goal=SelectionGoal(objective="energy"),
        certainty=Certainty(profile_budget=0.0, race_share=0.0, confidence_draws=50),
    )
    _run(still, num_rounds=6)
    total = sum(m.tasks for m in strategy.node_models.values())
    assert total > sum(m.tasks for m in still.node_models.values())


def test_without_racing_every_round_runs_on_the_choice() -> None:
    strategy = ClusterSelection(
        goal=SelectionGoal(objective="energy"),
        certainty=Certainty(profile_budget=0.0, race_share=0.0, confidence_draws=50),
    )
    _run(strategy, num_rounds=4)
    members = {r.members for r in strategy.selection_log}
    assert len(members) == 1
    assert all(r.event == "" for r in strategy.selection_log)


def test_bad_refinement_settings_are_named() -> None:
    with pytest.raises(ValueError, match="target_confidence must be between 0 and 1"):
        ClusterSelection(certainty=Certainty(target_confidence=1.5))
    with pytest.raises(ValueError, match="profile_budget must be >= 0"):
        ClusterSelection(certainty=Certainty(profile_budget=-0.1))
    with pytest.raises(ValueError, match="indifference must be >= 0"):
        ClusterSelection(certainty=Certainty(indifference=-0.01))
    with pytest.raises(ValueError, match="race_share must be between 0 and 1"):
        ClusterSelection(certainty=Certainty(race_share=2.0))


def test_evaluation_refines_only_with_a_budget() -> None:
    common = dict(num_fleets=2, seed=1, truth_rounds=3, confidence_draws=10)
    none = evaluate_selection(profile_budget=0.0, **common)
    some = evaluate_selection(profile_budget=0.5, **common)
    for o in none["objectives"]:
        assert none["objectives"][o]["refinement_mean_batches"] == 0
    assert any(v["refinement_mean_batches"] > 0 for v in some["objectives"].values())
    assert none["setup"]["profile_budget"] == 0.0
