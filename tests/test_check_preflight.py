"""`flowerbed sim --check` means "it will run": what would stop a run is refused
before anything trains, in one line naming the keys to change, and the check
itself writes nothing."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
from flowerbed.cli import main
from flowerbed.data import DataError
from flowerbed.sims import outputs
from flowerbed.sims import scenario as scenario_module
from flowerbed.sims.outputs import OutputDirError, check_output_dir
from flowerbed.sims.population import (
    MODEL_BYTES_BOUND,
    check_memory,
    population_bytes,
)
from test_population import refused_one_byte_short

pytestmark = pytest.mark.usefixtures("quiet_single_threaded")
"""Tiny models train fastest on one thread."""


def sim(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Exit code and stderr of ``flowerbed sim ARGV``."""
    code = main(["sim", *argv])
    return code, capsys.readouterr().err


def one_error_line(err: str) -> str:
    assert err.startswith("flowerbed sim: error: ") and err.count("\n") == 1, err
    return err


def test_a_billion_nodes_sampled_one_at_a_time_is_refused_for_its_population(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 10^9 nodes x 440 B = 409.8 GiB before any node is sampled
    out = tmp_path / "runs"
    config = "num-nodes=1000000000 fraction-train=1e-9"
    code, err = sim(["--check", "-c", config, "--out", str(out)], capsys)
    assert code == 2
    line = one_error_line(err)
    assert "num-nodes=1000000000: a population of 1000000000 nodes holds about " in line
    assert "409.8 GiB (440 B per node), more than the " in line
    assert "GiB of memory available; use num-nodes <= " in line
    assert not out.exists()


def test_the_population_and_the_round_share_the_memory() -> None:
    # 1,000 nodes x 440 B = 440,000 B; a round of 500 tasks of a 1 KiB model:
    # 500 x (3 x 1,024 + 32,768) = 17,920,000 B; together 18,360,000 B.
    message = refused_one_byte_short(check_memory, (1000, 0.5, 1024), 18_360_000)
    assert "a round of 500 train tasks holds about 0.0 GiB" in message
    assert "beside the 0.0 GiB its 1000 nodes hold" in message
    assert "sample at most 499 nodes per round" in message
    # a population alone larger than the memory names num-nodes and what fits:
    # n x (440 + 0.5 x 35,840) <= 1,000,000 -> n <= 54
    with pytest.raises(DataError) as refused:
        check_memory(10_000, 0.5, 1024, available=1_000_000)
    assert str(refused.value).endswith("use num-nodes <= 54 at fraction-train=0.5")
    assert population_bytes(10_000) == 4_400_000


def test_the_model_size_bound_holds_for_every_model_on_every_dataset() -> None:
    from flowerbed.data import DATASET_DIMS
    from flowerbed.models import MODELS, build_model, model_dims, model_num_bytes

    shapes = {  # (channels, side or length, classes) of each dataset's samples
        "digits": (1, 8, 10),
        "mnist": (1, 28, 10),
        "cifar10": (3, 32, 10),
        "mnist1d": (1, 40, 10),
        "synthetic": (1, 60, 10),
    }
    assert set(shapes) == set(DATASET_DIMS)
    for name in MODELS:
        for dataset, shape in shapes.items():
            if model_dims(name) == DATASET_DIMS[dataset]:
                assert model_num_bytes(build_model(name, *shape)) <= MODEL_BYTES_BOUND


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            "partition='dirichlet' alpha=1e-300",
            "partition 'dirichlet' of 'digits' (1437 training samples) for "
            "num-nodes=10 with alpha=1e-300 leaves a node fewer than 2 samples in "
            "every draw; raise alpha (alpha=0.5 works here), lower num-nodes or "
            "use partition 'iid'",
        ),
        (
            "partition='device' num-nodes=500",
            "partition 'device' of 'digits' (1437 training samples) for "
            "num-nodes=500 leaves 97 of 500 nodes fewer than 2 samples; lower "
            "num-nodes or use partition 'iid'",
        ),
        (
            "partition='natural'",
            "partition 'natural' of 'digits' (1437 training samples) for "
            "num-nodes=10: the natural partition needs the data's writers",
        ),
    ],
)
def test_a_partition_that_leaves_a_node_without_data_is_refused(
    config: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = sim(["--check", "-c", config, "--out", str(tmp_path / "o")], capsys)
    assert code == 2
    assert message in one_error_line(err)


def test_a_population_larger_than_the_data_draws_shards_and_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 1437 digits feed 718 disjoint shards of 2; 10,000 devices draw their own
    config = "num-nodes=10000 fraction-train=0.001 partition='dirichlet' alpha=1e-300"
    code = main(["sim", "--check", "-c", config, "--out", str(tmp_path / "o")])
    assert code == 0, capsys.readouterr().err


def test_check_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "a" / "b" / "runs"
    assert main(["sim", "--check", "--out", str(out)]) == 0
    assert "run config OK" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_an_output_folder_under_a_file_stops_check_and_run_before_training(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = blocker / "runs"

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("trained despite an unwritable output folder")

    monkeypatch.setattr(scenario_module, "run_scenario", no_training)
    for check in (["--check"], []):
        code, err = sim([*check, "--out", str(out)], capsys)
        assert (code, err) == (
            2,
            f"flowerbed sim: error: run-config 'output-dir' {str(out)!r} cannot be "
            f"written: {str(blocker)!r} is not a folder\n",
        )


def test_a_full_disk_is_refused_before_training(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Full:
        free = 1024

    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda path: Full)
    out = tmp_path / "runs"
    for check in (["--check"], []):  # the defaults: 10 nodes, 10 rounds
        code, err = sim([*check, "--out", str(out)], capsys)
        assert code == 2
        # 10 rounds of 10 nodes: 64 KiB + 10 x (256 + 16 x 10) B = 69,696 B
        assert one_error_line(err).endswith(
            "cannot be written: 1 KiB free on its disk, a run folder needs about "
            "68 KiB\n"
        )
    assert not out.exists()


def test_check_output_dir_without_create_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "new" / "runs"
    assert check_output_dir(out, create=False) == out
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(OutputDirError, match="KiB free on its disk, a run folder"):
        check_output_dir(out, 1 << 70, create=False)  # more than any disk
    assert check_output_dir(out) == out and out.is_dir()  # a run creates it


@pytest.mark.parametrize(
    ("error", "line"),
    [
        (
            OSError(errno.ENOSPC, "No space left on device"),
            "No space left on device; set output-dir to a folder with room that "
            "this user can write (it is {out!r})",
        ),
        (
            PermissionError(errno.EACCES, "Permission denied", "{out}/x/results.json"),
            "Permission denied: '{out}/x/results.json'; set output-dir to a folder "
            "with room that this user can write (it is {out!r})",
        ),
        (
            MemoryError(),
            "the run ran out of memory; lower num-nodes, fraction-train or "
            "batch-size, or use a smaller model",
        ),
    ],
)
def test_a_run_stopped_by_the_disk_or_the_memory_ends_with_one_line(
    error: Exception,
    line: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = str(tmp_path / "runs")
    if isinstance(error, OSError) and error.filename:
        error.filename = error.filename.format(out=out)

    def write_fails(*args: object, **kwargs: object) -> None:
        raise error

    monkeypatch.setattr(scenario_module, "write_run_folder", write_fails)
    argv = ["--nodes", "2", "--rounds", "1", "-c", "local-steps=1", "--out", out]
    code, err = sim(argv, capsys)
    assert code == 1
    assert err == f"flowerbed sim: error: {line.format(out=out)}\n"


def test_the_server_app_runs_the_same_checks(tmp_path: Path) -> None:
    from flowerbed.sims.apps import RunFailed
    from flowerbed.sims.apps import main as server_main
    from flwr.app import Context, RecordDict

    class TenNodes:
        def get_node_ids(self) -> list[int]:
            return list(range(10))

    config = {"partition": "dirichlet", "alpha": 1e-300, "output-dir": str(tmp_path)}
    context = Context(1, 0, {}, RecordDict(), config)
    with pytest.raises(RunFailed) as failed:
        server_main(TenNodes(), context)  # type: ignore[arg-type]
    assert str(failed.value).startswith(
        "flowerbed: partition 'dirichlet' of 'digits' (1437 training samples) for "
        "num-nodes=10 with alpha=1e-300 leaves a node fewer than 2 samples"
    )
