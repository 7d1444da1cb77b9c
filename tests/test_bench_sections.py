"""``flowerbed bench`` sections: one regenerated at a time, the others kept.

Uses two toy sections registered for the test (the protocol of
:mod:`flowerbed.bench.sections`), so nothing slow runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from flowerbed.bench import cli, report
from flowerbed.bench.sections import SECTIONS, SectionRun
from flowerbed.cli import main


def toy_section(name: str, calls: list[str]) -> types.ModuleType:
    module = types.ModuleType(f"toy_section_{name}")

    def add_arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument(f"--{name}-size", type=int, default=1)

    def check(args: argparse.Namespace) -> None:
        if getattr(args, f"{name}_size") < 1:
            raise ValueError(f"--{name}-size must be >= 1")

    def run(ctx: SectionRun) -> dict[str, Any]:
        calls.append(name)
        step = ctx.tracker(1)
        (ctx.data_dir / f"{name}.txt").write_text("artefact")
        step("done")
        runs = (ctx.previous or {}).get("runs", 0) + 1
        return {"size": getattr(ctx.args, f"{name}_size"), "runs": runs}

    def render(data: Mapping[str, Any]) -> list[str]:
        return [f"## {name} section", "", f"size {data['size']}, run {data['runs']}"]

    def choices() -> list[str]:
        return [f"--{name}-size: 1, 2, 3"]

    module.TITLE = f"Toy {name}"  # type: ignore[attr-defined]
    module.choices = choices  # type: ignore[attr-defined]
    module.add_arguments = add_arguments  # type: ignore[attr-defined]
    module.check = check  # type: ignore[attr-defined]
    module.run = run  # type: ignore[attr-defined]
    module.render = render  # type: ignore[attr-defined]
    return module


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace the registered sections by toy ones ``a`` and ``b``."""
    ran: list[str] = []
    for name in list(SECTIONS):
        monkeypatch.delitem(SECTIONS, name)
    for name in ("a", "b"):
        module = toy_section(name, ran)
        monkeypatch.setitem(sys.modules, module.__name__, module)
        monkeypatch.setitem(SECTIONS, name, module.__name__)
    return ran


def results_of(out: Path) -> dict[str, Any]:
    return dict(json.loads((out / "benchmarks" / "results.json").read_text()))


def test_rerunning_one_section_keeps_the_others(
    calls: list[str], tmp_path: Path
) -> None:
    out = tmp_path / "o"
    assert main(["bench", "--out", str(out), "--a-size", "3", "--b-size", "4"]) == 0
    assert calls == ["a", "b"]
    first = results_of(out)
    assert first["sections"]["a"]["data"] == {"size": 3, "runs": 1}

    assert main(["bench", "--out", str(out), "--sections", "b", "--b-size", "5"]) == 0
    assert calls == ["a", "b", "b"]
    second = results_of(out)
    assert second["sections"]["a"] == first["sections"]["a"]
    assert second["sections"]["b"]["data"] == {"size": 5, "runs": 2}
    page = (out / "BENCHMARKS.md").read_text()
    assert page.index("## a section") < page.index("## b section")
    assert "size 3, run 1" in page and "size 5, run 2" in page
    assert (out / "benchmarks" / "b.txt").read_text() == "artefact"
    assert first["sections"]["a"]["created"] in page


def test_a_missing_section_is_listed_as_not_run(
    calls: list[str], tmp_path: Path
) -> None:
    assert main(["bench", "--out", str(tmp_path), "--sections", "b"]) == 0
    page = (tmp_path / "BENCHMARKS.md").read_text()
    assert "- `a`: not run yet" in page
    assert "## a section" not in page


def test_default_output_is_outputs_bench_in_the_current_folder(
    calls: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["bench"]) == 0
    assert (tmp_path / "outputs" / "bench" / "BENCHMARKS.md").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]


def test_publish_writes_the_checkouts_docs(
    calls: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "pyproject.toml").write_text("")
    monkeypatch.setattr(cli, "app_root", lambda: tmp_path)
    assert main(["bench", "--publish", "--sections", "a"]) == 0
    assert "## a section" in (tmp_path / "docs" / "BENCHMARKS.md").read_text()


def test_publish_outside_a_checkout_is_refused_before_anything_runs(
    calls: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(cli, "app_root", lambda: tmp_path)
    assert main(["bench", "--publish"]) == 2
    assert "--publish regenerates a source checkout's docs/" in capsys.readouterr().err
    assert calls == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--a-size", "0"], "--a-size must be >= 1"),
        (["--sections", "a,c"], "unknown section 'c'; valid choices: a, b"),
    ],
)
def test_bad_options_stop_before_any_section_runs(
    calls: list[str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    assert main(["bench", "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err
    assert calls == []
    assert not (tmp_path / "benchmarks" / "results.json").exists()


def test_an_output_folder_that_cannot_be_written_is_refused_up_front(
    calls: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["bench", "--out", str(blocker / "sub")]) == 2
    assert f"--out {blocker / 'sub'}" in capsys.readouterr().err
    assert calls == []


def test_a_failing_section_is_recorded_and_the_exit_code_says_so(
    calls: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(ctx: SectionRun) -> dict[str, Any]:
        raise RuntimeError("boom")

    monkeypatch.setattr(sys.modules["toy_section_a"], "run", broken)
    monkeypatch.setattr(
        sys.modules["toy_section_a"],
        "render",
        lambda data: ["## a section", "", f"failed: {data['error']}"],
    )
    assert main(["bench", "--out", str(tmp_path)]) == 1
    results = results_of(tmp_path)
    assert results["sections"]["a"]["data"] == {"error": "RuntimeError: boom"}
    assert results["sections"]["b"]["data"]["size"] == 1
    assert "failed: RuntimeError: boom" in (tmp_path / "BENCHMARKS.md").read_text()


def test_a_results_file_from_before_sections_is_read_as_three_sections() -> None:
    run = {
        "created": "2026-01-01T00:00:00+00:00",
        "command": "flowerbed bench",
        "machine": {"cpu_count": 2},
        "versions": {"flowerbed": "0.1.0"},
        "wall_s": 60.0,
    }
    legacy = {
        **run,
        "settings": {"quick": False, "machinery": ["client"], "seeds": [1]},
        "cells": [],
        "errors": [],
        "summary": {},
        "headline": {"available": False},
        "machinery": {"client": {"step_s": 1.0}},
        "selection": {"skipped": "not run"},
    }
    new = report.from_legacy(legacy)
    assert new["format"] == 2
    assert new["sections"]["suite"]["data"] == {
        "settings": {"quick": False, "seeds": [1]},
        "cells": [],
        "errors": [],
        "summary": {},
        "headline": {"available": False},
    }
    assert new["sections"]["machinery"]["data"] == {"client": {"step_s": 1.0}}
    assert new["sections"]["selection"]["data"] == {"skipped": "not run"}
    for entry in new["sections"].values():
        assert {k: entry[k] for k in run} == run


def test_a_corrupt_results_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "results.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"results\.json is not valid JSON"):
        report.load(tmp_path)


def test_list_prints_each_sections_choices_and_runs_nothing(
    calls: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--list", "--out", str(tmp_path / "o")]) == 0
    assert capsys.readouterr().out == (
        "a:\n  --a-size: 1, 2, 3\nb:\n  --b-size: 1, 2, 3\n"
    )
    assert calls == []
    assert not (tmp_path / "o").exists()
