"""Member plans for the span tests, built from one set of defaults.

A test names only the fields its case is about; the rest are a one-member
segment 1 on ``127.0.0.1:29500`` that starts at step 0 and runs no steps on a
batch of 1 (see :class:`flowerbed.parallel.plan.MemberPlan` for each field).
"""

from __future__ import annotations

from typing import Any

from flowerbed.parallel.plan import MemberPlan

HOST = "127.0.0.1"
"""The rendezvous host of every test plan: members run on this machine."""

DEFAULTS: dict[str, Any] = {
    "segment": 1,
    "rank": 0,
    "world_size": 1,
    "host": HOST,
    "port": 29500,
    "start_step": 0,
    "steps": 0,
    "batch_size": 1,
}
"""The required MemberPlan fields a test does not name."""


def member_plan(mode: str, job: str, **fields: Any) -> MemberPlan:
    """The MemberPlan of job ``job`` in ``mode`` with ``fields`` over DEFAULTS."""
    return MemberPlan(mode=mode, job=job, **{**DEFAULTS, **fields})
