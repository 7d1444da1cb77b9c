"""Flower's differential-privacy wrappers around a flowerbed strategy.

Wrapped in Flower's own wrapper, a flowerbed strategy runs Flower's loop and says
so loudly; wrapped in the wrapper of the same name from flowerbed.strategies, it
keeps its round behaviour and the wrapper's clipping and noise still apply.
"""

from __future__ import annotations

import logging

import pytest
from flowerbed.strategies import (
    DeadlineFedAvg,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedBuff,
)
from flwr.app import Message
from flwr.serverapp.strategy import (
    DifferentialPrivacyServerSideFixedClipping as FlowerFixedClipping,
)
from flwr.serverapp.strategy import Result, Strategy
from test_strategies_fakes import FakeGrid, node, silent, weights


class FlowerGrid(FakeGrid):
    """FakeGrid with Flower's blocking ``send_and_receive`` on its clock."""

    def send_and_receive(self, messages, *, timeout=None):  # type: ignore[no-untyped-def]
        ids = list(self.push_messages(messages))
        give_up = self.clock.now() + (timeout or 3600.0)
        replies: list[Message] = []
        while len(replies) < len(ids) and self.clock.now() < give_up:
            waiting = [
                i
                for i in ids
                if i not in {r.metadata.reply_to_message_id for r in replies}
            ]
            replies += list(self.pull_messages(waiting))
            if len(replies) < len(ids):
                upcoming = [at for at, *_ in self.queue]
                self.clock.wait(max(0.0, min([*upcoming, give_up]) - self.clock.now()))
        return replies


def fleet(shifts: tuple[float, ...] = (1.0, 1.0, 1.0)) -> FlowerGrid:
    # Nodes 1-3 answer within 2 s; node 4 takes 50 s; node 5 never answers.
    return FlowerGrid(
        {
            1: node(shifts[0], seconds=1.0),
            2: node(shifts[1], seconds=1.0),
            3: node(shifts[2], seconds=2.0),
            4: node(1.0, seconds=50.0),
            5: silent,
        }
    )


def deadline() -> DeadlineFedAvg:
    return DeadlineFedAvg(
        deadline_s=5.0, late_updates=False, weighting="examples", fraction_evaluate=0.0
    )


def clipped(
    wrapper: type, clipping_norm: float = 10.0, inner: Strategy | None = None
) -> Strategy:
    """Flower's fixed-clipping DP ``wrapper`` without noise, 5 sampled nodes,
    around ``inner`` (``deadline()`` when not given)."""
    return wrapper(
        inner or deadline(),
        noise_multiplier=0.0,
        clipping_norm=clipping_norm,
        num_sampled_clients=5,
    )


def logged_run(
    wrapper: type, rounds: int, level: int, caplog: pytest.LogCaptureFixture
) -> tuple[FlowerGrid, Result, list[str]]:
    """``clipped(wrapper)`` run ``rounds`` rounds on ``fleet()`` while Flower's log
    is captured at ``level``: the grid, the Result and the logged messages."""
    grid, strategy = fleet(), clipped(wrapper)
    with caplog.at_level(level, logger="flwr"):
        result = strategy.start(grid, weights(), num_rounds=rounds, timeout=100.0)
    return grid, result, [r.getMessage() for r in caplog.records]


def w(result: Result) -> float:
    return float(result.arrays["w"].numpy()[0])


def test_flowerbeds_wrapper_keeps_the_deadline_and_adds_the_noise(
    caplog: pytest.LogCaptureFixture,
) -> None:
    wrapper = DifferentialPrivacyServerSideFixedClipping
    grid, result, lines = logged_run(wrapper, 3, logging.INFO, caplog)
    # three rounds closed at the 5 s deadline, each moving the model by +1
    assert grid.clock.now() == pytest.approx(15.0)
    assert w(result) == pytest.approx(3.0)
    assert sum("parameters are clipped by value" in m for m in lines) >= 9
    assert sum("central DP noise" in m for m in lines) == 3
    assert not any("is being run by another strategy's start()" in m for m in lines)


def test_the_wrapper_clips_each_update_to_its_norm() -> None:
    # clipping_norm 0.5: each +1 update counts as +0.5 (no noise)
    strategy = clipped(DifferentialPrivacyServerSideFixedClipping, clipping_norm=0.5)
    result = strategy.start(fleet(), weights(), num_rounds=2, timeout=100.0)
    assert w(result) == pytest.approx(1.0)


def test_flowers_own_wrapper_waits_for_everyone_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    grid, _, lines = logged_run(FlowerFixedClipping, 1, logging.WARNING, caplog)
    # Flower's loop waited past the 5 s deadline, until the slow node's and the
    # silent node's messages expired (the TTL DeadlineFedAvg gives them)
    assert grid.clock.now() > 5.0
    loud = [m for m in lines if "is being run by another strategy's start()" in m]
    assert len(loud) == 1
    assert "DeadlineFedAvg" in loud[0] and "flowerbed.strategies" in loud[0]


@pytest.mark.parametrize(
    "wrapper",
    [
        DifferentialPrivacyServerSideAdaptiveClipping,
        DifferentialPrivacyClientSideFixedClipping,
    ],
)
def test_the_other_wrappers_run_the_wrapped_loop_too(wrapper: type) -> None:
    grid = fleet()
    kwargs = {"noise_multiplier": 0.0, "num_sampled_clients": 5}
    if wrapper is DifferentialPrivacyClientSideFixedClipping:
        kwargs["clipping_norm"] = 10.0
    strategy = wrapper(deadline(), **kwargs)
    strategy.start(grid, weights(), num_rounds=2, timeout=100.0)
    assert grid.clock.now() == pytest.approx(10.0)


def test_fedbuff_keeps_its_asynchrony_inside_the_wrapper() -> None:
    grid = fleet(shifts=(1.0, 2.0, 3.0))
    inner = FedBuff(buffer_size=2, fraction_evaluate=0.0)
    strategy = clipped(DifferentialPrivacyServerSideFixedClipping, inner=inner)
    result = strategy.start(grid, weights(), num_rounds=4, timeout=100.0)
    # four versions from the fast nodes, long before the 50 s node answers
    assert len(result.train_metrics_clientapp) == 4
    assert grid.clock.now() < 10.0
