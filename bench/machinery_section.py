"""Section "machinery": what the machinery costs, part by part.

Parts (``--machinery``, default all): ``aggregation`` (streaming against Flower's
list aggregation and the memory-bandwidth limit), ``throughput`` (node-tasks per
CPU-second and wall seconds per round: in-process per node, batched, over
workers, and ``flwr run`` on Ray), ``startup`` (imports, ``--help``, a short
``flowerbed sim``), ``client`` (client-side metering overhead), ``gateway``
(gateway memory per phone); see :mod:`flowerbed.bench.machinery`. Rerunning
some parts keeps the others' figures from the previous results.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .sections import PartsOption, SectionRun, app_root

TITLE = "Machinery cost"
PARTS = ("aggregation", "throughput", "startup", "client", "gateway")
"""Machinery parts, in the order they run."""
AGGREGATION_NODES = (10, 50, 138)
QUICK_AGGREGATION_NODES = (2,)
QUICK_FLOATS = 100_000
THROUGHPUT_NODES = (10, 100, 1000)
"""Fleet sizes (all sampled each round) for the throughput part; 10 is the
default scenario."""
THROUGHPUT_ROUNDS = 2
THROUGHPUT_RAY_NODES = (10, 100)
"""Fleet sizes run on Flower's simulation engine (``flwr run``, Ray) each time.
Not 1000: that one run costs more than the rest of the part (339 of its 780 s
when it was last run); its last measurement is carried over with its date
(:func:`carry_ray_points`)."""
QUICK_THROUGHPUT_NODES = (10,)
QUICK_THROUGHPUT_MODES = ("legacy", "per-node", "batched")
"""--quick leaves out the workers (10 nodes are too few to split over them)."""
GATEWAY_PHONES = 100


OPTION = PartsOption(
    "machinery", PARTS, "; the other parts keep their previous figures"
)
add_arguments = OPTION.add_arguments
check = OPTION.check
choices = OPTION.choices


def run_part(part: str, quick: bool, app_dir: Path) -> dict[str, Any]:
    """One part at the plan's size; failures are recorded, not raised."""
    from flowerbed.bench import machinery as m
    from flowerbed.bench.aggregation import RESNET50_FLOATS

    started = time.monotonic()
    try:
        if part == "aggregation":
            out = m.aggregation_cost(
                QUICK_AGGREGATION_NODES if quick else AGGREGATION_NODES,
                QUICK_FLOATS if quick else RESNET50_FLOATS,
            )
        elif part == "throughput":
            out = (
                m.node_throughput(
                    QUICK_THROUGHPUT_NODES,
                    1,
                    app_dir,
                    repeats=1,
                    min_tasks=0,
                    modes=QUICK_THROUGHPUT_MODES,
                )
                if quick
                else m.node_throughput(
                    THROUGHPUT_NODES, THROUGHPUT_ROUNDS, app_dir, THROUGHPUT_RAY_NODES
                )
            )
        elif part == "startup":
            out = (
                {"skipped": "--quick does not time start-up"}
                if quick
                else m.startup_seconds()
            )
        elif part == "client":
            out = m.client_overhead(repeats=3 if quick else 30)
        elif part == "gateway":
            out = (
                {"skipped": "--quick does not start a gateway"}
                if quick
                else m.gateway_memory(GATEWAY_PHONES)
            )
        else:
            raise ValueError(f"unknown machinery part {part!r}")
    except Exception as err:  # recorded in the report
        out = {"error": f"{type(err).__name__}: {err}"}
    out["part_wall_s"] = time.monotonic() - started
    return out


def run(ctx: SectionRun) -> dict[str, Any]:
    parts = OPTION.chosen(ctx.args)
    step = ctx.tracker(len(parts))
    previous = dict(ctx.previous or {})
    out = {p: previous[p] for p in PARTS if p in previous and p not in parts}
    for part in parts:
        measured = datetime.now(timezone.utc).isoformat(timespec="seconds")
        load = list(os.getloadavg())  # the figures depend on it: on the page
        out[part] = {
            "measured": measured,
            "load_average": load,
            "cores": os.cpu_count(),
            "quick": ctx.quick,  # toy sizes: the page judges no target on them
            **run_part(part, ctx.quick, app_root()),
        }
        if part == "throughput" and not ctx.quick:
            carry_ray_points(out[part], previous.get(part))
        step(part)
    return {p: out[p] for p in PARTS if p in out}


def carry_ray_points(new: dict[str, Any], old: Mapping[str, Any] | None) -> None:
    """Put into ``new`` (a throughput part) the previous part's Flower (Ray)
    points at sizes ``new`` did not run on Ray, each marked ``carried_from``
    with the date it was measured, after ``new``'s points of the same size."""
    if not old or "points" not in new:
        return
    ran = {p["cohort"] for p in new["points"] if p["mode"] == "ray"}
    for point in old.get("points", []):
        if point["mode"] != "ray" or point["cohort"] in ran or "error" in point:
            continue
        carried = {**point, "carried_from": point.get("carried_from", old["measured"])}
        at = max(
            (
                i + 1
                for i, p in enumerate(new["points"])
                if p["cohort"] == point["cohort"]
            ),
            default=len(new["points"]),
        )
        new["points"].insert(at, carried)


def full_run_seconds(data: Mapping[str, Any], wall_s: float) -> float:
    """What a full ``flowerbed bench`` would spend here: every part at its own
    recorded time (parts are rerun and published one at a time)."""
    parts = [float(v["part_wall_s"]) for v in data.values() if "part_wall_s" in v]
    return sum(parts) if parts else wall_s


def render(data: Mapping[str, Any]) -> list[str]:
    from flowerbed.bench import report

    return report.machinery_lines(data)
