"""The tiles bench section: its options, its arithmetic, and a toy-size run."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
from flowerbed.bench import tiles_section as section
from flowerbed.bench.sections import SECTIONS, SectionRun


def fake_run(name: str, boards: int, step_s: float, act: int, **extra: Any) -> dict:
    row = {
        "name": name,
        "boards": boards,
        "gflops": 0.54,
        "front": 6,
        "bounds": [0, 6],
        "bands": 1,
        "predicted-step-s": step_s,
        "predicted-link-s": 1.0 if boards > 1 else 0.0,
        "predicted-activation-bytes": [act] * boards,
        "single-activation-bytes": 8 * 2**20,
        "halo-macs": 10 * (boards - 1),
        "front-macs": 100,
        "step-s": step_s,
        "compute-s": [step_s / 2] * boards,
        "link-s": [step_s / 4] * boards,
        "link-bytes": [0.0] * boards,
        "activation-bytes": [act] * boards,
        "peak-rss-bytes": [300 * 2**20] * boards,
        "baseline-rss-bytes": [250 * 2**20] * boards,
        "overrun-s": [0.0] * boards,
        "wall-s": 1.0,
    }
    row.update(extra)
    return row


def tiles_data(
    model: str, runs: list[dict], grouping: list[dict], grouping_boards: int
) -> dict[str, Any]:
    """A tiles section's data: ``runs`` of ``model`` at batch 1 on 4-core boards of
    0.54 GFLOPS and 900 MB joined by 100 Mbit/s links."""
    return {
        "model": model,
        "batch": 1,
        "board-gflops": 0.54,
        "cores": 4,
        "link-mbps": 100.0,
        "memory-mb": 900.0,
        "runs": runs,
        "grouping": grouping,
        "grouping-boards": grouping_boards,
    }


def data() -> dict[str, Any]:
    mib = 2**20
    return tiles_data(
        "yolo-tiny 416x416, width 16",
        [
            fake_run("1 core", 1, 80.0, 40 * mib),
            fake_run("1 board", 1, 20.0, 40 * mib),
            fake_run("6 boards", 6, 5.0, 8 * mib),
        ],
        [{"name": "6 boards, one fused group", "error": "tile too small"}],
        grouping_boards=6,
    )


def test_speed_ups_limits_and_memory_ratios_follow_from_the_runs() -> None:
    rows = {r["name"]: r for r in section.summary(data())["rows"]}
    six = rows["6 boards"]
    assert six["vs-core"] == pytest.approx(16.0)  # 80 s / 5 s
    assert six["vs-board"] == pytest.approx(4.0)  # 20 s / 5 s
    # limit: 20 s / 6 boards + 1 s of planned communication
    assert six["limit-vs-board"] == pytest.approx(20.0 / (20.0 / 6 + 1.0))
    assert six["activation-ratio"] == pytest.approx(5.0)  # 40 MiB / 8 MiB
    assert six["link-share"] == pytest.approx(0.25)
    assert six["rss-growth-mb"] == pytest.approx(50.0)
    assert six["halo"] == pytest.approx(0.5)


def test_one_core_is_the_board_run_with_its_compute_four_times_as_long() -> None:
    board = {
        **fake_run("1 board", 1, 20.5, 40 * 2**20),
        "compute-s": [20.0],
        "gflops": 0.54,
        "predicted-step-s": 20.0,
    }
    core = section.one_core(board, 4)
    assert core["step-s"] == pytest.approx(80.5)  # 4 x 20 s + the 0.5 s outside
    assert core["predicted-step-s"] == 80.0 and core["gflops"] == 0.135
    assert core["activation-bytes"] == board["activation-bytes"]
    assert core["name"] == "1 core" and core["derived-from"] == "1 board"
    rows = section.summary({**data(), "runs": [core, board]})["rows"]
    assert rows[0]["name"] == "1 core (from the 1 board run)"


def test_the_page_states_the_targets_and_the_paper() -> None:
    text = "\n".join(section.render(data()))
    assert text.startswith("## Fused-tile training (S2)")
    assert "| 6 boards | [0, 6] | 5.00 | 5.00 | 16.00x | 4.00x | 4.62x |" in text
    assert "at 6 boards >= 4x less peak activation memory per board: 5.0x (met)" in text
    assert "against a link-bound limit of 4.62x" in text
    assert "6 boards, one fused group: not runnable: tile too small" in text
    assert "Rama, Threadgill, Gerstlauer" in text
    failed = section.render({"error": "boom"})
    assert failed[-2] == "The section failed: boom"


def test_the_section_is_registered_and_checks_its_options() -> None:
    assert SECTIONS["tiles"] == "flowerbed.bench.tiles_section"
    with pytest.raises(ValueError, match=r"--tiles-boards must be 2\.\.16"):
        section.check(argparse.Namespace(tiles_boards="1,4"))
    with pytest.raises(ValueError, match="must list integers"):
        section.check(argparse.Namespace(tiles_boards="two"))
    with pytest.raises(ValueError, match="multiple of 32"):
        section.check(argparse.Namespace(tiles_image=100))
    section.check(argparse.Namespace(tiles_boards="2,6", tiles_image=224))


@pytest.mark.slow
def test_a_toy_run_measures_one_core_one_board_and_two_boards(tmp_path: Path) -> None:
    found = section.run(SectionRun("tiles", argparse.Namespace(quick=True), tmp_path))
    names = [r["name"] for r in found["runs"]]
    assert names == ["1 core", "1 board", "2 boards"]
    core, board, two = found["runs"]
    assert core["step-s"] > board["step-s"]  # a quarter of the board's rate
    assert two["boards"] == 2 and len(two["activation-bytes"]) == 2
    assert max(two["activation-bytes"]) < max(board["activation-bytes"])
    assert all(b > 0 for b in two["link-bytes"])
    text = "\n".join(section.render(found))
    assert "| 2 boards |" in text
