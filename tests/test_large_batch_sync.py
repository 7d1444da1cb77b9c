"""LargeBatchSync on real local processes: shares by speed, a member lost mid-segment.

A :class:`ProcessGrid` runs the board ClientApp (``flowerbed.clients.span_app``)
in three worker processes with emulated speeds (node 1 twice as fast as the
others); one is killed while the first segment runs: the segment fails fast and
the next re-forms without it from the last weights.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
from flowerbed.models import build_sequential
from flowerbed.parallel.group import free_port
from flowerbed.sims.process_grid import ProcessGrid
from flowerbed.strategies import LargeBatchSync
from flowerbed.strategies.large_batch_options import AllReduceRecipe, MemberProfiling
from flwr.app import ArrayRecord

HOST = "127.0.0.1"
MODEL_ARGS = {"hidden": 16, "depth": 3}
# deep-mlp(16, 3) on one digit: 64*16 + 16*16 + 16*16 + 16*10 = 1,696 MACs,
# ~10 kFLOP with backward; a step of batch 16 split 2:1:1 is then ~0.8 s of
# emulated compute (a floor: emulation sleeps when the host is faster)
GFLOPS = [1e-4, 5e-5, 5e-5]
RECIPE = AllReduceRecipe(optimizer="lars", base_lr=0.5, base_batch=16, trust=0.02)


def strategy(**changes: object) -> LargeBatchSync:
    options: dict = {
        "fraction_evaluate": 0.0,
        "min_train_nodes": 2,
        "min_available_nodes": 3,
        "model": "deep-mlp",
        "model_args": MODEL_ARGS,
        "dataset": "digits",
        "batch_size": 16,
        "steps_per_round": 6,
        "recipe": RECIPE,
        "rendezvous_port": free_port(),
        "rendezvous_ports": 7,
        "join_timeout_s": 20.0,
        "timeout_s": 10.0,
        "reply_margin_s": 3.0,
        "profiling": MemberProfiling(query_timeout_s=60.0),
    }
    options.update(changes)
    return LargeBatchSync(**options)


def initial() -> ArrayRecord:
    return ArrayRecord(build_sequential("deep-mlp", MODEL_ARGS, seed=1).state_dict())


def test_plans_share_the_batch_by_measured_speed() -> None:
    s = strategy()
    s.speeds = {1: 200.0, 2: 100.0, 3: 100.0}
    s.addresses = {1: "10.0.0.1", 2: "10.0.0.2", 3: "10.0.0.3"}
    plans = s.plans(s.choose_cohort(), 6)
    assert [plans[n].batch_share for n in (1, 2, 3)] == [(0, 8), (8, 12), (12, 16)]
    assert {p.host for p in plans.values()} == {"10.0.0.1"}  # rank 0 hosts
    assert [plans[n].rank for n in (1, 2, 3)] == [0, 1, 2]
    assert plans[1].options["optimizer"] == "lars"
    s.lost.add(1)
    assert s.choose_cohort() == [2, 3]
    # a batch of 2 takes the two fastest live boards, one sample each
    small = strategy(batch_size=2, recipe=replace(RECIPE, base_batch=2))
    small.speeds = {1: 50.0, 2: 300.0, 3: 100.0}
    small.addresses = s.addresses
    plans = small.plans(small.choose_cohort(), 6)
    assert {n: p.batch_share for n, p in plans.items()} == {2: (0, 1), 3: (1, 2)}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"optimizer": "adam"}, "optimizer 'adam'"),
        ({"compression": "zip"}, "compression 'zip'"),
        ({"steps_per_round": 0}, "steps_per_round must be >= 1"),
        ({"base_lr": -1.0}, "base_lr must be a finite number > 0"),
        ({"batch_size": 1}, r"batch_size 1 cannot give min_train_nodes \(2\)"),
    ],
)
def test_bad_settings_are_named(changes: dict, message: str) -> None:
    recipe = {k: changes.pop(k) for k in list(changes) if k in RECIPE.__dict__}
    with pytest.raises(ValueError, match=message):
        strategy(recipe=replace(RECIPE, **recipe), **changes)


def test_the_flat_keywords_of_a_release_ago_still_work_and_warn() -> None:
    with pytest.warns(DeprecationWarning, match=r"recipe=AllReduceRecipe\("):
        old = LargeBatchSync(optimizer="lars", base_lr=0.5, base_batch=16, trust=0.02)
    assert old.recipe == RECIPE and old.schedule == RECIPE.schedule(256)
    with pytest.warns(DeprecationWarning, match=r"profiling=MemberProfiling\("):
        old = LargeBatchSync(profile_batch=4, speed_smoothing=0.25)
    assert old.profiling == MemberProfiling(profile_batch=4, speed_smoothing=0.25)
    with pytest.raises(TypeError, match="put them in the AllReduceRecipe"):
        LargeBatchSync(recipe=RECIPE, base_lr=0.1)


def test_initial_arrays_of_another_model_are_refused_before_anything_runs() -> None:
    other = ArrayRecord(
        build_sequential("deep-mlp", {"hidden": 8, "depth": 3}, seed=1).state_dict()
    )
    with pytest.raises(ValueError, match=r"initial array '1\.0\.weight' has shape"):
        strategy().start(None, other)  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_member_lost_mid_segment_and_the_next_segment_goes_on_without_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    configs = [{"address": HOST, "emulate-gflops": g} for g in GFLOPS]
    with ProcessGrid(
        "flowerbed.clients.span_app:app", configs, unavailable_after_s=2.0
    ) as grid:
        # a survivor may learn of the loss only at timeout_s (10 s) and then
        # leave its group: 6 s for that and Flower's reply path under load
        s = strategy(fraction_evaluate=1.0, min_evaluate_nodes=2, reply_margin_s=6.0)
        victim = 3

        def kill_mid_segment() -> None:
            while not s._plans:  # the first segment's plans are out
                time.sleep(0.05)
            # Its 6 steps take at least ~4.9 s of emulated compute, however idle
            # the host: 2 s in, the segment is joining or training, never done
            # (a fixed 4 s killed after the segment on an idle machine).
            time.sleep(2.0)
            grid.kill(victim)

        killer = threading.Thread(target=kill_mid_segment, daemon=True)
        killer.start()
        start = initial()
        with caplog.at_level(logging.WARNING, logger="flwr"):
            result = s.start(grid, start, num_rounds=2, timeout=120)
        killer.join(1)
    assert s.lost == {victim}
    # Every failed segment is logged and retried; the victim's loss is one of
    # them. Others (a rendezvous port found in use, a join that timed out on a
    # busy machine) drop no member and are correct retries.
    segment_failed = re.compile(r"round (\d+): segment \d+ failed \(lost \[([\d, ]*)\]")
    found = (segment_failed.match(r.getMessage()) for r in caplog.records)
    failed = [(int(m[1]), m[2]) for m in found if m]
    assert [r for r, lost in failed if lost] == [1], failed
    assert [lost for _, lost in failed if lost] == [str(victim)], failed
    first, second = result.train_metrics_clientapp[1], result.train_metrics_clientapp[2]
    assert first["attempts"] == 1 + sum(r == 1 for r, _ in failed), failed
    assert second["attempts"] == 1 + sum(r == 2 for r, _ in failed), failed
    assert first["members"] == 2 and second["members"] == 2
    assert first["replica-max-diff"] == 0.0
    assert s.step == 12
    moved = [
        not np.array_equal(result.arrays[k].numpy(), start[k].numpy()) for k in start
    ]
    assert all(moved)
    # the survivors evaluate the whole model on digits' test split
    evaluated = result.evaluate_metrics_clientapp[2]
    assert 0.0 <= evaluated["eval-acc"] <= 1.0
    assert evaluated["eval-loss"] > 0
    # node 1 is twice as fast: twice the share once speeds are measured
    shares = {n: p.batch_share[1] - p.batch_share[0] for n, p in s._plans.items()}
    assert shares[1] > shares[2]
