"""A checkpoint is input too: its numbers are checked like a node's, and a place
where no checkpoint can be written stops the run before any training.

A tampered checkpoint is written with :func:`save_checkpoint` itself, so its
checksum is valid and only the field checks can refuse it.
"""

from __future__ import annotations

import errno
import math
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flowerbed.strategies import (
    DeadlineFedAvg,
    FedBuff,
    LargeBatchRounds,
    RuntimeWeightedFedAvg,
)
from flowerbed.strategies.checkpoints import (
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
)
from flowerbed.strategies.options import Buffering
from flowerbed.strategies.rounds import RoundLoop
from flowerbed.strategies.sampling import Quarantine
from flwr.app import ArrayRecord, MetricRecord
from test_strategies_fakes import FakeGrid, node, weights

Make = Callable[[Path | None], RoundLoop]


def fleet() -> FakeGrid:
    return FakeGrid(
        {
            1: node(1.0, seconds=1.0, steps=10),
            2: node(3.0, seconds=2.0, steps=10),
            3: node(0.5, seconds=1.0, steps=10),
        }
    )


def runtime_weighted(path: Path | None) -> RoundLoop:
    return RuntimeWeightedFedAvg(checkpoint_path=path)


def deadline(path: Path | None) -> RoundLoop:
    # Adaptive, so durations, least seconds and progress are all saved.
    return DeadlineFedAvg(
        adaptive_deadline=True, local_steps=10, checkpoint_path=path, seed=3
    )


def large_batch(path: Path | None) -> RoundLoop:
    return LargeBatchRounds(deadline_s=5.0, checkpoint_path=path)


def fedbuff(path: Path | None) -> RoundLoop:
    return FedBuff(buffering=Buffering(buffer_size=1), checkpoint_path=path)


Change = Callable[[dict[str, np.ndarray], dict[str, Any]], None]


def run_then_tamper(path: Path, make: Make, change: Change) -> None:
    """Run three rounds, then rewrite the checkpoint changed, checksum valid."""
    make(path).start(fleet(), weights(), num_rounds=3)
    arrays, state = load_checkpoint(path, weights())
    change(arrays, state)
    save_checkpoint(path, arrays, state)


def setting(*where: str | int, to: Any) -> Change:
    def change(arrays: dict[str, np.ndarray], state: dict[str, Any]) -> None:
        inner: Any = state
        for key in where[:-1]:
            inner = inner[key]
        inner[where[-1]] = to

    return change


NAN = math.nan
S = "strategy_state"
WEIGHTS = "a finite number in (0, 1e+15]"
NORMS = "a finite number in [0, 1.34078e+154]"
HOSTILE_STATES = {
    # The influence bound's references: with these the weight cap or the norm
    # clipping is off, or every reply's weight is capped below zero (rejected).
    "weights NaN": (runtime_weighted, (S, "influence", "weights", 0), NAN, WEIGHTS),
    "weights 0": (runtime_weighted, (S, "influence", "weights", 1), 0.0, WEIGHTS),
    "weights -20": (runtime_weighted, (S, "influence", "weights", 2), -20.0, WEIGHTS),
    "weights 1e300": (runtime_weighted, (S, "influence", "weights", 0), 1e300, WEIGHTS),
    "norms NaN": (runtime_weighted, (S, "influence", "norms", 0), NAN, NORMS),
    "norms -1": (runtime_weighted, (S, "influence", "norms", 1), -1.0, NORMS),
    "norms 1e308": (runtime_weighted, (S, "influence", "norms", 2), 1e308, NORMS),
    "speeds NaN": (
        runtime_weighted,
        (S, "speeds", "1"),
        NAN,
        "a finite number in (0, 1e+15]",
    ),
    "speeds 0": (runtime_weighted, (S, "speeds", "2"), 0.0, "(0, 1e+15]"),
    "round 10**30": (runtime_weighted, ("round",), 10**30, "[0, 1000000000]"),
    "quarantine failures -1": (
        runtime_weighted,
        (S, "quarantine", "failures", "2"),
        -1,
        "a whole number in [0, 1000000000]",
    ),
    "quarantine until 2.5": (
        runtime_weighted,
        (S, "quarantine", "until", "2"),
        2.5,
        "a whole number in [0, 1000000005]",
    ),
    "FedBuff version 10**30": (fedbuff, ("round",), 10**30, "[0, 1000000000]"),
    "FedBuff weights NaN": (fedbuff, (S, "influence", "weights", 0), NAN, WEIGHTS),
    "deadline pacing NaN": (
        deadline,
        (S, "deadline", "pacing"),
        NAN,
        "a finite number in [0.5, 4]",
    ),
    "deadline pacing 0": (deadline, (S, "deadline", "pacing"), 0.0, "[0.5, 4]"),
    "deadline duration -1 s": (
        deadline,
        (S, "deadline", "durations", 0, 1),
        -1.0,
        "a finite number >= 0",
    ),
    "deadline least NaN": (
        deadline,
        (S, "deadline", "least", 0, 1),
        NAN,
        "a finite number >= 0",
    ),
    "deadline progress inf": (
        deadline,
        (S, "deadline", "progress", 0),
        math.inf,
        "a finite number in [-1e+15, 1e+15]",
    ),
    "deadline duration round 10**30": (
        deadline,
        (S, "deadline", "durations", 0, 0),
        10**30,
        "a whole number in [0, 1000000000]",
    ),
    "large batch server steps -1": (
        large_batch,
        (S, "large_batch", "server_steps"),
        -1,
        "a whole number in [0, 1000000000]",
    ),
    "large batch sample rate 0": (
        large_batch,
        (S, "large_batch", "sample_rates", "1"),
        0.0,
        "a finite number in (0, 1e+15]",
    ),
    "large batch momentum NaN": (
        large_batch,
        (S, "large_batch", "optimizer", "momentum/w"),
        [NAN],
        "finite numbers, shape (1,)",
    ),
    "large batch momentum of another shape": (
        large_batch,
        (S, "large_batch", "optimizer", "momentum/w"),
        [0.1, 0.2],
        "finite numbers, shape (1,)",
    ),
    "large batch optimiser step 10**30": (
        large_batch,
        (S, "large_batch", "optimizer", "step"),
        10**30,
        "a whole number in [0, 1000000000]",
    ),
}


def field_name(where: tuple[str | int, ...]) -> str:
    name = ""
    for key in where:
        name += f"[{key}]" if isinstance(key, int) else ("." if name else "") + key
    return name


@pytest.mark.parametrize("case", sorted(HOSTILE_STATES))
def test_a_field_out_of_range_is_refused_naming_field_value_and_range(
    tmp_path: Path, case: str
) -> None:
    make, where, value, valid = HOSTILE_STATES[case]
    path = tmp_path / "run.ckpt"
    run_then_tamper(path, make, setting(*where, to=value))
    strategy = make(path)
    grid = fleet()
    with pytest.raises(CheckpointError) as refused:
        strategy.start(grid, weights(), num_rounds=5)
    message = str(refused.value)
    assert f"{field_name(where)} is {value!r}; valid: " in message
    assert valid in message
    assert str(path) in message and "\n" not in message
    assert grid.pushed == []  # refused before any training
    assert strategy.state() == make(None).state()  # nothing half-loaded


@pytest.mark.parametrize("bad", [NAN, math.inf])
def test_an_array_that_is_not_finite_is_refused_despite_a_valid_checksum(
    tmp_path: Path, bad: float
) -> None:
    path = tmp_path / "run.ckpt"

    def poison(arrays: dict[str, np.ndarray], state: dict[str, Any]) -> None:
        arrays["w"] = np.array([bad], dtype=np.float32)

    run_then_tamper(path, runtime_weighted, poison)
    with pytest.raises(CheckpointError, match=rf"array 'w' holds {bad} at \(0,\)"):
        load_checkpoint(path, weights())


def test_a_history_of_unchanged_models_still_resumes(tmp_path: Path) -> None:
    # A node that sends the model back unchanged has an update norm of 0: a
    # history of such norms is what the run saw, not a tampered file.
    path = tmp_path / "run.ckpt"
    still = FakeGrid({n: node(0.0, seconds=1.0, steps=10) for n in (1, 2, 3)})
    RuntimeWeightedFedAvg(checkpoint_path=path).start(still, weights(), num_rounds=2)
    resumed = RuntimeWeightedFedAvg(checkpoint_path=path)
    resumed.start(fleet(), weights(), num_rounds=3)
    _, saved = load_checkpoint(path, weights())
    assert saved["round"] == 3
    assert saved["strategy_state"]["influence"]["norms"][:6] == [0.0] * 6


def test_quarantine_load_state_names_the_field() -> None:
    quarantine = Quarantine()
    with pytest.raises(CheckpointError, match=r"failures\.7 is -2; valid: "):
        quarantine.load_state({"failures": {"7": -2}, "until": {}})
    with pytest.raises(CheckpointError, match=r"until key is 'x'; valid: a node id"):
        quarantine.load_state({"failures": {}, "until": {"x": 3}})
    assert quarantine.failures == {} and quarantine.until == {}


# ------------------------------------------------------------------ writing
def test_a_symlinked_checkpoint_is_written_through_and_stays_a_link(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    store.mkdir()
    target = store / "real.ckpt"
    link = tmp_path / "run.ckpt"
    link.symlink_to(target)  # dangling until the first write
    runtime_weighted(link).start(fleet(), weights(), num_rounds=1)
    runtime_weighted(link).start(fleet(), weights(), num_rounds=2)
    assert link.is_symlink() and link.resolve() == target
    _, saved = load_checkpoint(target, weights())
    assert saved["round"] == 2
    assert sorted(p.name for p in store.iterdir()) == ["real.ckpt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.ckpt", "store"]


@pytest.fixture
def make_read_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Path], None]]:
    """``make_read_only(folder)``: no new file can be created in ``folder``.

    The folder's mode becomes r-x. Root ignores modes, so for root the creation
    of temporary files there also fails as the OS fails it for anyone else.
    """
    folders: list[Path] = []
    mkstemp = tempfile.mkstemp

    def refusing_mkstemp(*args: Any, **kwargs: Any) -> Any:
        folder = kwargs.get("dir")
        if folder is not None and Path(folder) in folders:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), folder)
        return mkstemp(*args, **kwargs)

    def make(folder: Path) -> None:
        folder.chmod(0o555)
        folders.append(folder)
        if os.geteuid() == 0:
            monkeypatch.setattr(tempfile, "mkstemp", refusing_mkstemp)

    yield make
    for folder in folders:
        folder.chmod(0o755)


def test_a_read_only_folder_fails_before_round_1(
    tmp_path: Path, make_read_only: Callable[[Path], None]
) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    make_read_only(folder)
    path = folder / "run.ckpt"
    grid = fleet()
    evaluated: list[int] = []

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        evaluated.append(server_round)
        return None

    with pytest.raises(CheckpointError) as refused:
        runtime_weighted(path).start(grid, weights(), 3, evaluate_fn=evaluate)
    message = str(refused.value)
    assert str(path) in message and "Permission denied" in message
    assert "\n" not in message
    assert grid.pushed == [] and evaluated == []


def test_a_parent_that_is_a_file_fails_before_round_1(tmp_path: Path) -> None:
    parent = tmp_path / "notes.txt"
    parent.write_text("not a folder")
    path = parent / "run.ckpt"
    grid = fleet()
    with pytest.raises(CheckpointError) as refused:
        runtime_weighted(path).start(grid, weights(), num_rounds=3)
    message = str(refused.value)
    assert str(path) in message
    assert f"{parent} is a file, not a folder" in message
    assert "\n" not in message
    assert grid.pushed == []


def test_a_failed_write_keeps_the_last_good_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The disk fills up after round 1's checkpoint: round 2's write fails.
    path = tmp_path / "run.ckpt"
    replace = os.replace
    writes: list[str] = []

    def disk_full(src: Any, dst: Any) -> None:
        if Path(dst) == path:
            writes.append(str(src))
            if len(writes) > 1:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(src))
        replace(src, dst)

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(CheckpointError) as failed:
        runtime_weighted(path).start(fleet(), weights(), num_rounds=3)
    message = str(failed.value)
    assert str(path) in message and "No space left on device" in message
    assert "\n" not in message
    monkeypatch.undo()
    _, saved = load_checkpoint(path, weights())
    assert saved["round"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["run.ckpt"]  # no temporaries


def test_a_folder_made_read_only_during_the_run_keeps_the_last_checkpoint(
    tmp_path: Path, make_read_only: Callable[[Path], None]
) -> None:
    folder = tmp_path / "run"
    path = folder / "run.ckpt"

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round == 3:  # after round 2's checkpoint, before round 3's
            make_read_only(folder)
        return None

    with pytest.raises(CheckpointError) as failed:
        runtime_weighted(path).start(fleet(), weights(), 4, evaluate_fn=evaluate)
    message = str(failed.value)
    assert str(path) in message and "Permission denied" in message
    assert "\n" not in message
    _, saved = load_checkpoint(path, weights())
    assert saved["round"] == 2
