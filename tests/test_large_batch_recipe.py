"""The large-batch recipe by hand: shares, one large batch, LR schedule, LARS, LAMB."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flowerbed.parallel.large_batch.optimizers import LargeBatchOptimizer
from flowerbed.parallel.large_batch.recipe import (
    LrSchedule,
    batch_shares,
    loss_scale,
    share_bounds,
)


# --------------------------------------------------------------------- shares
def test_shares_follow_speed_and_sum_to_the_batch() -> None:
    assert batch_shares(10, [1.0, 2.0, 2.0]) == [2, 4, 4]
    # 10/3 each: floors 3, 3, 3; the one left over goes to the lowest index
    assert batch_shares(10, [1.0, 1.0, 1.0]) == [4, 3, 3]
    assert share_bounds([4, 3, 3]) == [(0, 4), (4, 7), (7, 10)]


def test_every_member_gets_its_minimum_from_the_largest_share() -> None:
    # exact 4.90 / 0.05 / 0.05 -> [5, 0, 0], then one sample each from the first
    assert batch_shares(5, [100.0, 1.0, 1.0]) == [3, 1, 1]


@pytest.mark.parametrize(
    ("batch", "speeds", "message"),
    [
        (10, [], "no members"),
        (10, [1.0, 0.0], "speed of member 1 must be a finite number > 0"),
        (10, [1.0, math.nan], "speed of member 1"),
        (2, [1.0, 1.0, 1.0], "cannot give 3 members at least 1"),
    ],
)
def test_bad_shares_are_named(batch: int, speeds: list[float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        batch_shares(batch, speeds)


def test_unequal_shares_give_the_gradient_of_one_batch_of_their_sum() -> None:
    """w x regression, l_s = (w x_s - y_s)^2 / 2, so grad l_s = (w x_s - y_s) x_s.

    x = (1, 2, 3), y = 0, w = 1: per-sample gradients 1, 4, 9; the batch of three
    has mean gradient 14/3. Shares (1, 2): member 0 holds sample 0 (mean 1),
    member 1 samples 1-2 (mean 6.5). Scaled by W B_i / B = 2/3 and 4/3 and
    averaged as DDP does: (2/3 + 26/3) / 2 = 14/3.
    """
    x = torch.tensor([1.0, 2.0, 3.0])
    shares = [1, 2]
    grads = []
    for share, (first, stop) in zip(shares, share_bounds(shares), strict=True):
        w = torch.tensor(1.0, requires_grad=True)
        loss = ((w * x[first:stop]) ** 2 / 2).mean() * loss_scale(share, 3, 2)
        loss.backward()
        assert w.grad is not None
        grads.append(float(w.grad))
    assert grads == pytest.approx([2 / 3, 26 / 3])
    assert sum(grads) / len(grads) == pytest.approx(14 / 3)


def test_loss_scale_rejects_a_share_outside_the_batch() -> None:
    with pytest.raises(ValueError, match=r"share 0 must be in 1\.\.8"):
        loss_scale(0, 8, 2)


# ----------------------------------------------------------------- schedule
def test_warm_up_climbs_linearly_from_the_base_rate_to_the_scaled_one() -> None:
    # Goyal et al.: eta = 0.1 for 256; B = 1024 -> 0.4, reached after T_w = 4 steps
    schedule = LrSchedule(base_lr=0.1, base_batch=256, batch_size=1024, warmup_steps=4)
    assert schedule.peak_lr == pytest.approx(0.4)
    got = [schedule.lr(t) for t in range(6)]
    assert got == pytest.approx([0.1, 0.175, 0.25, 0.325, 0.4, 0.4])


def test_polynomial_decay_after_warm_up() -> None:
    schedule = LrSchedule(0.1, 256, 1024, warmup_steps=4, total_steps=8, power=2.0)
    # halfway through the decay: 0.4 * (1 - 2/4)^2 = 0.1; at the end 0
    assert schedule.lr(6) == pytest.approx(0.1)
    assert schedule.lr(8) == 0.0 and schedule.lr(20) == 0.0
    assert LrSchedule.from_config(schedule.to_config()) == schedule


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"base_lr": 0.0}, "base_lr must be a finite number > 0"),
        ({"warmup_steps": 5, "total_steps": 5}, "total_steps .5. must exceed"),
        ({"batch_size": -1}, "batch_size"),
    ],
)
def test_bad_schedules_are_named(kwargs: dict, message: str) -> None:
    base = {"base_lr": 0.1, "base_batch": 256, "batch_size": 512}
    with pytest.raises(ValueError, match=message):
        LrSchedule(**{**base, **kwargs})


# --------------------------------------------------------------- optimisers
def layer(*values: float) -> dict[str, np.ndarray]:
    return {"fc.weight": np.array([values], dtype=np.float64)}


def test_lars_step_by_hand() -> None:
    """w = (3, 4), |w| = 5; g = (0.6, 0.8), |g| = 1; trust 0.1, lr 1, m 0.9.

    Step 1: lambda = 0.1 * 5 / 1 = 0.5, v = 0.5 g = (0.3, 0.4), w = (2.7, 3.6).
    Step 2: lambda = 0.1 * 4.5 = 0.45, v = 0.9 (0.3, 0.4) + 0.45 g = (0.54, 0.72),
    w = (2.16, 2.88).
    """
    opt = LargeBatchOptimizer("lars", momentum=0.9, trust=0.1)
    w, g = layer(3.0, 4.0), layer(0.6, 0.8)
    assert opt.step(w, g, lr=1.0)["fc.weight"] == pytest.approx(0.5)
    np.testing.assert_allclose(w["fc.weight"], [[2.7, 3.6]])
    assert opt.step(w, g, lr=1.0)["fc.weight"] == pytest.approx(0.45)
    np.testing.assert_allclose(w["fc.weight"], [[2.16, 2.88]])


def test_lars_weight_decay_enters_the_ratio_and_the_update() -> None:
    # g + 0.1 w = (0.9, 1.2); lambda = 0.1 * 5 / (1 + 0.1 * 5) = 1/3;
    # v = (0.3, 0.4), w = (2.7, 3.6)
    opt = LargeBatchOptimizer("lars", momentum=0.9, trust=0.1, weight_decay=0.1)
    w = layer(3.0, 4.0)
    assert opt.step(w, layer(0.6, 0.8), lr=1.0)["fc.weight"] == pytest.approx(1 / 3)
    np.testing.assert_allclose(w["fc.weight"], [[2.7, 3.6]])


def test_lamb_step_by_hand() -> None:
    """Step 1: bias-corrected m1 = g, m2 = g^2, so r = g / (|g| + eps) ~ (1, -1).

    With wd = 0.5: r + 0.5 w = (2.5, 1), norm sqrt(7.25); ratio 5 / sqrt(7.25);
    w = (3, 4) - 0.1 * ratio * (2.5, 1). Step 2 with the same g: the corrections
    give m1 = g and m2 = g^2 again (0.19 g / 0.19, 0.001999 g^2 / 0.001999).
    """
    opt = LargeBatchOptimizer("lamb", weight_decay=0.5, eps=1e-12)
    w, g = layer(3.0, 4.0), layer(0.6, -0.8)
    ratio = 5 / math.sqrt(7.25)
    assert opt.step(w, g, lr=0.1)["fc.weight"] == pytest.approx(ratio)
    expected = np.array([[3 - 0.1 * ratio * 2.5, 4 - 0.1 * ratio * 1.0]])
    np.testing.assert_allclose(w["fc.weight"], expected)
    r = np.array([[1.0, -1.0]]) + 0.5 * expected
    opt.step(w, g, lr=0.1)
    step2 = np.linalg.norm(expected) / np.linalg.norm(r) * 0.1 * r
    np.testing.assert_allclose(w["fc.weight"], expected - step2, rtol=1e-9)


def test_momentum_sgd_and_biases_take_the_plain_update() -> None:
    opt = LargeBatchOptimizer("lars", momentum=0.5, trust=0.1, weight_decay=0.1)
    params = {"b": np.array([0.0, 1.0])}
    opt.step(params, {"b": np.array([1.0, 1.0])}, lr=0.1)
    np.testing.assert_allclose(params["b"], [-0.1, 0.9])  # no ratio, no decay
    sgd = LargeBatchOptimizer("sgd", momentum=0.5, weight_decay=0.1)
    w = layer(1.0, 2.0)
    sgd.step(w, layer(1.0, 1.0), lr=0.1)  # v = (1.1, 1.2)
    sgd.step(w, layer(1.0, 1.0), lr=0.1)  # v = 0.5 v + g + 0.1 w
    v1 = np.array([1.1, 1.2])
    w1 = np.array([1.0, 2.0]) - 0.1 * v1
    v2 = 0.5 * v1 + 1.0 + 0.1 * w1
    np.testing.assert_allclose(w["fc.weight"], [w1 - 0.1 * v2])


def test_state_round_trip_continues_identically() -> None:
    a = LargeBatchOptimizer("lamb")
    wa = layer(3.0, 4.0)
    a.step(wa, layer(0.6, -0.8), lr=0.1)
    b = LargeBatchOptimizer("lamb")
    b.load_state(a.state())
    wb = {k: v.copy() for k, v in wa.items()}
    a.step(wa, layer(0.1, 0.2), lr=0.1)
    b.step(wb, layer(0.1, 0.2), lr=0.1)
    np.testing.assert_array_equal(wa["fc.weight"], wb["fc.weight"])
    assert b.steps == 2


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: LargeBatchOptimizer("adam"), "valid choices: sgd, lars, lamb"),
        (lambda: LargeBatchOptimizer("sgd", momentum=1.0), "momentum must be in"),
        (
            lambda: LargeBatchOptimizer("sgd").step(layer(1.0), {"x": 1}, lr=0.1),
            "differ in names",
        ),
        (
            lambda: LargeBatchOptimizer("sgd").step(layer(1.0), layer(1.0), lr=0.0),
            "learning rate must be > 0",
        ),
        (
            lambda: LargeBatchOptimizer("sgd").load_state({"velocity/x": 1}),
            "unknown entry 'velocity/x'",
        ),
    ],
)
def test_bad_optimiser_input_is_named(build, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()
