"""The benchmark's pipeline section: options, the virtual clock part, the page."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from flowerbed.bench import pipeline_section as section


def test_unknown_parts_are_named() -> None:
    with pytest.raises(ValueError, match="unknown pipeline part 'fast'"):
        section.check(argparse.Namespace(pipeline="local,fast"))
    section.check(argparse.Namespace(pipeline="virtual"))


def test_the_virtual_clock_predicts_larger_fleets() -> None:
    data = section.virtual(None)
    rows = {r["devices"]: r for r in data["rows"]}
    assert sorted(rows) == [3, 4, 6, 8, 11]
    for r in rows.values():
        # The DP can always fall back to a subset, so it never loses to the
        # partition that assumes equal devices, and never beats the ideal.
        assert r["dp-samples-per-s"] >= r["even-samples-per-s"] * (1 - 1e-9)
        assert r["dp-samples-per-s"] <= r["ideal-samples-per-s"]
        assert 1 <= r["used"] <= r["devices"]
        assert sum(r["dp-sizes"]) == 11
    assert data["max-model-error"] is None  # no local runs given


def run(samples: float, model_error: float) -> dict:
    return {
        "devices": ["a", "b"],
        "rounds": {},
        "samples-per-s": samples,
        "last-samples-per-s": samples,
        "end-to-end-samples-per-s": samples / 2,
        "partitions": [[6, 5]],
        "lost-steps": 0,
        "wall-s": 10.0,
        "events": ["step 8: re-partition: because"],
        "model-errors": [model_error],
    }


def test_the_page_states_each_target_and_whether_it_is_met() -> None:
    local = {
        "fleet": ["jetson-nano", "rpi4b"],
        "settings": {
            "model": "vgg",
            "batch_size": 32,
            "micro_batches": 16,
            "replicate_every": 3,
        },
        "runs": {
            "even-layers": run(8.0, 0.05),
            "even-compute": run(10.0, 0.05),
            "dp": run(40.0, 0.05),
            "single": run(30.0, 0.05),
            "dp-slowdown": run(35.0, 0.2),
        },
        "ideal-samples-per-s": 45.0,
        "even-layers-sizes": [6, 5],
        "even-compute-sizes": [5, 6],
    }
    page = "\n".join(
        section.render({"local": local, "virtual": section.virtual(local)})
    )
    # 40 / 10 = 4x over equal compute (>= 3x: met); 40 / 45 = 0.89 of the ideal
    # (>= 0.8: met); the worst model error 20% (> 15%: not met).
    assert "DP 4.00x over equal compute, 5.00x over equal layers — **met**" in page
    assert "Target >= 0.8 of the ideal: 0.89 — **met**" in page
    assert "largest error 20%, median 5% over 5 rounds" in page
    assert "**not met**" in page
    assert "Re-partition logged: `step 8: re-partition: because`" in page
    assert section.render({"error": "boom"})[-2] == "The section failed: boom"


def test_the_guide_shows_the_published_figures() -> None:
    root = Path(__file__).parents[1]
    results = json.loads((root / "docs" / "benchmarks" / "results.json").read_text())
    data = results["sections"]["pipeline"]["data"]
    page = (root / "docs" / "pipeline.md").read_text()
    block = page.split(section.GUIDE_START + "\n", 1)[1].split(section.GUIDE_END)[0]
    assert block == section.guide_block(data), (
        "docs/pipeline.md's figures differ from docs/benchmarks/results.json: run "
        "update_guide() (see flowerbed.bench.pipeline_section)"
    )


def test_the_page_lists_each_kill_modes_time_to_the_next_step() -> None:
    kill = {
        "delivered-s": 3.3,
        "failure-to-next-step-s": 11.2,
        "member-setup-s": 8.6,
        "clientapp-start-s": 5.6,
        "rendezvous-s": 0.6,
    }
    data = {
        "deployment": {
            "kills": {"board": kill, "supernode": {**kill, "delivered-s": 4.0}},
            "job-wall-s": 95.0,
            "finished": True,
            "rounds": {
                "1": {
                    "setup-s": 17.5,
                    "segment-s": 20.0,
                    "setup-share": 0.875,
                    "member-setup-s": 12.1,
                }
            },
        }
    }
    data["deployment"]["sized"] = {
        "rounds": {
            "2": {
                "setup-s": 9.0,
                "segment-s": 90.0,
                "setup-share": 0.1,
                "member-setup-s": 6.0,
                "next-steps": 810,
            }
        }
    }
    lines = section.render(data)
    assert "| 1 | 17.5 | 20.0 | 88% | 12.1 |" in lines
    assert "| 2 | 810 | 9.0 | 90.0 | 10% |" in lines
    assert "| board | 3.3 | 11.2 | 8.6 | 5.6 | 0.6 |" in lines
    assert "| supernode | 4.0 | 11.2 | 8.6 | 5.6 | 0.6 |" in lines
    assert "The job finished in 95 s." in lines


def test_the_deployment_part_is_a_choice() -> None:
    section.check(argparse.Namespace(pipeline="deployment"))
    with pytest.raises(ValueError, match="deployment"):
        section.check(argparse.Namespace(pipeline="deploy"))
