"""The text ``flowerbed bench`` writes comes from the results beside it.

A quick run's page and console summary say first that toy sizes check structure
only; they judge no target, estimate no full-run duration and carry no figure,
issue number, commit id or date that is not in their results. The page names the
command that wrote it. Rendered from a small hand-made result set: nothing runs.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from flowerbed.bench import cli, report
from flowerbed.bench.sections import SECTIONS
from flowerbed.cli import build_parser
from test_tiles_bench import tiles_data

PUBLISHED_PROSE = (
    "1.36x",
    "[1.28, 1.45]",
    "1.65x",
    "0.90x",
    "1.93x",
    "58.7%",
    "64.6%",
    "39 minutes",
    "60 minutes",
    "da15461",
    "9049e98",
    "2026-11-23",
)
"""Figures, commit ids and dates that prose written for one published run put on
every page, none of them in the result set below."""
COMMIT_ID = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
VERDICT = re.compile(r"\bmet\b", re.IGNORECASE)


def entry(data: dict[str, Any], quick: bool) -> dict[str, Any]:
    return {
        "created": "2030-01-02T03:04:05+00:00",
        "command": "flowerbed bench --quick" if quick else "flowerbed bench",
        "quick": quick,
        "machine": {
            "cpu_model": "Test CPU",
            "cpu_count": 3,
            "memory_bytes": 8 * 2**30,
            "load_average": [0.5, 0.25, 0.125],
        },
        "versions": {"flowerbed": "0.0.0"},
        "wall_s": 12.0,
        "data": data,
    }


def part(quick: bool, **data: Any) -> dict[str, Any]:
    """A part of a section that records when it was measured."""
    return {
        "measured": "2030-01-02T03:04:06+00:00",
        "load_average": [0.5, 0.25, 0.125],
        "quick": quick,
        **data,
    }


def suite(quick: bool) -> dict[str, Any]:
    """One workload, one Flower and one flowerbed configuration, one seed; its
    one target is met by the data (a full page must say so, a quick one not)."""
    config = {
        "timeout_s": None,
        "ttt": {"0.95": [7.0]},
        "final_accuracy": [0.52],
        "accuracy_at_rounds": {"10": [0.4], "25": [None], "50": [None]},
        "final_slow_accuracy": [0.51],
        "energy_j": [3000.0],
        "bytes": [2e9],
        "rounds": [12],
    }
    return {
        "settings": {
            "quick": quick,
            "seeds": [1],
            "workloads": ["toy"],
            "strategies": ["flwr-fedavg", "deadline"],
            "workload_descriptions": {
                "toy": {
                    "description": "A workload described at its full size",
                    "model": "mlp",
                    "charge_as": "",
                    "population": 8,
                    "fleet": "mixed",
                    "cohort": 4,
                    "fraction_train": 0.5,
                    "availability": False,
                    "local_steps": 2,
                    "batch_size": 8,
                    "learning_rate": 0.1,
                    "budget_rounds": 3,
                }
            },
            "strategy_descriptions": {"flwr-fedavg": "Flower", "deadline": "ours"},
            "strategy_families": {"flwr-fedavg": "flower", "deadline": "flowerbed"},
        },
        "cells": [],
        "errors": [],
        "summary": {
            "toy": {
                "targets": {"0.95": 0.5},
                "converged_accuracy": 0.53,
                "configs": {"flwr-fedavg": config, "deadline": config},
            }
        },
        "comparisons": {"toy": {"available": False}},
        "headline": {
            "available": True,
            "workload": "toy",
            "seeds": [1],
            "flowerbed": "deadline",
            "flower": "flwr-fedavg",
            "target_fraction": 0.95,
            "target_accuracy": 0.5,
            "speedup": {"geomean": 0.97, "low": None, "high": None},
            "final_accuracy_diff_points": {"mean": 0.0, "low": None, "high": None},
        },
        "targets": [
            {"name": "toy", "text": "toy: at least as fast", "met": True, "x": 0.97}
        ],
    }


def machinery(quick: bool) -> dict[str, Any]:
    """Aggregation at 60% of the limit and batching 7.2x the per-node path:
    both targets met by the data."""
    return {
        "aggregation": part(
            quick,
            floats=1000,
            update_bytes=4000,
            bandwidth_gbps=30.0,
            limit_gbps=10.0,
            memory_available_bytes=4e9,
            memory_budget_bytes=3e9,
            points=[
                {
                    "method": "grouped",
                    "nodes": 2,
                    "gbps": 6.0,
                    "of_limit": 0.6,
                    "vs_flower": 2.0,
                    "seconds": 0.01,
                    "peak_rss_bytes": 2e8,
                }
            ],
        ),
        "throughput": part(
            quick,
            rounds=1,
            points=[
                {
                    "mode": "batched",
                    "cohort": 10,
                    "tasks": 10,
                    "rounds": 1,
                    "tasks_per_cpu_s": 432.0,
                    "wall_s_per_round": 0.07,
                    "cpu_s": 0.02,
                    "final_accuracy": 0.3,
                }
            ],
            speedup_vs_legacy={"10": 7.2},
            speedup={"10": 5.6},
        ),
        "startup": part(quick, skipped="not in this result set"),
    }


def large_batch(quick: bool) -> dict[str, Any]:
    """Large batches 0.2 points above FedAvg: the target is met by the data."""

    def run(strategy: str, final: float) -> dict[str, Any]:
        return {
            "strategy": strategy,
            "seed": 1,
            "final-accuracy": final,
            "best-accuracy": final,
            "time-to-target-s": None,
            "virtual-s": 0.07,
            "wall-s": 0.3,
        }

    return {
        "accuracy": part(
            quick,
            phones=16,
            rounds=3,
            target=0.8,
            seeds=[1],
            runs=[run("LB", 0.171), run("FedAvg", 0.169)],
            sweep=[],
        )
    }


def tiles(quick: bool) -> dict[str, Any]:
    """Two boards holding 5x less activation memory each: the target is met."""
    mib = 2**20

    def run(name: str, boards: int, step: float, act: int) -> dict[str, Any]:
        return {
            "name": name,
            "boards": boards,
            "step-s": step,
            "predicted-step-s": step,
            "compute-s": [step] * boards,
            "link-s": [0.0] * boards,
            "predicted-link-s": 0.0,
            "activation-bytes": [act] * boards,
            "predicted-activation-bytes": [act] * boards,
            "peak-rss-bytes": [300 * mib] * boards,
            "baseline-rss-bytes": [200 * mib] * boards,
            "halo-macs": 0,
            "front-macs": 1,
            "bounds": [0, 6],
            "overrun-s": [0.0] * boards,
        }

    runs = [
        run("1 core", 1, 0.8, 10 * mib),
        run("1 board", 1, 0.2, 10 * mib),
        run("2 boards", 2, 0.11, 2 * mib),
    ]
    return {
        "quick": quick,
        **tiles_data("yolo-tiny 64x64, width 4", runs, [], grouping_boards=2),
    }


def pipeline(quick: bool) -> dict[str, Any]:
    """The DP 4x the even partition at 0.8 of the ideal, the model within 5%:
    every target met by the data."""

    def run(rate: float) -> dict[str, Any]:
        return {
            "samples-per-s": rate,
            "last-samples-per-s": rate,
            "end-to-end-samples-per-s": rate / 2,
            "partitions": [[3, 3]],
            "events": [],
        }

    return {
        "local": {
            "fleet": ["a", "b"],
            "settings": {
                "model": "deep-mlp",
                "batch_size": 16,
                "micro_batches": 4,
                "replicate_every": 3,
            },
            "runs": {"even-compute": run(10.0), "dp": run(40.0)},
            "ideal-samples-per-s": 50.0,
            "even-layers-sizes": [3, 3],
            "even-compute-sizes": [2, 4],
        },
        "virtual": {
            "model": "vgg",
            "rows": [],
            "model-errors": [0.05],
            "max-model-error": 0.05,
            "median-model-error": 0.05,
            "median-forecast-error": 0.05,
        },
        "meta": {
            "seconds": 20.0,
            "load-at-start": 0.5,
            "time-scale": 4.0,
            "quick": quick,
        },
    }


def results(quick: bool) -> dict[str, Any]:
    """Every registered section, from one run, quick or not."""
    data = {
        "suite": suite(quick),
        "machinery": machinery(quick),
        "selection": {"skipped": "not in this result set"},
        "large-batch": large_batch(quick),
        "tiles": tiles(quick),
        "pipeline": pipeline(quick),
    }
    assert list(data) == list(SECTIONS)
    return {
        "format": report.FORMAT,
        "sections": {k: entry(v, quick) for k, v in data.items()},
    }


@pytest.fixture
def quick_page() -> str:
    return report.render(results(quick=True), "flowerbed bench --quick")


def test_a_quick_page_says_first_that_it_checks_structure_only(quick_page: str) -> None:
    title, notice, *_ = quick_page.split("\n\n")
    assert title == "# flowerbed benchmarks"
    assert notice == report.QUICK_NOTICE
    assert "toy sizes that check the benchmark's structure only" in notice


def test_a_quick_page_names_the_command_that_wrote_it(quick_page: str) -> None:
    assert "Generated by `flowerbed bench --quick`; do not edit by hand." in quick_page
    assert "--publish" not in quick_page


def test_a_quick_page_judges_no_target(quick_page: str) -> None:
    # every target in the data is met: a full page says so (the next test)
    assert not VERDICT.findall(quick_page)
    targets = quick_page.split("## Targets\n\n", 1)[1].split("\n\n", 1)[0]
    assert targets == report.QUICK_TARGETS


def test_a_full_page_judges_every_target_its_data_meets() -> None:
    page = report.render(results(quick=False), "flowerbed bench")
    assert report.QUICK_NOTICE not in page
    assert "- **met**: toy: at least as fast" in page  # suite
    assert "4 replies per pass (`add_many`) at 2 nodes 60.0% (met)" in page
    assert "10 nodes (the default scenario) 7.2x (met)" in page
    assert "+0.2 points (met)." in page  # large-batch: 0.171 against 0.169
    assert "per board: 5.0x (met)" in page  # tiles: 10 MiB against 2 MiB
    assert "DP 4.00x over equal compute — **met**" in page  # pipeline: 40 / 10
    assert "0.80 — **met**" in page and "target within 15% — **met**" in page
    # six sections of 12 s each (machinery: none of its parts timed)
    assert "Full `flowerbed bench`, estimated from the runs above: about 1" in page
    assert "target at most 60 minutes: met." in page


def test_a_quick_page_extrapolates_no_duration(quick_page: str) -> None:
    assert "Full `flowerbed bench`" not in quick_page
    assert "estimated" not in quick_page.replace(
        "no full-run duration is estimated", ""
    )


def test_a_quick_page_holds_no_figure_id_or_date_but_its_results(
    quick_page: str,
) -> None:
    for text in PUBLISHED_PROSE:
        assert text not in quick_page
    assert "issue" not in quick_page.lower()
    assert not COMMIT_ID.findall(quick_page)
    stored = json.dumps(results(quick=True))
    assert set(DATE.findall(quick_page)) <= set(DATE.findall(stored))


def test_a_quick_page_leaves_out_prose_written_for_full_sizes(quick_page: str) -> None:
    assert "described at its full size" not in quick_page
    assert "### toy\n\nToy size. Model `mlp` trained for real" in quick_page


def test_the_quick_summary_says_so_first_and_judges_nothing() -> None:
    lines, failed = cli.summary(list(SECTIONS), results(quick=True), quick=True)
    assert failed == []
    assert lines[0] == f"[bold]{report.QUICK_TITLE}[/bold] {report.QUICK_DETAIL}"
    assert lines[1].startswith(
        "Quick run (toy sizes, not a measurement) on toy (1 seed)"
    )
    assert not any(VERDICT.search(line) for line in lines)


def test_the_full_summary_gives_the_headline_and_judges_the_targets() -> None:
    lines, _ = cli.summary(list(SECTIONS), results(quick=False), quick=False)
    assert lines[0].startswith(
        "Headline on toy (1 seed): flowerbed's recommended default, deadline,"
    )
    assert lines[1].startswith("- **met**: toy: at least as fast (x 0.97).")


def test_a_page_with_some_quick_sections_names_them() -> None:
    mixed = results(quick=False)
    mixed["sections"]["tiles"] = entry(tiles(quick=True), quick=True)
    page = report.render(mixed, "flowerbed bench --quick --sections tiles")
    assert "**Sections `tiles` ran `--quick`: toy sizes" in page
    assert "(`tiles`, quick: toy sizes)" in page
    assert "Full `flowerbed bench`" not in page
    assert "per board: 5.0x (met)" not in page


def test_an_entry_from_before_the_quick_field_is_read_from_its_command() -> None:
    assert report.is_quick({"command": "flowerbed bench --quick --out x"})
    assert not report.is_quick({"command": "flowerbed bench --sections tiles"})
    assert not report.is_quick({"command": "flowerbed bench", "quick": False})


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["bench", "--quick"], "flowerbed bench --quick"),
        (
            ["bench", "--out", "my out", "--sections", "suite", "--seeds", "2"],
            "flowerbed bench --sections suite --out 'my out' --seeds 2",
        ),
        (["bench", "--publish", "--rebuild"], "flowerbed bench --rebuild --publish"),
    ],
)
def test_the_command_is_rebuilt_from_the_options_given(
    argv: list[str], command: str
) -> None:
    args = build_parser(argv).parse_args(argv)
    assert cli.command_line(args) == command


@pytest.mark.parametrize(
    ("speedups", "said"),
    [
        (
            {"10": 6.1, "100": 8.4, "1000": 3.0},
            [
                "10 nodes (the default scenario) 6.1x (met)",
                "100 nodes 8.4x (met)",
                "1000 nodes 3.0x.",
            ],
        ),
        (
            {"10": 5.9, "100": 7.9},
            ["5.9x (**not met**)", "100 nodes 7.9x (**not met**)"],
        ),
    ],
)
def test_batched_throughput_is_judged_at_each_size_with_a_target(
    speedups: dict[str, float], said: list[str]
) -> None:
    data = results(quick=False)
    data["sections"]["machinery"]["data"]["throughput"]["speedup_vs_legacy"] = speedups
    page = report.render(data, "flowerbed bench")
    for text in said:
        assert text in page, text
    assert "at least 6x at 10 nodes a round and 8x at 100 nodes a round" in page
