"""The figures README and the deadline page quote are the published benchmark's.

README's "What it buys you" and docs/strategies/deadline.md copy the default's
speed-ups and energy ratios, with their intervals, from docs/BENCHMARKS.md. A
republished suite that moves them must move the quotes too: every
``X.XXx [L.LL, H.HH]`` there is one of the comparisons in
docs/benchmarks/results.json.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
QUOTED = re.compile(r"(\d+\.\d\d)x\s+\[(\d+\.\d\d),\s+(\d+\.\d\d)\]")
RATIOS = (
    "speedup",
    "energy_to_target_ratio_flower_over_flowerbed",
    "energy_ratio_flower_over_flowerbed",
)


def published() -> set[tuple[str, str, str]]:
    results = json.loads((ROOT / "docs/benchmarks/results.json").read_text())
    comparisons = results["sections"]["suite"]["data"]["comparisons"]
    out = set()
    for comparison in comparisons.values():
        for name in RATIOS:
            ratio = comparison.get(name) if comparison.get("available") else None
            if ratio:
                out.add(tuple(f"{ratio[k]:.2f}" for k in ("geomean", "low", "high")))
    return out  # type: ignore[return-value]


def section(path: str, title: str) -> str:
    text = (ROOT / path).read_text()
    start = text.index(title)
    end = text.find("\n## ", start + len(title))
    return text[start : end if end >= 0 else None]


@pytest.mark.parametrize(
    ("path", "title"),
    [
        ("README.md", "## What it buys you"),
        ("docs/strategies/deadline.md", "## The recommended default"),
    ],
)
def test_every_quoted_ratio_is_a_published_one(path: str, title: str) -> None:
    quoted = QUOTED.findall(section(path, title))
    assert quoted, f"{path}: no ratio with its interval under {title!r}"
    stale = [q for q in quoted if q not in published()]
    assert not stale, f"{path} quotes ratios docs/BENCHMARKS.md no longer has: {stale}"
