"""LargeBatchSync on the in-process engine: the DDP step code on the virtual clock."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flowerbed.parallel.emulation import DeviceSpeed
from flowerbed.parallel.large_batch.allreduce import run_group
from flowerbed.parallel.member import MemberContext
from flowerbed.parallel.plan import MemberPlan, PlanError
from flowerbed.sims.links import SwitchedEthernet, WifiMedium
from flowerbed.sims.span_sim import SegmentRunner, node_config, simulate, span_grid
from flowerbed.strategies import LargeBatchSync
from flowerbed.strategies.large_batch_options import AllReduceRecipe, MemberProfiling
from flwr.app import Array
from plans import member_plan
from test_large_batch_ddp import SHARES, initial, one_large_batch, plan_of

ARGS = {"hidden": 16, "depth": 2}
MACS = 64 * 16 + 16 * 16 + 16 * 10
"""Forward multiply-accumulates of one 8x8 digit through deep-mlp(16, 2)."""
PARAM_BYTES = 4 * ((64 * 16 + 16) + (16 * 16 + 16) + (16 * 10 + 10))
GIGABIT_GOODPUT = 1000e6 * 1448 / 1538
"""TCP goodput of a gigabit port, bit/s (sims/links.py: 1448 of 1538 wire bytes)."""
LATENCY = 100e-6


def member(gflops: float = 1.0) -> MemberContext:
    return MemberContext(
        address="127.0.0.1",
        store_root=Path("/nonexistent"),
        speed=DeviceSpeed(gflops * 1e9),
    )


def strategy(**changes: object) -> LargeBatchSync:
    settings: dict = {
        "model": "deep-mlp",
        "model_args": ARGS,
        "dataset": "digits",
        "batch_size": 24,
        "steps_per_round": 3,
        "recipe": AllReduceRecipe(optimizer="sgd", base_lr=0.05, base_batch=24),
        "fraction_evaluate": 0.0,
    }
    settings.update(changes)
    return LargeBatchSync(**settings)


def test_the_in_process_group_equals_one_batch_of_their_sum() -> None:
    """run_group (the simulator's) against the hand-written single-process
    reference of the DDP test: the same 3 steps of one batch of 12."""
    plans = [plan_of(rank, 1) for rank in range(len(SHARES))]
    run = run_group(plans, member(), initial())
    assert run.steps == 3 and [len(losses) for losses in run.losses] == [3, 3, 3]
    reference = one_large_batch()
    for name, array in reference.items():
        np.testing.assert_allclose(run.arrays[name], array, rtol=1e-5, atol=1e-6)
    # fp16: each contribution travels as float16, half the bytes, close to exact
    half = [p.with_changes(options={**p.options, "compression": "fp16"}) for p in plans]
    run16 = run_group(half, member(), initial())
    assert run16.grad_bytes * 2 == run.grad_bytes
    for name, array in reference.items():
        np.testing.assert_allclose(run16.arrays[name], array, rtol=1e-2, atol=1e-3)


def test_a_broken_group_has_steps_but_no_state() -> None:
    plans = [plan_of(rank, 1) for rank in range(len(SHARES))]
    run = run_group(plans, member(), initial(), stop_step=1)
    assert run.steps == 1 and not run.arrays and not run.optimizer


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda ps: ps[:2], r"ranks \[0, 1\], world size 3"),
        (
            lambda ps: [ps[0], ps[1].with_changes(batch_share=(3, 6)), ps[2]],
            r"batch_share \(3, 6\) does not start where rank 0's ends \(2\)",
        ),
        (
            lambda ps: [ps[0], ps[1], ps[2].with_changes(seed=9)],
            "rank 2's plan differs from rank 0's in 'seed'",
        ),
        (
            lambda ps: [
                p.with_changes(options={**p.options, "compression": "powersgd"})
                for p in ps
            ],
            "not simulated in process; valid choices here: none, fp16",
        ),
    ],
)
def test_plans_that_do_not_form_one_group_are_named(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    plans: list[MemberPlan] = mutate([plan_of(r, 1) for r in range(len(SHARES))])
    with pytest.raises(PlanError, match=message):
        SegmentRunner().run_segment(plans, [member()] * len(plans), initial())


@pytest.mark.parametrize("network", ["wired", "wifi"])
def test_a_segment_of_two_members_costs_their_step_compute_plus_the_ring(
    network: str,
) -> None:
    """1 and 0.5 GFLOP/s: t = 6 M / rate per sample, shares 16 and 8 of 24, so
    both compute 16 x 8.64 us per step; then the ring all-reduce of the
    gradients, 2 (N - 1) / N x bytes / bandwidth + 2 (N - 1) x latency."""
    net = SwitchedEthernet(adapter=None) if network == "wired" else WifiMedium()
    s = strategy()
    run = simulate(s, [1.0, 0.5], 2, network=net)
    t_fast, t_slow = 6 * MACS / 1e9, 6 * MACS / 0.5e9
    assert s.speeds == pytest.approx({1000: 1 / t_fast, 1001: 1 / t_slow})
    plans = s.plans(s.cohort, 3)
    assert [p.batch_share for p in plans.values()] == [(0, 16), (16, 24)]
    compute = 16 * t_fast
    assert compute == pytest.approx(8 * t_slow)
    if network == "wired":
        ring = PARAM_BYTES * 8 / GIGABIT_GOODPUT + 2 * LATENCY
        assert ring == pytest.approx(2.5037e-4, rel=1e-4)
    else:
        ring = net.allreduce_seconds(2, PARAM_BYTES)
        assert ring > 2.5037e-4 * 1.5
    for metrics in run.result.train_metrics_clientapp.values():
        assert metrics["members"] == 2 and metrics["num-examples"] == 72
        assert metrics["compute-s"] == pytest.approx(compute)
        assert metrics["comm-s"] == pytest.approx(ring)
        assert metrics["step-s"] == pytest.approx(compute + ring)
        assert metrics["samples-per-s"] == pytest.approx(24 / (compute + ring))
        assert metrics["replica-max-diff"] == 0.0
    # round 2 on the clock: the segment, plus the weights and optimiser state
    # down to both members and back, sharing the server's port (max-min fair)
    state = sum(len(a.data) for a in run.result.arrays.values())
    state += sum(len(Array(v).data) for v in s.central_optimizer.values())
    took = run.round_end_s[2] - run.round_end_s[1]
    if network == "wired":
        transfers = 2 * state * 8 / (GIGABIT_GOODPUT / 2)
        assert took == pytest.approx(3 * (compute + ring) + transfers, rel=1e-6)
    else:
        assert took > 3 * (compute + ring)


def test_simulated_training_is_one_large_batch() -> None:
    """Two unequal members for 3 steps = one process taking all 24 samples."""
    run = simulate(strategy(), [1.0, 0.5], 1)
    whole = member_plan(
        "allreduce",
        "one",
        port=1,
        steps=3,
        batch_size=24,
        seed=0,
        model="deep-mlp",
        model_args=ARGS,
        dataset="digits",
        lr=0.05,
        momentum=0.9,
        batch_share=(0, 24),
        options={"optimizer": "sgd", "trust": 0.001},
    )
    from flowerbed.models import build_sequential

    start = {
        k: v.numpy().copy()
        for k, v in build_sequential("deep-mlp", ARGS, seed=0).state_dict().items()
    }
    alone = run_group([whole], member(), start)
    for name, array in alone.arrays.items():
        np.testing.assert_allclose(
            run.result.arrays[name].numpy(), array, rtol=1e-5, atol=1e-6
        )
        assert not np.array_equal(array, start[name])


def test_a_member_lost_mid_segment_fails_it_fast_and_the_next_goes_on_without_it() -> (
    None
):
    """Member 2 vanishes at step 1 of round 1: the others report the lost peer
    timeout_s (5 s) after their last step, the strategy waits timeout_s +
    reply_margin_s (6 s) more for it, then repeats the segment with two."""
    s = strategy(timeout_s=5.0, reply_margin_s=1.0, min_train_nodes=2)
    run = simulate(s, [1.0, 1.0, 1.0], 2, crash_at_step={2: 1})
    assert s.lost == {1002}
    first, second = (
        run.result.train_metrics_clientapp[1],
        run.result.train_metrics_clientapp[2],
    )
    assert first["attempts"] == 2 and first["members"] == 2
    assert second["attempts"] == 1 and second["members"] == 2
    assert 11.0 < run.round_end_s[1] < 11.1
    assert run.round_end_s[2] - run.round_end_s[1] < 0.01


def test_a_charged_architecture_sets_compute_and_gradient_bytes() -> None:
    """MobileNet-v1 charged (569 M MACs, 4.2 M parameters; Howard et al. 2017)
    on two 1 GFLOP/s members, 2 samples each. Profiling costs virtual time too
    (3 x 8 samples at 3.4 s would exceed the 60 s query timeout): one sample."""
    s = strategy(
        batch_size=4,
        recipe=AllReduceRecipe(optimizer="sgd", base_lr=0.05, base_batch=4),
        steps_per_round=1,
        profiling=MemberProfiling(profile_batch=1, profile_repeats=1),
    )
    run = simulate(s, [1.0, 1.0], 1, charge_as="mobilenet-v1")
    metrics = run.result.train_metrics_clientapp[1]
    assert metrics["compute-s"] == pytest.approx(2 * 6 * 569e6 / 1e9)
    ring = 4 * 4.2e6 * 8 / GIGABIT_GOODPUT + 2 * LATENCY
    assert metrics["comm-s"] == pytest.approx(ring)


def test_bad_fleets_are_named() -> None:
    with pytest.raises(ValueError, match="at least one device"):
        span_grid([])
    with pytest.raises(ValueError, match="valid choices"):
        node_config("no-such-phone", 0)
    with pytest.raises(ValueError, match="GFLOP/s > 0"):
        node_config(-1.0, 0)
    with pytest.raises(ValueError, match=r"valid: 0\.\.1"):
        span_grid(["rpi4b", "rpi4b"], crash_at_step={5: 1})
    with pytest.raises(ValueError, match="unknown charged model 'vgg-99'"):
        SegmentRunner(charge_as="vgg-99")


def test_the_bench_part_agrees_with_the_scaling_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's LargeBatchSync throughput equals the scaling model's for
    the same phones, batch and network (both: max compute + ring all-reduce);
    Wi-Fi below wired. --quick leaves the part out unless it is named."""
    import argparse

    from flowerbed.bench import large_batch_section as section
    from flowerbed.bench.sections import SectionRun

    named = argparse.Namespace(quick=True, large_batch="sync")
    data = section.run(SectionRun("large-batch", named, tmp_path))
    rows = {(r["network"], r["phones"]): r for r in data["sync"]["rows"]}
    assert sorted(rows) == [("wifi", 8), ("wifi", 16), ("wired", 8), ("wired", 16)]
    for row in rows.values():
        assert row["samples-per-s"] == pytest.approx(row["model-samples-per-s"])
    assert rows[("wifi", 16)]["samples-per-s"] < rows[("wired", 16)]["samples-per-s"]
    text = "\n".join(section.render(data))
    assert "| wired | 16 |" in text and "mobilenet-v1" in text
    ran: list[str] = []
    for part in section.PARTS:
        monkeypatch.setattr(section, part, lambda quick, p=part: ran.append(p) or {})
    unnamed = argparse.Namespace(quick=True, large_batch=None)
    out = section.run(SectionRun("large-batch", unnamed, tmp_path))
    assert ran == ["scaling", "rounds", "accuracy"] and "sync" not in out


def test_members_evaluate_the_model_and_the_server_scores_it() -> None:
    """Federated evaluation goes to the boards' evaluate (the test split of the
    job dataset); simulate(evaluate=True) scores the same model server side."""
    s = strategy(fraction_evaluate=1.0)
    run = simulate(s, [1.0, 0.5], 2, evaluate=True)
    from flowerbed.parallel.job_data import load_job_dataset

    tests = len(load_job_dataset("digits").x_test)
    for r in (1, 2):
        members = run.result.evaluate_metrics_clientapp[r]
        server = run.result.evaluate_metrics_serverapp[r]
        assert server["num-examples"] == tests  # (Flower's aggregate drops the key)
        assert members["eval-acc"] == pytest.approx(server["eval-acc"])
    assert set(run.result.evaluate_metrics_serverapp) == {0, 1, 2}
    assert (
        run.result.evaluate_metrics_serverapp[2]["eval-loss"]
        < run.result.evaluate_metrics_serverapp[0]["eval-loss"]
    )


def test_a_member_that_slows_down_gets_a_smaller_share_next_round() -> None:
    """Two 1 GFLOP/s members (t per sample); member 1 three times slower from
    step 3 (round 2). Round 1: 12 + 12, compute 12 t. Round 2: the same shares,
    member 1 takes 36 t; it reports 1 / 3t, smoothed 0.5 / 3t + 0.5 / t = 2 / 3t.
    Round 3: 24 x (1, 2/3) / (5/3) = (14.4, 9.6) -> 14 + 10, compute 30 t."""
    t = 6 * MACS / 1e9
    s = strategy()
    run = simulate(s, [1.0, 1.0], 3, slow_from_step={1: (3, 3.0)})
    computes = [m["compute-s"] for m in run.result.train_metrics_clientapp.values()]
    assert computes == pytest.approx([12 * t, 36 * t, 30 * t])
    # after round 3: 0.5 / 3t + 0.5 x 2 / 3t = 1 / 2t
    assert s.speeds[1001] == pytest.approx(1 / (2 * t))


def test_a_member_that_found_the_port_taken_stays_in_the_cohort() -> None:
    """Member 1001 answers the first segment only that the rendezvous port was
    in use (another program took it): it is alive and blameless, so the repeat
    runs with all three members, not two (a red CI dropped it as lost)."""
    s = strategy()
    real = s.run_segment
    calls = []

    def first_port_taken(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = real(*args, **kwargs)
        if not calls:
            out.errors[1001] = (
                "flowerbed span client: rendezvous port 29500 on 127.0.0.1 is in "
                "use: another program (or a previous segment still closing) holds it"
            )
            out.replies.pop(1001, None)
        calls.append(out)
        return out

    s.run_segment = first_port_taken  # type: ignore[method-assign]
    run = simulate(s, [1.0, 1.0, 1.0], 1)
    assert s.lost == set()
    first = run.result.train_metrics_clientapp[1]
    assert first["attempts"] == 2 and first["members"] == 3
