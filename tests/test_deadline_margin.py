"""DeadlineFedAvg learns how late each node's reply comes after its deadline-s.

A board's client stops training at ``deadline-s`` and then uploads; a simulated
device counts its transfers inside it. The strategy cannot know which, so it
learns each node's lateness ``t_rtt - deadline-s`` from replies that stopped at
their deadline, and sends ``D - lateness - 2% of D`` (``node_deadline``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from flowerbed import keys
from flowerbed.strategies import DeadlineFedAvg
from flowerbed.strategies.inflight import InFlight
from flowerbed.strategies.options import RECOMMENDED_DEADLINES, Deadlines, WorkBalance
from flowerbed.strategies.round_metrics import ROUND_PARTICIPANTS
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from test_strategies_fakes import (
    FakeClock,
    FakeGrid,
    config_of,
    received,
    reply,
    weights,
)

STEP_S = 1.0
STEPS = 10
ASSIGNED = ConfigRecord({keys.LOCAL_STEPS: STEPS})


def board(after_s: float):  # type: ignore[no-untyped-def]
    """A board that trains 1 s a step until ``deadline-s`` (at most 10 steps),
    then needs ``after_s`` to upload: its reply lands ``after_s`` after the
    deadline it was given when it stops there."""

    def run(message: Message) -> tuple[Message | None, float]:
        given = config_of(message).get(keys.DEADLINE_S)
        steps = STEPS if given is None else min(STEPS, math.floor(given / STEP_S))
        x = {k: v + 1.0 for k, v in received(message).items()}
        metrics = {"num_examples": 10, "num_steps": steps, "train_time_s": steps}
        return reply(message, x, **metrics), steps * STEP_S + after_s

    return run


def deadline_strategy(**deadlines) -> DeadlineFedAvg:  # type: ignore[no-untyped-def]
    options = {"deadline_s": 8.0, "partial_work": True, **deadlines}
    return DeadlineFedAvg(
        fraction_evaluate=0.0,
        work=WorkBalance(weighting="examples"),
        deadlines=Deadlines(**options),
    )


def given(grid: FakeGrid, node_id: int) -> list[float]:
    return [config_of(m)[keys.DEADLINE_S] for m in grid.pushed_to(node_id)]


def test_a_late_board_gets_its_upload_taken_off_its_next_deadline() -> None:
    # D = 8 s. Round 1: lateness unknown, deadline-s = 0.8 x 8 = 6.4: 6 steps,
    # then 2.5 s of upload: the reply lands at 8.5 s, 2.1 s after its
    # deadline-s and after the round closed (a late update; the board is busy
    # and not sampled in round 2). Round 3's deadline-s for it is
    # 8 - 2.1 - 0.16 = 5.74: 5 steps, lands at 7.5 s, inside the round.
    # Stopping at its last whole step (5 s of 5.74 s) it looks only 1.76 s
    # late; the largest of its recent values keeps round 4 in time too, with
    # their spread (0.34 s, more than 2% of D) in hand: 8 - 2.1 - 0.34 = 5.56.
    grid = FakeGrid({1: board(after_s=2.5), 2: board(after_s=0.0)})
    strategy = deadline_strategy()
    result = strategy.start(grid, weights(), num_rounds=4, train_config=ASSIGNED)
    assert given(grid, 1) == pytest.approx([6.4, 5.74, 5.56])
    assert strategy.lateness[1] == pytest.approx([2.1, 1.76, 1.94])
    assert result.train_metrics_clientapp[1][ROUND_PARTICIPANTS] == 1
    assert result.train_metrics_clientapp[3][ROUND_PARTICIPANTS] == 2
    assert result.train_metrics_clientapp[4][ROUND_PARTICIPANTS] == 2


def test_a_node_whose_deadline_covers_its_transfers_gets_nearly_all_of_it() -> None:
    # Node 2 counts everything inside deadline-s (as a simulated device does):
    # stopping after 6 of its 10 steps it lands at 6 s, 0.4 s before its
    # deadline-s of 6.4 s: lateness -0.4, taken as 0.
    # It then gets 8 - 0 - 0.16 = 7.84 s instead of 6.4: 7 steps, not 6.
    grid = FakeGrid({1: board(after_s=2.5), 2: board(after_s=0.0)})
    strategy = deadline_strategy()
    strategy.start(grid, weights(), num_rounds=2, train_config=ASSIGNED)
    # 7 steps of 7.84 s: -0.84 in round 2
    assert strategy.lateness[2] == pytest.approx([-0.4, -0.84])
    assert given(grid, 2) == pytest.approx([6.4, 7.84])


def test_a_node_never_seen_late_gets_the_fleets_80th_percentile() -> None:
    strategy = deadline_strategy()
    strategy.lateness = {n: [0.0, float(n)] for n in range(1, 11)}  # 1 .. 10 s
    late = 8.2  # numpy's linear 80th percentile of 1..10
    assert strategy.node_deadline(99, 20.0) == pytest.approx(20 - late - 0.4)
    # node 3's own values, 0 and 3 s: 3 s late with 3 s of spread in hand
    assert strategy.node_deadline(3, 20.0) == pytest.approx(20 - 3 - 3)
    strategy.lateness[3] = [2.9, 3.0]  # steady: 2% of D in hand
    assert strategy.node_deadline(3, 20.0) == pytest.approx(20 - 3 - 0.4)


def test_without_learning_or_history_the_work_fraction_holds() -> None:
    strategy = deadline_strategy(learn_margin=False, work_fraction=0.7)
    strategy.lateness = {1: [5.0]}
    assert strategy.node_deadline(1, 10.0) == pytest.approx(7.0)
    assert deadline_strategy(work_fraction=0.7).node_deadline(1, 10.0) == (
        pytest.approx(7.0)
    )


def test_a_very_late_node_keeps_a_tenth_of_the_deadline() -> None:
    strategy = deadline_strategy()
    strategy.lateness = {1: [50.0]}
    assert strategy.node_deadline(1, 10.0) == pytest.approx(1.0)


def test_the_learnt_lateness_survives_a_checkpoint() -> None:
    strategy = deadline_strategy()
    strategy.lateness = {4: [1.5, 0.5], 7: [-0.25]}
    restored = deadline_strategy()
    restored.load_state(strategy.state())
    assert restored.lateness == {4: [1.5, 0.5], 7: [-0.25]}


def test_lateness_is_measured_against_the_reply_s_own_task() -> None:
    # Node 1's first task carried no deadline-s (an adaptive deadline knows none
    # in round 1); its second carried 6.4 s. The first task's reply, a full 10
    # steps landing 10 s after it was sent, stopped short of nothing and had no
    # deadline: it says nothing of lateness, although the node has been given
    # 6.4 s since. The second task's reply, 6 steps landing at 6.5 s, is 0.1 s
    # late against its own 6.4 s.
    grid = FakeGrid({1: board(after_s=0.5)})
    inflight = InFlight(grid, FakeClock(grid))
    contents = [ASSIGNED, ConfigRecord({keys.LOCAL_STEPS: STEPS, keys.DEADLINE_S: 6.4})]
    messages = [
        grid.create_message(
            RecordDict({"config": config, keys.ARRAYS: weights()}),
            MessageType.TRAIN,
            1,
            "1",
        )
        for config in contents
    ]
    first, second = (inflight.tickets[i] for i in inflight.push(messages, 1))
    assert (first.deadline_s, second.deadline_s) == (None, 6.4)
    strategy = deadline_strategy()
    full = reply(messages[0], {"x": np.zeros(1)}, num_examples=10, num_steps=10)
    strategy._note_lateness(full, first, arrived=10.0)
    assert strategy.lateness == {}
    short = reply(messages[1], {"x": np.zeros(1)}, num_examples=10, num_steps=6)
    strategy._note_lateness(short, second, arrived=6.5)
    assert strategy.lateness == {1: [pytest.approx(0.1)]}


def test_the_node_at_the_percentile_keeps_its_whole_task() -> None:
    # Three identical nodes that count everything inside deadline-s, 10 steps
    # of 1 s. Round 2: D = c(20) / 0.98 = 10.2 s; lateness not yet known, and
    # the recommended work_fraction 1 gives all of D: the whole task, replied
    # before deadline-s (which teaches no lateness), so round 3 the same. With
    # D = c(20) and a learnt lateness 0 a node would get 9.8 s, and 9 steps,
    # every round, in rounds as long as a full task.
    grid = FakeGrid({n: board(after_s=0.0) for n in (1, 2, 3)})
    strategy = DeadlineFedAvg(
        fraction_evaluate=0.0,
        work=WorkBalance(weighting="examples"),
        deadlines=RECOMMENDED_DEADLINES,
    )
    strategy.start(grid, weights(), num_rounds=3, train_config=ASSIGNED)
    sent = [config_of(m).get(keys.DEADLINE_S) for m in grid.pushed_to(1)]
    assert sent[0] is None  # round 1: no duration known yet
    assert sent[1:] == pytest.approx([10 / 0.98, 10 / 0.98])
