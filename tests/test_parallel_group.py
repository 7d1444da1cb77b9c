"""Members join a fresh gloo group per segment and never hang on a lost peer."""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
from flowerbed.parallel.group import (
    PeerFailure,
    RendezvousError,
    check_bindable,
    free_port,
    joined_group,
    segment_port,
)
from flowerbed.parallel.member import exchange_ring, recv_state, send_state
from flowerbed.parallel.plan import MemberPlan
from ranks import run_ranks

HOST = "127.0.0.1"


def make_plan(rank: int, world: int, port: int, **changes: object) -> MemberPlan:
    fields = {
        "mode": "probe",
        "job": "group-test",
        "segment": 1,
        "rank": rank,
        "world_size": world,
        "host": HOST,
        "port": port,
        "start_step": 0,
        "steps": 0,
        "batch_size": 1,
        "join_timeout_s": 30.0,
        "timeout_s": 30.0,
    }
    fields.update(changes)
    return MemberPlan(**fields)  # type: ignore[arg-type]


def ring_then_one_dies(rank: int, world: int, port: int) -> dict:
    """Exchange once around the ring, pass a state 0 -> 1, then rank 2 vanishes."""
    out: dict = {}
    plan = make_plan(rank, world, port)
    try:
        with joined_group(plan, HOST):
            mine = {f"{rank}.weight": torch.full((3,), float(rank))}
            done = exchange_ring(mine, rank, world)
            out["received"] = {k: v.tolist() for k, v in done.received.items()}
            out["sent_bytes"] = done.sent_bytes
            if rank == 0:
                send_state({"5.bias": torch.arange(4.0)}, 1)
            if rank == 1:
                out["pair"] = recv_state(0)["5.bias"].tolist()
            if rank == 2:
                os._exit(9)  # a board losing power: no goodbye
            out["begin"] = time.monotonic()
            for _ in range(100):
                exchange_ring(mine, rank, world)
    except PeerFailure as err:  # joined_group turns gloo's error into PeerFailure
        out["failure"] = (err.phase, str(err), time.monotonic() - out["begin"])
        out["lost_ranks"] = list(err.lost_ranks)
    return out


def one_is_stopped(rank: int, world: int, port: int) -> dict:
    """Rank 1 is stopped (SystemExit, as Flower's SIGINT handler raises) inside
    the group, then lingers (its exit handlers); rank 0 goes on exchanging."""
    out: dict = {}
    plan = make_plan(rank, world, port)
    try:
        with joined_group(plan, HOST):
            mine = {f"{rank}.weight": torch.zeros(3)}
            exchange_ring(mine, rank, world)
            if rank == 1:
                raise SystemExit(2)
            for _ in range(100):
                exchange_ring(mine, rank, world)
    except SystemExit:
        time.sleep(5.0)  # still alive while the peer probes
        out["stopped"] = True
    except PeerFailure as err:
        out["lost_ranks"] = list(err.lost_ranks)
        out["failure"] = str(err)
    return out


@pytest.mark.slow
def test_a_member_being_stopped_is_found_gone_while_its_process_lingers() -> None:
    results = run_ranks(one_is_stopped, 2, 2, free_port(), timeout=90)
    assert results[1] == ("ok", {"stopped": True}), results[1]
    status, out = results[0]
    assert status == "ok", out
    # its liveness port closed before its gloo connections did
    assert out["lost_ranks"] == [1], out["failure"]


def join_alone(rank: int, port: int) -> tuple[str, str, float]:
    plan = make_plan(0, 2, port, join_timeout_s=3.0)
    begin = time.monotonic()
    try:
        with joined_group(plan, HOST):
            return ("joined", "", 0.0)
    except PeerFailure as err:
        return (err.phase, str(err), time.monotonic() - begin)


@pytest.mark.slow
def test_members_exchange_around_the_ring_and_survivors_learn_of_a_loss_fast() -> None:
    results = run_ranks(ring_then_one_dies, 3, 3, free_port(), timeout=90)
    assert results[2][0] == "exit 9"
    for rank in (0, 1):
        status, out = results[rank]
        assert status == "ok", out
        predecessor = (rank - 1) % 3
        assert out["received"] == {f"{predecessor}.weight": [float(predecessor)] * 3}
        assert out["sent_bytes"] > 0
        phase, text, seconds = out["failure"]
        # The loss surfaces as PeerFailure from the connection closing, long
        # before the 30 s operation timeout: fail fast, never hang.
        assert phase == "train"
        assert "lost a peer" in text
        assert 0 <= seconds < 30
        # ... and names the rank whose process is gone: its liveness port refused.
        assert out["lost_ranks"] == [2], text
        assert "rank 2 (127.0.0.1:" in text and "refused" in text, text
    assert results[1][1]["pair"] == [0.0, 1.0, 2.0, 3.0]


def silent_peer(rank: int, port: int, mode: str) -> tuple[str, float]:
    """Rank 1 joins, then stays alive but silent; rank 0 waits for its tensor."""
    plan = make_plan(rank, 2, port, join_timeout_s=30.0, timeout_s=2.0)
    try:
        with joined_group(plan, HOST):
            begin = time.monotonic()
            if rank == 1:
                time.sleep(12.0)
                return ("slept", 0.0)
            if mode == "all_reduce":
                dist.all_reduce(torch.ones(3))
            else:
                recv_state(1)
            return ("received", 0.0)
    except PeerFailure as err:
        return (err.phase, time.monotonic() - begin)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["all_reduce", "recv"])
def test_an_operation_waits_for_the_operation_timeout_not_the_join_timeout(
    mode: str,
) -> None:
    """A peer that joined and then went silent (a hung board) surfaces after
    the plan's timeout_s, not after the longer join timeout: init_process_group's
    ``timeout`` (the join's) also became the operation timeout, so survivors of
    a lost member waited 20 s where the strategy's grace allowed 10 (red CI)."""
    results = run_ranks(silent_peer, 2, free_port(), mode, timeout=90)
    status, (phase, seconds) = results[0]
    assert status == "ok" and phase == "train", results
    assert 1.5 < seconds < 8.0, results


def late_member(rank: int, port: int) -> tuple[str, float]:
    plan = make_plan(rank, 2, port, join_timeout_s=30.0, timeout_s=1.0)
    if rank == 1:
        time.sleep(4.0)  # its Flower message came late
    begin = time.monotonic()
    try:
        with joined_group(plan, HOST):
            dist.all_reduce(torch.ones(2))
            return ("joined", time.monotonic() - begin)
    except PeerFailure as err:
        return (str(err), time.monotonic() - begin)


@pytest.mark.slow
def test_a_member_later_than_the_operation_timeout_still_joins() -> None:
    """The join is bounded by join_timeout_s alone, not by the shorter timeout_s."""
    results = run_ranks(late_member, 2, free_port(), timeout=90)
    assert results[0][0] == "ok" and results[0][1][0] == "joined", results
    assert results[0][1][1] > 3.0, results
    assert results[1][1][0] == "joined", results


@pytest.mark.slow
def test_a_member_that_never_arrives_ends_the_join_after_its_timeout() -> None:
    results = run_ranks(join_alone, 1, free_port(), timeout=60)
    status, (phase, text, seconds) = results[0]
    assert status == "ok"
    assert phase == "join"
    assert "a member did not arrive" in text and "join timeout 3 s" in text
    assert 2.5 <= seconds < 30


def test_a_rendezvous_port_in_use_is_a_plan_error_naming_the_port() -> None:
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(
            RendezvousError, match=f"rendezvous port {port} on {HOST} is in use"
        ):
            check_bindable(HOST, port)


def test_an_address_that_is_not_this_machines_is_a_plan_error() -> None:
    with pytest.raises(RendezvousError, match="not an address of this machine"):
        check_bindable("192.0.2.1", 0)  # TEST-NET-1: never assigned to a host


def test_segments_rotate_over_the_port_range() -> None:
    assert [segment_port(29500, 3, s) for s in range(5)] == [
        29500,
        29501,
        29502,
        29500,
        29501,
    ]
    with pytest.raises(ValueError, match=r"outside 1\.\.65535"):
        segment_port(65535, 2, 0)
