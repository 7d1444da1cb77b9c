"""Checkpoint and resume: atomic writes, exact resumption, refusal of bad files."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest
from flowerbed import keys
from flowerbed.strategies import (
    DeadlineFedAvg,
    FedBuff,
    RuntimeWeightedFedAvg,
)
from flowerbed.strategies.accumulation import to_arrayrecord
from flowerbed.strategies.checkpoints import (
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
)
from flowerbed.strategies.options import Buffering
from flowerbed.strategies.round_metrics import ROUND_CLOCK_S
from flwr.serverapp.strategy import Result
from test_checkpoint_hostile import large_batch, runtime_weighted
from test_strategies_fakes import FakeGrid, config_of, node, silent, weights


def fleet() -> FakeGrid:
    # Node 3 takes as long as it is told to train (1 step/s), so work balancing
    # has speeds to learn; node 4 never answers.
    def timed(message):  # type: ignore[no-untyped-def]
        steps = config_of(message).get(keys.LOCAL_STEPS, 1)
        return node(0.5, seconds=float(steps), steps=steps)(message)

    return FakeGrid(
        {
            1: node(1.0, seconds=1.0, steps=10),
            2: node(3.0, seconds=2.0, steps=10),
            3: timed,
            4: silent,
        }
    )


def deadline_strategy(path: Path | None) -> DeadlineFedAvg:
    return DeadlineFedAvg(
        fraction_train=0.75,
        weighting="fednova",
        adaptive_deadline=True,
        balance_work=True,
        local_steps=10,
        late_updates=False,
        checkpoint_path=path,
        seed=3,
    )


def without_clock(history: dict) -> dict:  # type: ignore[type-arg]
    return {
        r: {k: v for k, v in m.items() if k != ROUND_CLOCK_S}
        for r, m in history.items()
    }


def test_resumed_run_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    # Work in flight when a server stops cannot be pulled by the next server, so
    # this run leaves none across rounds (no late updates). The clock belongs to
    # the grid and restarts with it, so clock-s is left out of the comparison.
    full = deadline_strategy(None)
    expected = full.start(fleet(), weights(), num_rounds=6)

    path = tmp_path / "run.ckpt"
    deadline_strategy(path).start(fleet(), weights(), num_rounds=3)
    resumed = deadline_strategy(path)
    result = resumed.start(fleet(), weights(), num_rounds=6)

    assert np.array_equal(result.arrays["w"].numpy(), expected.arrays["w"].numpy())
    assert resumed.state() == full.state()
    assert (
        result.train_metrics_clientapp.keys() == expected.train_metrics_clientapp.keys()
    )
    assert result.evaluate_metrics_clientapp == expected.evaluate_metrics_clientapp


def test_finished_run_resumes_to_nothing_left_to_do(tmp_path: Path) -> None:
    path = tmp_path / "run.ckpt"
    first = RuntimeWeightedFedAvg(checkpoint_path=path).start(
        fleet(), weights(), num_rounds=2
    )
    grid = fleet()
    again = RuntimeWeightedFedAvg(checkpoint_path=path).start(
        grid, weights(), num_rounds=2
    )
    assert grid.pushed == []
    assert np.array_equal(again.arrays["w"].numpy(), first.arrays["w"].numpy())


def test_checkpoint_holds_quarantine_and_speeds(tmp_path: Path) -> None:
    path = tmp_path / "run.ckpt"
    strategy = deadline_strategy(path)
    strategy.start(fleet(), weights(), num_rounds=3)
    _, saved = load_checkpoint(path, weights())
    assert saved["round"] == 3
    assert saved["strategy_state"]["speeds"] == {
        str(k): v for k, v in strategy.speeds.items()
    }
    assert saved["strategy_state"]["quarantine"] == strategy.quarantine.state()
    assert strategy.speeds  # the run did learn speeds


def test_fedbuff_resumes_at_the_checkpointed_version(tmp_path: Path) -> None:
    path = tmp_path / "buff.ckpt"
    grid = FakeGrid({1: node(1.0, seconds=1.0), 2: node(1.0, seconds=2.0)})
    buffering = Buffering(buffer_size=1, server_momentum=0.5)
    FedBuff(buffering=buffering, checkpoint_path=path).start(
        grid, weights(), num_rounds=2
    )
    grid = FakeGrid({1: node(1.0, seconds=1.0), 2: node(1.0, seconds=2.0)})
    result = FedBuff(buffering=buffering, checkpoint_path=path).start(
        grid, weights(), num_rounds=3
    )
    assert sorted(result.train_metrics_clientapp) == [1, 2, 3]
    # Server momentum 0.5: v1 = 0 + m1, m1 = 1 (node 1,
    # t=1); v2 = v1 + m2, m2 = 0.5 + 1/sqrt(2) (node 2 from v0, t=2); resumed:
    # fresh work on v2 and the momentum at zero, node 1 answers first: v3 = v2 + 1.
    assert float(result.arrays["w"].numpy()[0]) == pytest.approx(2.5 + 2**-0.5)
    assert {m.metadata.group_id for _, m in grid.pushed} >= {"3"}


def test_write_is_atomic_and_leaves_no_temporary_files(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "model.ckpt"
    save_checkpoint(path, {"w": np.arange(3, dtype=np.float32)}, {"round": 1})
    save_checkpoint(path, {"w": np.arange(3, dtype=np.float32) * 2}, {"round": 2})
    assert [p.name for p in path.parent.iterdir()] == ["model.ckpt"]
    arrays, state = load_checkpoint(
        path, to_arrayrecord({"w": np.zeros(3, np.float32)})
    )
    assert state == {"round": 2}
    assert np.array_equal(arrays["w"], [0, 2, 4])


def test_truncated_checkpoint_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.ckpt"
    RuntimeWeightedFedAvg(checkpoint_path=path).start(fleet(), weights(), num_rounds=1)
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(CheckpointError, match="unreadable or corrupt"):
        RuntimeWeightedFedAvg(checkpoint_path=path).start(
            fleet(), weights(), num_rounds=2
        )


def test_tampered_arrays_fail_the_checksum(tmp_path: Path) -> None:
    path = tmp_path / "run.ckpt"
    save_checkpoint(path, {"w": np.ones(1, np.float32)}, {"round": 1})
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    members["arrays/0.npy"] = members["arrays/0.npy"][:-4] + np.float32(9).tobytes()
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    with pytest.raises(CheckpointError, match="checksum"):
        load_checkpoint(path, weights())


def test_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.ckpt"
    save_checkpoint(path, {"w": np.ones(4, np.float32)}, {"round": 1})
    with pytest.raises(CheckpointError, match="different model"):
        load_checkpoint(path, weights())


def test_checkpoint_of_another_strategy_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.ckpt"
    RuntimeWeightedFedAvg(checkpoint_path=path).start(fleet(), weights(), num_rounds=1)
    strategy = DeadlineFedAvg(checkpoint_path=path, deadline_s=5.0)
    with pytest.raises(CheckpointError, match="'RuntimeWeightedFedAvg', not"):
        strategy.start(fleet(), weights(), num_rounds=2)
    assert strategy.speeds == {}  # nothing half-loaded


def _valid_state(**changes: object) -> dict:  # type: ignore[type-arg]
    state: dict = {  # type: ignore[type-arg]
        "strategy": "RuntimeWeightedFedAvg",
        "round": 2,
        "strategy_state": {
            "speeds": {},
            "quarantine": {"failures": {}, "until": {}},
            "influence": {"weights": [], "norms": []},
        },
        "train_metrics": {},
        "evaluate_metrics": {},
        "server_metrics": {},
    }
    state.update(changes)
    return state


MALFORMED_STATES = {
    "round is text": _valid_state(round="two"),
    "round is negative": _valid_state(round=-1),
    "round is a float": _valid_state(round=2.5),
    "speeds is a list": _valid_state(
        strategy_state={**_valid_state()["strategy_state"], "speeds": [1, 2]}
    ),
    "quarantine is text": _valid_state(
        strategy_state={**_valid_state()["strategy_state"], "quarantine": "x"}
    ),
    "no influence": _valid_state(
        strategy_state={
            k: v
            for k, v in _valid_state()["strategy_state"].items()
            if k != "influence"
        }
    ),
    "metrics history is a list": _valid_state(train_metrics=[1, 2]),
    "metric record is text": _valid_state(train_metrics={"1": "loss"}),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_STATES))
def test_a_checkpoint_with_malformed_state_gives_the_checkpoint_error(
    tmp_path: Path, case: str
) -> None:
    path = tmp_path / "run.ckpt"
    save_checkpoint(path, {"w": np.zeros(1, np.float32)}, MALFORMED_STATES[case])
    strategy = RuntimeWeightedFedAvg(checkpoint_path=path)
    with pytest.raises(CheckpointError, match="malformed state"):
        strategy.start(fleet(), weights(), num_rounds=3)
    assert strategy.speeds == {}  # nothing half-loaded


def _rewrite(path: Path, member: str, data: bytes) -> None:
    with zipfile.ZipFile(path) as z:
        members = {n: z.read(n) for n in z.namelist()}
    members[member] = data
    with zipfile.ZipFile(path, "w") as z:
        for name, content in members.items():
            z.writestr(name, content)


MALFORMED_FILES = {
    "header is a list": ("header.json", b"[1, 2]"),
    "header names are numbers": ("header.json", b'{"names": [1], "sha256": "x"}'),
    "header without checksum": ("header.json", b'{"names": ["w"]}'),
    "header is not JSON": ("header.json", b"{names"),
    "state is a list": ("state.json", b"[]"),
    "state without state": ("state.json", b'{"format": "flowerbed-checkpoint/1"}'),
    "state is a number": ("state.json", b"7"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_FILES))
def test_a_checkpoint_with_malformed_json_gives_the_checkpoint_error(
    tmp_path: Path, case: str
) -> None:
    path = tmp_path / "run.ckpt"
    save_checkpoint(path, {"w": np.ones(1, np.float32)}, {"round": 1})
    _rewrite(path, *MALFORMED_FILES[case])
    with pytest.raises(CheckpointError, match="unreadable or corrupt"):
        load_checkpoint(path, weights())


def test_temporary_files_of_a_killed_write_are_removed(tmp_path: Path) -> None:
    path = tmp_path / "run.ckpt"
    stale = tmp_path / "run.ckpt.k1ll3d.tmp"
    stale.write_bytes(b"half a zip")
    other = tmp_path / "other.ckpt.x.tmp"  # not this checkpoint's
    other.write_bytes(b"")
    RuntimeWeightedFedAvg(checkpoint_path=path).start(fleet(), weights(), num_rounds=1)
    assert not stale.exists() and other.exists() and path.exists()


@pytest.mark.parametrize(
    "make",
    [
        runtime_weighted,
        lambda path: DeadlineFedAvg(checkpoint_path=path, deadline_s=5.0),
        large_batch,
    ],
    ids=["RuntimeWeightedFedAvg", "DeadlineFedAvg", "LargeBatchRounds"],
)
def test_resume_with_default_options_restores_every_saved_field(
    tmp_path: Path, make
) -> None:  # type: ignore[no-untyped-def]
    # Defaults: the influence bound's references, speeds, quarantine and (for
    # DeadlineFedAvg) durations, pacing and progress come back as they were;
    # LargeBatchRounds adds its server optimiser's steps and momentum.
    path = tmp_path / "run.ckpt"
    first = make(path)
    first.start(fleet(), weights(), num_rounds=3)
    resumed = make(path)
    resumed._resume(weights(), Result())
    assert resumed.state() == first.state()
    assert resumed.recent_norms.values == first.recent_norms.values
    assert len(first.recent_weights.values) > 0
