"""The run folder: results.json, rounds.csv and the plot, written all-or-nothing."""

import csv
import json
from pathlib import Path

import pytest
from flowerbed.sims import outputs
from flowerbed.sims.recorder import RoundRecord
from flowerbed.sims.scenario import run_scenario


def record(n: int, t: float, acc: float) -> RoundRecord:
    return RoundRecord(n, t, acc, 1.0, [0, 1], [], 0, 2.0, 0.1)


def test_time_to_target_is_the_first_round_at_or_above_it() -> None:
    rounds = [record(1, 10.0, 0.5), record(2, 25.0, 0.9), record(3, 40.0, 0.95)]
    assert outputs.time_to_target(rounds, 0.9) == 25.0
    assert outputs.time_to_target(rounds, 0.96) is None


def test_a_run_writes_results_csv_and_plot(tmp_path: Path) -> None:
    out = run_scenario(
        {
            "num-nodes": 4,
            "num-rounds": 3,
            "fleet": "boards",
            "target-accuracy": 0.3,
            "output-dir": str(tmp_path),
        }
    )
    assert out.run_dir is not None and out.run_dir.parent == tmp_path
    results = json.loads((out.run_dir / "results.json").read_text())
    assert results["config"]["fleet"] == "boards" and results["engine"] == "in-process"
    assert [r["round"] for r in results["rounds"]] == [1, 2, 3]
    for key in (
        "virtual_time_s",
        "accuracy",
        "loss",
        "participants",
        "stragglers",
        "energy_j",
    ):
        assert key in results["rounds"][0]
    assert results["final_accuracy"] == results["rounds"][-1]["accuracy"]
    first_hit = next(r for r in results["rounds"] if r["accuracy"] >= 0.3)
    assert results["time_to_target_s"] == first_hit["virtual_time_s"]
    with open(out.run_dir / "rounds.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["round"]) for r in rows] == [1, 2, 3]
    assert float(rows[-1]["accuracy"]) == pytest.approx(
        results["final_accuracy"], abs=1e-6
    )
    png = (out.run_dir / "accuracy.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.run_dir.name]


def test_a_failed_write_leaves_no_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_plot(*_args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(outputs, "_plot", broken_plot)
    results = outputs.summarise(
        {
            "target-accuracy": 0.9,
            "strategy": "fedavg",
            "fleet": "mixed",
            "num-nodes": 2,
        },
        [record(1, 1.0, 0.5)],
        0.1,
        "in-process",
    )
    with pytest.raises(OSError, match="disk full"):
        outputs.write_run_folder(tmp_path, results, [record(1, 1.0, 0.5)])
    assert list(tmp_path.iterdir()) == []
