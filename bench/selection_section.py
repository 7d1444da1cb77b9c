"""Section "selection": how often ClusterSelection picks the best configuration.

:func:`flowerbed.bench.machinery.selection` over random simulated fleets (seed 0),
against the ground truth of the virtual clock.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .sections import SectionRun

TITLE = "Cluster selection"
FLEETS = 30
QUICK_FLEETS = 1
QUICK_DRAWS = 10  # confidence draws in quick mode: structure, not figures


def run(ctx: SectionRun) -> dict[str, Any]:
    from flowerbed.bench import machinery

    step = ctx.tracker(1)
    out = machinery.selection(
        QUICK_FLEETS if ctx.quick else FLEETS,
        seed=0,
        truth_rounds=2 if ctx.quick else 2000,
        num_rounds=10 if ctx.quick else 100,
        confidence_draws=QUICK_DRAWS if ctx.quick else None,
        jobs=1 if ctx.quick else getattr(ctx.args, "jobs", None) or os.cpu_count() or 1,
    )
    step("selection")
    return out


def render(data: Mapping[str, Any]) -> list[str]:
    from flowerbed.bench import report

    return ["## Cluster selection", "", *report.selection_lines(data)]
