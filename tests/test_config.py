"""Bad input stops before any training, in one line naming the valid choices."""

from pathlib import Path

import pytest
from flowerbed.cli import main
from flowerbed.sims.config import ConfigError, Scenario
from flowerbed.sims.recorder import RoundRecord

BAD_INPUT = [
    ({"fleet": "phones-100x"}, "unknown fleet 'phones-100x'; valid choices: uniform"),
    ({"model": "resnet"}, "unknown model 'resnet'; valid choices: lenet, mobilenet"),
    ({"dataset": "imagenet"}, "unknown dataset 'imagenet'; valid choices: digits"),
    ({"strategy": "fedsgd"}, "unknown strategy 'fedsgd'; valid choices: fedavg"),
    ({"partition": "shards"}, "unknown partition 'shards'; valid choices: iid"),
    ({"num-nodes": -4}, "'num-nodes' must be >= 1, got -4"),
    ({"num-nodes": 0}, "'num-nodes' must be >= 1, got 0"),
    ({"num-rounds": 0}, r"'num-rounds' must be in \[1, 1000000\]"),
    ({"alpha": 0.0}, r"'alpha' must be in \(0, 1000000\].*got 0.0"),
    ({"alpha": -1.0}, r"'alpha' must be in \(0, 1000000\].*got -1.0"),
    ({"target-accuracy": 0.0}, r"'target-accuracy' must be in \(0, 1\], got 0.0"),
    ({"target-accuracy": 1.5}, r"'target-accuracy' must be in \(0, 1\], got 1.5"),
    ({"learning-rate": 0}, r"'learning-rate' must be in \(0, 10\]"),
    ({"fraction-train": 1.2}, r"'fraction-train' must be in \(0, 1\]"),
    ({"dropout": 1.5}, "'dropout' must be <= 1 .*got 1.5"),
    ({"num-nodes": "ten"}, "'num-nodes' must be an integer, got 'ten'"),
    ({"num-rounds": True}, "'num-rounds' must be an integer, got True"),
    ({"num-rounds": 2.5}, "'num-rounds' must be an integer, got 2.5"),
    ({"num-rounds": float("inf")}, "'num-rounds' must be an integer, got inf"),
    ({"num-rounds": 10**7}, r"'num-rounds' must be in \[1, 1000000\]"),
    (
        {"seed": -1},
        r"'seed' must be in \[0, 4294967295\] \(numpy's seed range\), got -1",
    ),
    ({"seed": 2**40}, r"'seed' must be in \[0, 4294967295\].*got 1099511627776"),
    ({"learning-rate": float("inf")}, r"'learning-rate' must be in \(0, 10\].*got inf"),
    ({"learning-rate": float("nan")}, r"'learning-rate' must be in \(0, 10\].*got nan"),
    ({"learning-rate": 50.0}, r"'learning-rate' must be in \(0, 10\]"),
    ({"batch-size": 1e9}, r"'batch-size' must be in \[1, 65536\].*got 1000000000"),
    ({"batch-size": 0}, r"'batch-size' must be in \[1, 65536\]"),
    ({"local-steps": 10**6}, r"'local-steps' must be in \[1, 100000\]"),
    ({"proximal-mu": 1e308}, r"'proximal-mu' must be in \[0, 1000\].*got 1e\+308"),
    ({"proximal-mu": -0.1}, r"'proximal-mu' must be in \[0, 1000\]"),
    ({"round-timeout-s": float("inf")}, r"'round-timeout-s' must be in \(0, 604800\]"),
    ({"round-timeout-s": 0.0}, r"'round-timeout-s' must be in \(0, 604800\]"),
    ({"deadline-s": float("inf")}, r"'deadline-s' must be in \[0, 604800\]"),
    ({"deadline-s": -1.0}, r"'deadline-s' must be in \[0, 604800\]"),
    ({"alpha": float("inf")}, r"'alpha' must be in \(0, 1000000\]"),
    ({"fraction-train": float("nan")}, r"'fraction-train' must be in \(0, 1\]"),
    ({"dropout": float("nan")}, "'dropout' must be <= 1"),
    ({"dropout": float("-inf")}, "'dropout' must be <= 1"),
    ({"target-accuracy": float("nan")}, r"'target-accuracy' must be in \(0, 1\]"),
    ({"output-dir": ""}, "'output-dir' must name a folder"),
    (
        {"num-node": 10},
        "unknown run-config key 'num-node'; valid keys: fleet, num-nodes",
    ),
]


@pytest.mark.parametrize(("config", "message"), BAD_INPUT)
def test_bad_run_config_is_refused_with_the_valid_choices(config, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=message):
        Scenario.from_run_config(config)


@pytest.mark.parametrize(
    "config",
    [
        {"seed": 0},
        {"seed": 2**32 - 1},
        {"learning-rate": 10.0},
        {"batch-size": 65536},
        {"proximal-mu": 0.0},
        {"round-timeout-s": 604800.0},
        {"deadline-s": 0.0},
        {"dropout": -1.0},
        {"dropout": 1.0},
        {"num-rounds": 3.0},
    ],
)
def test_values_at_the_limits_are_accepted(config: dict[str, object]) -> None:
    Scenario.from_run_config(config)


def test_model_names_are_the_model_zoos() -> None:
    from flowerbed.models import MODELS
    from flowerbed.zoo import MODEL_NAMES

    assert tuple(MODELS) == MODEL_NAMES


def test_defaults_match_the_flower_app_config() -> None:
    import tomllib

    pyproject = Path(__file__).parents[1] / "pyproject.toml"
    app_config = tomllib.loads(pyproject.read_text())["tool"]["flwr"]["app"]["config"]
    assert Scenario.from_run_config(app_config) == Scenario()
    assert set(app_config) <= set(Scenario.keys())


CLI_BAD_INPUT = [
    (["--fleet", "nope"], "unknown fleet 'nope'"),
    (["--model", "vgg"], "unknown model 'vgg'"),
    (["--dataset", "svhn"], "unknown dataset 'svhn'"),
    (["--strategy", "magic"], "unknown strategy 'magic'"),
    (["--nodes", "-1"], "'num-nodes' must be >= 1"),
    # 3,000,000 nodes all sampled each round (~800 GiB of replies)
    (["--nodes", "3000000"], "a round of 3000000 train tasks holds about"),
    (["--alpha", "0"], "--alpha: run-config 'alpha' must be in (0, 1000000]"),
    (["--target", "2"], "'target-accuracy' must be in"),
    (["-c", "bogus=1"], "unknown run-config key 'bogus'"),
    (["--seed", "-1"], "--seed: run-config 'seed' must be in [0, 4294967295]"),
    (["--seed", str(2**40)], "--seed: run-config 'seed' must be in [0, 4294967295]"),
    (
        ["--deadline", "inf"],
        "--deadline: run-config 'deadline-s' must be in [0, 604800]",
    ),
    (["--dropout", "nan"], "--dropout: run-config 'dropout' must be <= 1"),
    (["--local-steps", "0"], "--local-steps: run-config 'local-steps' must be in"),
    (["-c", "learning-rate=inf"], "run-config 'learning-rate' must be in (0, 10]"),
    (["-c", "batch-size=1e9"], "run-config 'batch-size' must be in [1, 65536]"),
    (["-c", "proximal-mu=1e308"], "run-config 'proximal-mu' must be in [0, 1000]"),
    (["-c", "round-timeout-s=inf"], "'round-timeout-s' must be in (0, 604800]"),
    (["-c", "fleet=boards"], "-c 'fleet=boards': The provided configuration string"),
]


@pytest.mark.parametrize(("argv", "message"), CLI_BAD_INPUT)
def test_sim_refuses_bad_input_before_training_and_writes_nothing(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "runs"
    assert main(["sim", *argv, "--out", str(out)]) == 2
    printed = capsys.readouterr().err
    assert printed.startswith("flowerbed sim: error: ") and message in printed
    assert printed.count("\n") == 1  # one line
    assert not out.exists()


def test_a_model_must_take_the_datasets_samples() -> None:
    from flowerbed.sims.config import ConfigError, Scenario

    with pytest.raises(ConfigError, match="model 'lenet' does not take 'mnist1d'"):
        Scenario.from_run_config({"dataset": "mnist1d"})
    with pytest.raises(ConfigError, match="unknown charge-as 'vgg'; valid choices"):
        Scenario.from_run_config({"charge-as": "vgg"})
    ok = Scenario.from_run_config(
        {"dataset": "mnist1d", "model": "mlp", "charge-as": "mobilenet-v1"}
    )
    assert ok.charge_as == "mobilenet-v1"


def test_sim_check_says_ok_or_what_is_wrong_and_trains_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "runs"
    argv = ["sim", "--check", "--out", str(out)]
    readme = "fleet='phones-10x' strategy='deadline' num-rounds=20"
    assert main([*argv, "-c", readme]) == 0
    captured = capsys.readouterr()
    assert captured.out == (
        "flowerbed sim: run config OK (deadline on 10 phones-10x nodes, 20 rounds, "
        "lenet on digits); nothing was trained\n"
    )
    assert not out.exists()  # nothing written, not even the output folder
    assert main([*argv, "-c", "num-rnds=20"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flowerbed sim: error: unknown run-config key 'num-rnds'")
    assert main([*argv, "-c", "dataset='mnist' data-dir='/nonexistent'"]) == 2
    assert "/nonexistent" in capsys.readouterr().err


def test_sim_refuses_an_output_folder_it_cannot_write_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["sim", "--nodes", "2", "--rounds", "1", "--out", str(blocker)]) == 2
    captured = capsys.readouterr()
    assert captured.err == (
        f"flowerbed sim: error: run-config 'output-dir' {str(blocker)!r} cannot be "
        f"written: {str(blocker)!r} is not a folder\n"
    )
    assert "simulating" not in captured.out  # nothing trained


def test_a_run_that_applied_no_update_exits_non_zero_and_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "runs"
    argv = ["sim", "--nodes", "2", "--rounds", "2", "--dropout", "1", "--out", str(out)]
    assert main(argv) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "flowerbed sim: error: no update was applied (2 round(s) completed): all 4 "
        "train tasks failed; the global model is the initial one (check dropout, "
        "deadline-s and round-timeout-s)"
    )
    assert len(list(out.iterdir())) == 1  # the run folder is still written


def _record(participants: list[int], failed: list[int]) -> RoundRecord:
    return RoundRecord(1, 1.0, 0.1, 2.0, participants, failed, 0, 0.0, 0.1)


def test_no_update_reason_compares_the_final_model_with_the_initial_one() -> None:
    import numpy as np
    from flowerbed.sims.scenario import no_update_reason
    from flwr.app import ArrayRecord

    initial = [np.zeros(3, dtype=np.float32), np.ones((2, 2), dtype=np.float32)]
    same = ArrayRecord([a.copy() for a in initial])
    moved = ArrayRecord([initial[0] + 1e-7, initial[1].copy()])
    records = [_record([], [1, 2]), _record([], [1])]
    assert no_update_reason(records, initial, moved) is None
    assert no_update_reason(records, initial, same) == (
        "no update was applied (2 round(s) completed): all 3 train tasks failed; "
        "the global model is the initial one (check dropout, deadline-s and "
        "round-timeout-s)"
    )
    # Flower's Strategy.start leaves Result.arrays empty when nothing aggregated.
    assert "all 3 train tasks failed" in str(
        no_update_reason(records, initial, ArrayRecord())
    )
    rejected = [_record([4, 5], [])]
    assert "2 replies arrived but the strategy applied none" in str(
        no_update_reason(rejected, initial, same)
    )
    assert "(0 round(s) completed): no successful train reply arrived" in str(
        no_update_reason([], initial, None)
    )


@pytest.mark.parametrize(("strategy", "dropout"), [("fedbuff", 1.0), ("fedavg", 0.0)])
def test_run_outcome_says_when_nothing_was_applied(
    strategy: str, dropout: float
) -> None:
    from flowerbed.sims.scenario import run_scenario

    config = {"num-nodes": 2, "num-rounds": 1, "local-steps": 1, "dropout": dropout}
    outcome = run_scenario({**config, "strategy": strategy}, write=False)
    if dropout == 1.0:
        assert outcome.records == []  # FedBuff never completes a model version
        assert outcome.problem is not None
        assert "no successful train reply arrived" in outcome.problem
    else:
        assert outcome.problem is None
