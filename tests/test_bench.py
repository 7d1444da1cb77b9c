"""``flowerbed bench``: the quick run's structure, the statistics, the headline.

Structure only: no test looks at how fast anything ran.
"""

import json
from pathlib import Path
from typing import Any

import pytest
from flowerbed.bench import machinery as bench_machinery
from flowerbed.bench import suite as bench_suite
from flowerbed.bench.cli import sections_from_args
from flowerbed.bench.machinery_section import PARTS
from flowerbed.bench.suite import (
    FLEETS,
    REFERENCE,
    STRATEGIES,
    headline,
    spread,
    summarise_cells,
)
from flowerbed.cli import main


def _cell(strategy: str, seed: int, ttt: float | None, acc: float) -> dict[str, Any]:
    return {
        "fleet": "phones-10x",
        "strategy": strategy,
        "seed": seed,
        "time_to_target_s": ttt,
        "final_accuracy": acc,
        "energy_j": 10.0,
        "edp_js": 20.0,
        "rounds": 5,
        "rounds_to_target": 3,
        "updates_discarded": 0,
        "samples_to_target": 1000,
        "fleet_throughput_sps": 500.0,
    }


def test_quick_bench_writes_page_results_and_one_plot_per_fleet(tmp_path: Path) -> None:
    out = tmp_path / "docs"
    assert main(["bench", "--quick", "--out", str(out)]) == 0

    results = json.loads((out / "benchmarks" / "results.json").read_text())
    assert results["format"] == 2
    assert list(results["sections"]) == ["suite", "machinery", "selection"]
    for entry in results["sections"].values():
        for key in ("created", "command", "machine", "versions", "wall_s", "data"):
            assert key in entry
        assert entry["machine"]["cpu_count"] >= 1
        assert entry["command"].startswith("flowerbed ")
    suite = results["sections"]["suite"]["data"]
    settings = suite["settings"]
    assert settings["quick"] and settings["seeds"] == [1]
    assert settings["fleets"] == list(FLEETS)
    assert settings["strategies"] == list(STRATEGIES)
    assert len(suite["cells"]) == len(FLEETS) * len(STRATEGIES)
    for cell in suite["cells"]:
        if "error" in cell:
            continue
        assert cell["rounds"] == 2 * STRATEGIES[cell["strategy"]].versions_per_round
        assert cell["updates_discarded"] == (
            cell["updates_dispatched"] - cell["updates_folded"]
        )
        assert cell["updates_folded"] <= cell["updates_dispatched"]
        assert cell["edp_js"] == pytest.approx(
            cell["energy_j"] * cell["virtual_time_s"]
        )
    for fleet in FLEETS:
        png = out / "benchmarks" / f"accuracy-{fleet}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "available" in suite["headline"]
    machinery = results["sections"]["machinery"]["data"]
    assert list(machinery) == list(PARTS)
    agg = machinery["aggregation"]
    assert {p["method"] for p in agg["points"]} == {"streaming", "flower"}
    assert machinery["engines"]["skipped"]
    assert machinery["gateway"]["skipped"]
    assert "objectives" in results["sections"]["selection"]["data"]

    page = (out / "BENCHMARKS.md").read_text()
    for entry in results["sections"].values():
        assert entry["created"] in page
        assert entry["command"] in page
    for fleet in FLEETS:
        assert f"### {fleet}" in page
        assert f"benchmarks/accuracy-{fleet}.png" in page
    for heading in ("## Headline", "## Machinery cost", "## Cluster selection"):
        assert heading in page


def test_spread_is_median_min_max_of_the_runs_that_have_a_value() -> None:
    assert spread([3.0, 1.0, 2.0]) == {
        "median": 2.0,
        "min": 1.0,
        "max": 3.0,
        "n": 3,
        "missing": 0,
    }
    # One of three never reached the target: the median run did, so it counts.
    assert spread([4.0, None, 2.0])["median"] == 3.0
    assert spread([4.0, None, 2.0])["missing"] == 1
    # Two of three never reached it: the median run did not.
    assert spread([None, None, 2.0])["median"] is None


def test_speedup_pairs_each_seed_with_the_reference_on_that_seed() -> None:
    cells = [
        _cell(REFERENCE, 1, 10.0, 0.90),
        _cell(REFERENCE, 2, 20.0, 0.92),
        _cell(REFERENCE, 3, 30.0, 0.94),
        _cell("deadline", 1, 5.0, 0.91),  # 2x, +1 point
        _cell("deadline", 2, 5.0, 0.90),  # 4x, -2 points
        _cell("deadline", 3, 10.0, 0.94),  # 3x, 0 points
    ]
    table = summarise_cells(cells)["phones-10x"]
    assert table["deadline"]["speedup"]["median"] == pytest.approx(3.0)
    assert table["deadline"]["speedup"]["min"] == pytest.approx(2.0)
    assert table["deadline"]["final_accuracy_diff"]["median"] == pytest.approx(0.0)
    assert table[REFERENCE]["speedup"]["median"] == pytest.approx(1.0)


def test_headline_picks_the_fastest_flowerbed_strategy_and_compares_to_ideal() -> None:
    cells = [
        _cell(REFERENCE, 1, 12.0, 0.90),
        _cell("flwr-fedavg-timeout", 1, 1.0, 0.90),  # Flower's: never the headline
        _cell("rw-fednova", 1, 6.0, 0.90),  # 2x
        _cell("deadline", 1, 3.0, 0.896),  # 4x, -0.4 points
    ]
    h = headline(cells, summarise_cells(cells))
    assert h["best_strategy"] == "deadline"
    assert h["median_speedup"] == pytest.approx(4.0)
    assert h["final_accuracy_diff_points"] == pytest.approx(-0.4)
    assert h["target_met"] is True
    # Ideal: 1000 samples / 500 samples per second = 2 s.
    assert h["ideal_time_to_target_s"] == pytest.approx(2.0)
    assert h["best_over_ideal"] == pytest.approx(1.5)
    assert h["reference_over_ideal"] == pytest.approx(6.0)


def test_headline_misses_the_target_when_accuracy_drops_more_than_half_a_point() -> (
    None
):
    cells = [_cell(REFERENCE, 1, 12.0, 0.90), _cell("deadline", 1, 3.0, 0.894)]
    assert headline(cells, summarise_cells(cells))["target_met"] is False


def test_median_task_timeout_is_a_quarter_above_the_median_nodes_task() -> None:
    scenario = bench_suite.Scenario(fleet="uniform", num_nodes=4)
    times = bench_suite.task_seconds(scenario, 4)
    assert len(set(times)) == 1  # every node a Pi 4B
    assert bench_suite.STRATEGIES["flwr-fedavg-timeout"].timeout is not None
    assert bench_suite.STRATEGIES["flwr-fedavg-timeout"].timeout(
        scenario
    ) == pytest.approx(1.25 * times[0])


def test_planned_memory_follows_each_algorithm() -> None:
    overhead = bench_machinery.PROCESS_OVERHEAD_BYTES
    # Streaming: base, reply (float32) + delta, sum (float64) = 24 bytes per float.
    assert bench_machinery.planned_bytes("streaming", 200, 1000) == overhead + 24_000
    # Flower's list: every reply plus result and temporary, 4 bytes each.
    assert bench_machinery.planned_bytes("flower", 10, 1000) == overhead + 52_000


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("fleets", "phones-10x,laptops", "unknown fleet 'laptops'; valid choices: "),
        ("strategies", "fedsgd", "unknown strategy 'fedsgd'; valid choices: "),
        ("machinery", "gpu", "unknown machinery part 'gpu'; valid choices: "),
        ("machinery", "selection", "unknown machinery part 'selection'; valid "),
        ("seeds", 0, "--seeds must be >= 1"),
        ("sections", "suite,tiles", "unknown section 'tiles'; valid choices: "),
    ],
)
def test_bad_options_name_the_valid_choices(
    option: str, value: Any, message: str
) -> None:
    import argparse

    args = argparse.Namespace(
        quick=True,
        seeds=None,
        nodes=None,
        rounds=None,
        fleets=None,
        strategies=None,
        machinery=None,
        jobs=None,
        sections=None,
    )
    setattr(args, option, value)
    with pytest.raises(ValueError, match=message):
        sections_from_args(args)
