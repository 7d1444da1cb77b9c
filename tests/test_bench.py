"""``flowerbed bench``: the quick run's structure, the suite's statistics, the sweep.

Structure only: no test looks at how fast anything ran.
"""

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flowerbed.bench import machinery as bench_machinery
from flowerbed.bench import suite
from flowerbed.bench.cli import sections_from_args
from flowerbed.bench.machinery_section import PARTS
from flowerbed.bench.sections import SECTIONS
from flowerbed.cli import main


def test_quick_bench_writes_page_results_and_one_plot_per_workload(
    tmp_path: Path,
) -> None:
    out = tmp_path / "docs"
    assert main(["bench", "--quick", "--out", str(out)]) == 0

    results = json.loads((out / "benchmarks" / "results.json").read_text())
    assert results["format"] == 2
    assert list(results["sections"]) == list(SECTIONS)
    for entry in results["sections"].values():
        for key in ("created", "command", "machine", "versions", "wall_s", "data"):
            assert key in entry
    data = results["sections"]["suite"]["data"]
    settings = data["settings"]
    assert settings["quick"] and settings["seeds"] == [1]
    assert settings["workloads"] == list(suite.WORKLOADS)
    assert settings["strategies"] == suite.DEFAULT_CONFIGS
    assert len(data["cells"]) == len(suite.WORKLOADS) * len(suite.DEFAULT_CONFIGS)
    assert data["errors"] == []
    for cell in data["cells"]:
        if "skipped" in cell:
            assert suite.CONFIGS[cell["config"]].quantile is not None
            continue
        assert cell["updates_folded"] <= cell["updates_dispatched"]
        assert cell["rounds"] == len(cell["curve"]) >= 1
        times = [p[1] for p in cell["curve"]]
        assert times == sorted(times)
        # the run stops at the budget: only its last round may end past it
        assert all(t < cell["budget_s"] for t in times[:-1])
        assert cell["bytes"] > 0 and cell["energy_j"] > 0
    for workload in suite.WORKLOADS:
        png = out / "benchmarks" / f"accuracy-{workload}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert set(data["summary"][workload]["configs"]) <= set(suite.CONFIGS)
    assert data["headline"]["available"]
    assert [t["name"] for t in data["targets"]] == ["device-correlated", "iid", "ideal"]
    machinery = results["sections"]["machinery"]["data"]
    assert list(machinery) == list(PARTS)
    agg = machinery["aggregation"]
    assert {p["method"] for p in agg["points"]} == {
        "streaming",
        "grouped",
        "strategy",
        "flower",
    }
    assert all(p["of_limit"] > 0 and p["limit_gbps"] > 0 for p in agg["points"])
    [(size, speedup)] = machinery["throughput"]["speedup"].items()
    assert size == "10" and speedup > 0
    [(size, speedup)] = machinery["throughput"]["speedup_vs_legacy"].items()
    assert size == "10" and speedup > 0
    assert {p["mode"] for p in machinery["throughput"]["points"]} == {
        "legacy",
        "per-node",
        "batched",
    }
    assert machinery["startup"]["skipped"]
    assert machinery["gateway"]["skipped"]
    assert "objectives" in results["sections"]["selection"]["data"]

    page = (out / "BENCHMARKS.md").read_text()
    for workload in suite.WORKLOADS:
        assert f"### {workload}" in page
        assert f"benchmarks/accuracy-{workload}.png" in page
    for heading in ("## Headline", "## Targets", "## Machinery cost"):
        assert heading in page
    targets = page.split("## Targets", 1)[1].split("\n## ", 1)[0]
    assert targets.count("**met**") + targets.count("**not met**") == 3


def test_timeouts_sit_just_above_task_time_quantiles_and_skip_repeats() -> None:
    times = [10.0] * 3 + [20.0] * 3 + [100.0] * 4  # three device classes
    assert suite.quantile_timeouts(times) == pytest.approx(
        {0.25: 10.1, 0.5: 20.2, 0.75: 101.0}
    )
    # 75% of the devices take 10 s: q25, q50 and q75 are one run
    assert suite.quantile_timeouts([10.0] * 9 + [50.0]) == pytest.approx({0.25: 10.1})


def _entry(
    family: str, ttt: list[float | None], acc: list[float], timeout: float | None = 1.0
) -> dict[str, Any]:
    seeds = list(range(1, len(ttt) + 1))
    return {
        "family": family,
        "seeds": seeds,
        "timeout_s": timeout,
        "ttt": {"0.95": ttt},
        "reached": {"0.95": sum(t is not None for t in ttt)},
        "final_accuracy": acc,
        "final_slow_accuracy": acc,
        "energy_j": [100.0] * len(ttt),
        "updates_folded": [10] * len(ttt),
        "rounds": [5] * len(ttt),
        "end_s": [100.0] * len(ttt),
    }


def test_the_sweep_picks_the_best_timeout_with_hindsight() -> None:
    configs = {
        "flwr-fedavg": _entry("flower", [90.0, 95.0, 99.0], [0.9] * 3, None),
        # fastest median (30) but one seed never reached: counts at the budget
        "flwr-fedavg-q25": _entry("flower", [20.0, None, 30.0], [0.8] * 3),
        "flwr-fedavg-q50": _entry("flower", [40.0, 35.0, 45.0], [0.9] * 3),
        "flwr-fedavg-q75": _entry("flower", [60.0, 50.0, 70.0], [0.9] * 3),
        "deadline": _entry("flowerbed", [1.0, 1.0, 1.0], [0.9] * 3),
    }
    # medians: q25 -> [20, 30, 100] = 30; q50 = 40; q75 = 60; wait-all = 95
    assert suite.best_config(configs, "flower", 0.95, budget=100.0) == "flwr-fedavg-q25"
    # with two misses q25's median is the budget (100): it ranks below q50
    configs["flwr-fedavg-q25"]["ttt"]["0.95"] = [20.0, None, None]
    assert suite.best_config(configs, "flower", 0.95, budget=100.0) == "flwr-fedavg-q50"
    # equal times: the higher accuracy wins
    configs["flwr-fedavg-q75"] = _entry("flower", [40.0, 35.0, 45.0], [0.95] * 3)
    assert suite.best_config(configs, "flower", 0.95, budget=100.0) == "flwr-fedavg-q75"
    assert suite.best_config(configs, "flowerbed", 0.95, budget=100.0) == "deadline"


def test_confidence_intervals_by_hand() -> None:
    same = suite.log_ratio_ci([2.0, 2.0, 2.0])
    assert same["geomean"] == pytest.approx(2.0)
    assert same["low"] == pytest.approx(2.0) and same["high"] == pytest.approx(2.0)
    # logs 0 and ln 4: mean ln 2, sd ln4/sqrt(2), t(0.975, 1) = 12.7062
    ci = suite.log_ratio_ci([1.0, 4.0])
    half = 12.7062 * (math.log(4) / math.sqrt(2)) / math.sqrt(2)
    assert ci["geomean"] == pytest.approx(2.0)
    assert ci["low"] == pytest.approx(2.0 * math.exp(-half), rel=1e-4)
    assert ci["high"] == pytest.approx(2.0 * math.exp(half), rel=1e-4)
    m = suite.mean_ci([1.0, 3.0])  # mean 2, sd sqrt(2), half = 12.7062
    assert m["mean"] == 2.0
    assert m["low"] == pytest.approx(2.0 - 12.7062, rel=1e-4)
    assert suite.log_ratio_ci([3.0])["low"] is None


def test_curve_readings() -> None:
    curve = [[1, 10.0, 0.5, 0.1], [2, 20.0, 0.7, 0.2], [3, 30.0, 0.6, 0.3]]
    assert suite.accuracy_at_time(curve, 5.0, 0.1) == 0.1  # before round 1
    assert suite.accuracy_at_time(curve, 25.0, 0.1) == 0.7
    assert suite.accuracy_at_time(curve, 99.0, 0.1) == 0.6
    assert suite.time_to(curve, 0.65) == 20.0
    assert suite.time_to(curve, 0.8) is None


def test_ideal_keeps_the_cohort_busy_with_full_tasks() -> None:
    s = suite.Scenario(fleet="uniform", num_nodes=10, dataset="digits")
    times = suite.task_seconds(s)
    assert len(set(times)) == 1  # every device a Pi 4B
    # 100 updates by 5 devices, each task T seconds: 20 tasks each = 20 T
    assert suite.ideal_seconds(s, 5, 100) == pytest.approx(20 * times[0])


def test_slow_devices_data_weights_their_classes() -> None:
    from flowerbed.data import Dataset

    y = np.repeat(np.arange(10), 3)
    data = Dataset("t", y[:, None], y, y[:, None], y)
    s = suite.Scenario(fleet="phones-10x", num_nodes=10, partition="device")
    w = suite.slow_weights(data, s)
    assert w.sum() == pytest.approx(1.0)
    # group 0 holds classes 0-4 at 0.9 of its data
    assert w[y < 5].sum() == pytest.approx(0.9)
    iid = suite.slow_weights(data, suite.Scenario(fleet="phones-10x", num_nodes=10))
    assert iid == pytest.approx(np.full(30, 1 / 30))


def test_slow_devices_data_weights_writers_by_their_slow_devices_share() -> None:
    from flowerbed.data import Dataset
    from flowerbed.sims.fleet import assign_devices, speed_groups

    # 2 writers, 4 training samples each, over 4 devices: writer 0 on devices 0
    # and 2, writer 1 on devices 1 and 3 (two samples each)
    y = np.zeros(8, dtype=np.int64)
    writers = np.repeat([0, 1], 4)
    x = np.zeros((8, 1, 2), dtype=np.float32)
    data = Dataset("t", x, y, x[:4], y[:4], writers, np.array([0, 0, 1, 1]))
    s = suite.Scenario(fleet="phones-10x", num_nodes=4, partition="natural")
    slow = [g == 0 for g in speed_groups(assign_devices("phones-10x", 4, s.seed))]
    share = [(slow[0] + slow[2]) / 2, (slow[1] + slow[3]) / 2]
    expected = np.repeat(share, 2) / (2 * sum(share))
    assert suite.slow_weights(data, s) == pytest.approx(expected)


def test_the_page_sums_a_full_runs_minutes_against_the_60_minute_target() -> None:
    from flowerbed.bench import report

    def entry(wall_s: float, data: dict[str, Any]) -> dict[str, Any]:
        return {"wall_s": wall_s, "data": data}

    cells = [  # suite: default cells' own times over 2 workers; variants left out
        {"run_wall_s": 600.0, "family": "flower"},
        {"run_wall_s": 600.0, "family": "flowerbed"},
        {"run_wall_s": 999.0, "family": "variant"},
    ]
    results = {
        "sections": {
            "suite": entry(60.0, {"cells": cells, "settings": {"jobs": 2}}),
            "machinery": entry(
                60.0, {"a": {"part_wall_s": 120.0}, "b": {"part_wall_s": 60.0}}
            ),
            "selection": entry(300.0, {}),
            "large-batch": entry(240.0, {}),
            "tiles": entry(600.0, {}),
            "pipeline": entry(600.0, {}),
        }
    }
    minutes = report.full_run_minutes(results)
    assert minutes["machinery"] == 3.0 and minutes["selection"] == 5.0
    if (os.cpu_count() or 1) >= 2:
        assert minutes["suite"] == 10.0
    line = report.cost_line(results)
    assert f"about {sum(minutes.values()):.0f} minutes" in line
    assert line.count(": met.") == (sum(minutes.values()) <= 60)
    if (os.cpu_count() or 1) >= 2:  # the variant's 999 s over 2 workers
        assert "variant rows on this page are opt-in" in line
        assert "add about 8 minutes" in line
    results["sections"]["tiles"]["wall_s"] = 3600.0
    assert "60 minutes: not met" in report.cost_line(results)
    del results["sections"]["pipeline"]
    assert "Not run yet: pipeline" in report.cost_line(results)


def test_ray_points_not_rerun_are_carried_over_with_their_date() -> None:
    from flowerbed.bench.machinery_section import carry_ray_points

    def point(mode: str, cohort: int, **more: Any) -> dict[str, Any]:
        return {"mode": mode, "cohort": cohort, **more}

    old = {
        "measured": "2026-11-27T09:20:06+00:00",
        "points": [point("ray", 100, rate=1), point("ray", 1000, rate=2)],
    }
    new = {
        "measured": "2026-11-28T00:00:00+00:00",
        "points": [
            point("batched", 100),
            point("ray", 100, rate=3),
            point("batched", 1000),
            point("batched", 2000),
        ],
    }
    carry_ray_points(new, old)
    assert [(p["mode"], p["cohort"]) for p in new["points"]] == [
        ("batched", 100),
        ("ray", 100),
        ("batched", 1000),
        ("ray", 1000),
        ("batched", 2000),
    ]
    assert new["points"][1] == point("ray", 100, rate=3)  # rerun: the new one
    assert new["points"][3]["carried_from"] == old["measured"]
    again = {"measured": "2026-11-29T00:00:00+00:00", "points": [point("ray", 5)]}
    carry_ray_points(again, new)  # a carried point keeps its first date
    assert again["points"][-1]["carried_from"] == old["measured"]


def test_targets_say_met_or_not_from_the_comparisons() -> None:
    dev = {
        "available": True,
        "speedups": [1.5, 3.0, 2.5],
        "final_accuracy_diff_points": {"mean": 0.5},
        "slow_accuracy_diff_points": {"mean": 4.0},
        "flowerbed_over_ideal": 1.6,
        "flower_over_ideal": 2.0,
    }
    iid = {
        "available": True,
        "median_ttt_flowerbed": 10.0,
        "median_ttt_flower": 12.0,
        "energy_ratio_flower_over_flowerbed": {"geomean": 1.2},
    }
    targets = suite.check_targets({"mnist1d-device": dev, "mnist1d-iid": iid})
    met = {t["name"]: t["met"] for t in targets}
    assert met == {"device-correlated": True, "iid": True, "ideal": False}
    dev["slow_accuracy_diff_points"] = {"mean": 2.9}
    assert not suite.check_targets({"mnist1d-device": dev})[0]["met"]


def test_planned_memory_follows_each_algorithm() -> None:
    overhead = bench_machinery.PROCESS_OVERHEAD_BYTES
    # Streaming: base, reply (array + bytes), float32 sum, result and the two
    # bandwidth arrays = 28 bytes per float; grouped: 4 replies of 8 bytes instead.
    assert bench_machinery.planned_bytes("streaming", 200, 1000) == overhead + 28_000
    assert bench_machinery.planned_bytes("grouped", 200, 1000) == overhead + 52_000
    # The strategy: the sum's other memory, the encoded and the kept result.
    assert bench_machinery.planned_bytes("strategy", 200, 1000) == overhead + 64_000
    # Flower's list: every reply, result, temporary, bandwidth arrays: 4 bytes each.
    assert bench_machinery.planned_bytes("flower", 10, 1000) == overhead + 56_000


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("workloads", "mnist1d-iid,cifar", "unknown workload 'cifar'; valid choices: "),
        ("strategies", "fedsgd", "unknown strategy 'fedsgd'; valid choices: "),
        ("machinery", "gpu", "unknown machinery part 'gpu'; valid choices: "),
        ("machinery", "selection", "unknown machinery part 'selection'; valid "),
        ("seeds", 0, "--seeds must be >= 1"),
        ("sections", "suite,gpu", "unknown section 'gpu'; valid choices: "),
    ],
)
def test_bad_options_name_the_valid_choices(
    option: str, value: Any, message: str
) -> None:
    import argparse

    args = argparse.Namespace(
        quick=True,
        seeds=None,
        workloads=None,
        strategies=None,
        machinery=None,
        jobs=None,
        sections=None,
    )
    setattr(args, option, value)
    with pytest.raises(ValueError, match=message):
        sections_from_args(args)


def test_tree_cpu_counts_the_processes_a_process_started() -> None:
    import subprocess
    import sys

    # a child that burns ~0.3 s of CPU, then waits to be measured
    code = (
        "import time\nt = time.process_time()\n"
        "while time.process_time() - t < 0.3: pass\n"
        "print('burnt', flush=True)\ntime.sleep(30)"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"burnt\n"
        assert bench_machinery.tree_cpu_seconds(child.pid) >= 0.28
        assert bench_machinery.tree_cpu_seconds(-1) == 0.0  # no such process
    finally:
        child.kill()
        child.wait()


def test_resume_reuses_the_cells_an_interrupted_run_finished(tmp_path: Path) -> None:
    args = ["bench", "--quick", "--sections", "suite", "--workloads", "digits"]
    args += ["--jobs", "1", "--out", str(tmp_path)]
    assert main([*args, "--strategies", "flwr-fedavg-q25"]) == 0
    cells = tmp_path / "benchmarks" / "suite-cells.jsonl"
    first = json.loads(cells.read_text().splitlines()[0])["cell"]
    assert main([*args, "--strategies", "flwr-fedavg-q25,deadline", "--resume"]) == 0
    results = json.loads((tmp_path / "benchmarks" / "results.json").read_text())
    data = results["sections"]["suite"]["data"]
    assert data["settings"]["resumed_cells"] == 1
    assert data["cells"][0] == first  # reused as it was, not run again
    assert [c["config"] for c in data["cells"]] == ["flwr-fedavg-q25", "deadline"]
    assert len(cells.read_text().splitlines()) == 2
