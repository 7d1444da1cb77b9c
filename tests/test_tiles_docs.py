"""docs/tiles.md's "Run it on one machine" snippet runs as written: four local
board processes train a tiled YOLO-tiny front for two rounds."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_one_machine_snippet_trains_two_rounds_on_four_boards(
    tmp_path: Path,
) -> None:
    text = (ROOT / "docs" / "tiles.md").read_text()
    (snippet,) = [
        block
        for block in re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
        if "ProcessGrid" in block
    ]
    script = tmp_path / "tiles_on_one_machine.py"
    script.write_text(snippet)  # a file: the boards are spawned processes
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # The snippet prints Result.train_metrics_clientapp: one entry per round.
    metrics = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert sorted(metrics) == [1, 2]
    for m in metrics.values():
        assert m["tiles-segment-ok"] == 1 and m["tiles-devices"] == 4
        assert m["num-examples"] == 2 * 3  # batch 2, 3 steps per round
    assert metrics[2]["train-loss"] < metrics[1]["train-loss"]
