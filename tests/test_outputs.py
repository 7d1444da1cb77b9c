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


def rounds_lasting(*seconds: float) -> list[RoundRecord]:
    """Records of rounds that last ``seconds``, one after the other."""
    ends = [sum(seconds[: i + 1]) for i in range(len(seconds))]
    return [record(i + 1, t, 0.1 * (i + 1)) for i, t in enumerate(ends)]


def test_round_durations_are_the_gaps_between_round_ends() -> None:
    assert outputs.round_durations(rounds_lasting(2.0, 3.0, 5.0)) == [2.0, 3.0, 5.0]


def test_two_round_timeouts_among_short_rounds_add_a_panel_per_round() -> None:
    # eight rounds of 2 s and two 3,600 s timeouts: the median round is 2 s
    records = rounds_lasting(2, 2, 3600, 2, 2, 2, 2, 3600, 2, 2)
    assert [r.round for r in outputs.long_rounds(records)] == [3, 8]
    figure = outputs.accuracy_figure(records, "deadline on phones-10x")
    time_axis, round_axis = figure.axes
    assert time_axis.get_xlabel() == "virtual time (s)"
    assert round_axis.get_xlabel() == "round"
    assert round_axis.get_xlim()[1] < 11  # one unit per round, not per second
    marked = round_axis.lines[1].get_xdata()
    assert list(marked) == [3, 8]


def test_even_rounds_keep_one_time_axis() -> None:
    # a round 10x the median is not yet uneven: 20 s against a median of 2 s
    records = rounds_lasting(2, 2, 20, 2, 2)
    assert outputs.long_rounds(records) == []
    [axis] = outputs.accuracy_figure(records, "fedavg on mixed").axes
    assert axis.get_xlabel() == "virtual time (s)"
    assert outputs.long_rounds(rounds_lasting(2, 2, 20.5, 2, 2)) != []
    assert outputs.long_rounds(rounds_lasting(3600)) == []


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

    monkeypatch.setattr(outputs, "accuracy_figure", broken_plot)
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
