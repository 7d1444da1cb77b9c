"""The span machinery end to end on real local processes (probe jobs).

A :class:`ProcessGrid` runs the board ClientApp (``flowerbed.clients.span_app``)
in four worker processes; :class:`SpanJobStrategy` profiles them, sends plans and
gathers what becomes of each member.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from flowerbed import keys
from flowerbed.clients.span_app import SpanBoardError, member_context
from flowerbed.parallel.group import free_port
from flowerbed.parallel.plan import MemberPlan
from flowerbed.sims.process_grid import ProcessGrid
from flowerbed.strategies.span import SpanJobStrategy
from flowerbed.strategies.span_options import SpanGroup
from flwr.app import ConfigRecord, Context, RecordDict

HOST = "127.0.0.1"
CONFIGS = [
    {"address": HOST},
    {"address": HOST},
    {"address": HOST},
    {"device": "no-address"},
]


@pytest.fixture(scope="module")
def grid() -> Iterator[ProcessGrid]:
    with ProcessGrid(
        "flowerbed.clients.span_app:app", CONFIGS, unavailable_after_s=2.0
    ) as grid:
        yield grid


def strategy(first_port: int, ports: int = 3, join_s: float = 20) -> SpanJobStrategy:
    return SpanJobStrategy(
        group=SpanGroup(
            rendezvous_port=first_port,
            rendezvous_ports=ports,
            join_timeout_s=join_s,
            timeout_s=10,
            reply_margin_s=3,
        )
    )


def probe_plans(
    s: SpanJobStrategy, members: list[int], rounds: int = 1
) -> dict[int, MemberPlan]:
    segment, port = s.next_segment()
    return {
        node: MemberPlan(
            mode="probe",
            job="probe-test",
            segment=segment,
            rank=rank,
            world_size=len(members),
            host=HOST,
            port=port,
            start_step=0,
            steps=0,
            batch_size=1,
            join_timeout_s=s.join_timeout_s,
            timeout_s=s.timeout_s,
            options={"probe-rounds": rounds, "probe-pause-s": 0.1, "probe-bytes": 4096},
        )
        for rank, node in enumerate(members)
    }


@pytest.mark.slow
def test_profiling_leaves_out_a_node_without_an_address(grid: ProcessGrid) -> None:
    s = strategy(free_port())
    s.attach(grid)
    members, errors = s.profile_members(
        grid, grid.get_node_ids(), {"mode": "probe"}, 60
    )
    assert sorted(members) == [1, 2, 3]
    assert all(m.address == HOST for m in members.values())
    assert list(errors) == [4]
    assert "node_config 'address' is missing" in errors[4]
    assert "--node-config" in errors[4]


@pytest.mark.slow
def test_a_segment_reports_every_member_and_its_link(grid: ProcessGrid) -> None:
    s = strategy(free_port())
    s.attach(grid)
    for _ in range(3):
        # A port free a moment ago can be taken by another process's ephemeral
        # connection before rank 0 binds it; as the strategy does, the next
        # segment moves on to the next port of its range.
        plans = probe_plans(s, [1, 2, 3])
        messages = s.segment_messages(plans, {}, {}, ConfigRecord(), 60)
        out = s.run_segment(messages, 1, 60)
        if out.complete or not (
            out.errors and all("in use" in e for e in out.errors.values())
        ):
            break
    assert out.complete, (out.errors, out.rejected, out.lost)
    assert sorted(out.replies) == [1, 2, 3]
    for reply in out.replies.values():
        assert reply.metrics["span-link-bytes-per-s"] > 0


@pytest.mark.slow
def test_a_port_in_use_is_an_error_reply_and_the_next_segment_skips_it(
    grid: ProcessGrid,
) -> None:
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        # segment 1 uses port + 1, segment 2 the taken one
        s = strategy(port, ports=2, join_s=4)
        s.attach(grid)
        s.next_segment()
        plans = probe_plans(s, [1, 2])
        assert plans[1].port == port
        out = s.run_segment(
            s.segment_messages(plans, {}, {}, ConfigRecord(), 60), 1, 60
        )
        assert not out.complete
        assert f"rendezvous port {port}" in out.errors[1] and "in use" in out.errors[1]
        assert port in s.bad_ports
        # rank 1 waited for the rendezvous in vain: a join failure, not a hang
        assert out.replies[2].failure.startswith("join")
        assert s.next_segment()[1] == port + 1
        assert s.next_segment()[1] == port + 1


@pytest.mark.slow
def test_a_killed_member_is_lost_and_the_survivors_answer(grid: ProcessGrid) -> None:
    # Segment 1 uses the range's second port: make it the one the OS just gave
    # (its neighbour may be another program's, and a port error here would
    # leave no segment to kill a member in).
    s = strategy(free_port() - 1)
    s.attach(grid)
    plans = probe_plans(s, [1, 2, 3], rounds=200)
    messages = s.segment_messages(plans, {}, {}, ConfigRecord(), 120)
    killed: list[float] = []

    def kill() -> None:
        grid.kill(2)
        killed.append(time.monotonic())

    killer = threading.Timer(3.0, kill)
    killer.start()
    try:
        out = s.run_segment(messages, 1, 120)
        ended = time.monotonic()
    finally:
        killer.join()
    assert out.lost == {2}
    assert sorted(out.replies) == [1, 3]
    for reply in out.replies.values():
        assert not reply.ok
        assert "lost a peer" in reply.failure
        # The survivors name node 2's rank (1) gone, so the segment ends without
        # waiting out the grace period (timeout_s + reply_margin_s = 13 s) that
        # covers members nobody named.
        assert reply.metrics[keys.SPAN_LOST_RANKS] == [1], reply.failure
    assert ended - killed[0] < s._grace(join=False), ended - killed[0]


def context(node_config: dict) -> Context:
    return Context(
        run_id=1, node_id=7, node_config=node_config, state=RecordDict(), run_config={}
    )


def test_a_board_describes_itself_in_its_node_config(tmp_path: Path) -> None:
    member = member_context(
        context(
            {
                "address": "10.0.0.5",
                "state-dir": str(tmp_path),
                "emulate-gflops": 2.5,
                "slow-from-step": 30,
                "slow-factor": 4,
                "device": "rpi4b",
            }
        )
    )
    assert member.address == "10.0.0.5" and member.label == "rpi4b"
    assert member.store_root == tmp_path
    assert member.speed is not None
    assert member.speed.rate_at(29) == 2.5e9 and member.speed.rate_at(30) == 2.5e9 / 4
    assert member.local_data is None
    plain = member_context(context({"address": "127.0.0.1"}))
    assert plain.speed is None
    assert plain.store_root.name == "node-7"


@pytest.mark.parametrize(
    ("node_config", "message"),
    [
        ({}, "node_config 'address' is missing"),
        ({"address": "0.0.0.0"}, "wildcard"),
        (
            {"address": HOST, "emulate-gflops": "fast"},
            "'emulate-gflops' must be a number",
        ),
        ({"address": HOST, "emulate-gflops": -1.0}, "flops_per_s must be > 0"),
    ],
)
def test_bad_board_settings_are_named(node_config: dict, message: str) -> None:
    with pytest.raises(SpanBoardError, match=message):
        member_context(context(node_config))
