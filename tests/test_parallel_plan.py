"""Plans are pure data: they survive the wire and reject what cannot be done."""

from __future__ import annotations

import json

import pytest
from flowerbed.parallel.plan import (
    PLAN_KEY,
    LayerSource,
    MemberPlan,
    PlanError,
    boundaries,
    check_address,
    stage_sizes,
)
from flwr.app import ConfigRecord
from plans import member_plan


def plan(**changes: object) -> MemberPlan:
    base = member_plan(
        "pipeline",
        "job-1",
        segment=3,
        rank=1,
        world_size=3,
        port=29501,
        start_step=20,
        steps=10,
        batch_size=32,
        micro_batches=4,
        replicate_every=5,
        partition=(0, 4, 9, 12),
        sources=(LayerSource(4, "peer", 0, 20), LayerSource(5, "self", -1, 20)),
        model="mlp",
        model_args={"depth": 10},
        options={"input-shape": [1, 8, 8]},
    )
    return base.with_changes(**changes) if changes else base


def test_a_plan_survives_a_configrecord() -> None:
    original = plan()
    record = ConfigRecord(original.to_config())
    assert MemberPlan.from_config(record) == original


def test_derived_fields_follow_the_partition() -> None:
    p = plan()
    assert list(p.layers) == [4, 5, 6, 7, 8]
    assert list(p.layers_of(2)) == [9, 10, 11]
    assert (p.predecessor, p.successor) == (0, 2)
    assert plan(rank=2).successor == 0  # the ring closes: last stage -> first
    assert p.end_step == 30
    assert boundaries([4, 5, 3]) == (0, 4, 9, 12)
    assert stage_sizes((0, 4, 9, 12)) == [4, 5, 3]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"rank": 3}, "outside the group of 3"),
        ({"partition": (0, 4, 4, 12)}, "increase strictly"),
        ({"partition": (0, 4, 12)}, "4 stage boundaries"),
        ({"port": 70000}, "<= 65535"),
        ({"host": "0.0.0.0"}, "wildcard"),
        ({"host": "bad host!"}, "neither an IP address nor a host name"),
        ({"schedule": "zb"}, "valid choices: 1f1b, gpipe"),
        ({"timeout_s": 0.0}, "'timeout_s' must be > 0"),
        ({"sources": (LayerSource(4, "peer", 7, 20),)}, "comes from rank 7"),
        ({"sources": (LayerSource(4, "cloud", -1, 20),)}, "valid: self, peer, central"),
        ({"job": "../etc"}, "'job' must be"),
    ],
)
def test_bad_plans_are_rejected_naming_the_field(changes: dict, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        plan(**changes)


def test_a_plan_from_the_wire_is_checked_like_any_input() -> None:
    data = json.loads(plan().to_json())
    data["rank"] = 5
    with pytest.raises(PlanError, match="outside the group"):
        MemberPlan.from_json(json.dumps(data))
    data = json.loads(plan().to_json())
    data["surprise"] = 1
    with pytest.raises(PlanError, match="unknown fields"):
        MemberPlan.from_json(json.dumps(data))
    data = json.loads(plan().to_json())
    data["version"] = 99
    with pytest.raises(PlanError, match="update flowerbed"):
        MemberPlan.from_json(json.dumps(data))
    with pytest.raises(PlanError, match="not a span job"):
        MemberPlan.from_config({})
    with pytest.raises(PlanError, match="not valid JSON"):
        MemberPlan.from_config({PLAN_KEY: "{"})


@pytest.mark.parametrize("address", ["192.168.1.12", "::1", "rpi4-kitchen.local"])
def test_addresses_peers_can_reach_are_accepted(address: str) -> None:
    assert check_address(address) == address


@pytest.mark.parametrize("address", [None, "", "  ", "0.0.0.0", 12])
def test_missing_or_wildcard_addresses_say_how_to_set_one(address: object) -> None:
    with pytest.raises(PlanError, match="address"):
        check_address(address, "node_config 'address'")
