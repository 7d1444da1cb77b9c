"""Bad input stops before any training, in one line naming the valid choices."""

from pathlib import Path

import pytest
from flowerbed.cli import main
from flowerbed.sims.config import ConfigError, Scenario

BAD_INPUT = [
    ({"fleet": "phones-100x"}, "unknown fleet 'phones-100x'; valid choices: uniform"),
    ({"model": "resnet"}, "unknown model 'resnet'; valid choices: lenet, mobilenet"),
    ({"dataset": "imagenet"}, "unknown dataset 'imagenet'; valid choices: digits"),
    ({"strategy": "fedsgd"}, "unknown strategy 'fedsgd'; valid choices: fedavg"),
    ({"partition": "shards"}, "unknown partition 'shards'; valid choices: iid"),
    ({"num-nodes": -4}, "'num-nodes' must be >= 1, got -4"),
    ({"num-nodes": 0}, "'num-nodes' must be >= 1, got 0"),
    ({"num-rounds": 0}, "'num-rounds' must be >= 1"),
    ({"alpha": 0.0}, "'alpha' must be > 0, got 0.0"),
    ({"alpha": -1.0}, "'alpha' must be > 0, got -1.0"),
    ({"target-accuracy": 0.0}, r"'target-accuracy' must be in \(0, 1\], got 0.0"),
    ({"target-accuracy": 1.5}, r"'target-accuracy' must be in \(0, 1\], got 1.5"),
    ({"learning-rate": 0}, "'learning-rate' must be > 0"),
    ({"fraction-train": 1.2}, r"'fraction-train' must be in \(0, 1\]"),
    ({"dropout": 1.5}, "'dropout' must be in"),
    ({"num-nodes": "ten"}, "'num-nodes' must be a int, got 'ten'"),
    (
        {"num-node": 10},
        "unknown run-config key 'num-node'; valid keys: fleet, num-nodes",
    ),
]


@pytest.mark.parametrize(("config", "message"), BAD_INPUT)
def test_bad_run_config_is_refused_with_the_valid_choices(config, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=message):
        Scenario.from_run_config(config)


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
    (["--alpha", "0"], "'alpha' must be > 0"),
    (["--target", "2"], "'target-accuracy' must be in"),
    (["-c", "bogus=1"], "unknown run-config key 'bogus'"),
]


@pytest.mark.parametrize(("argv", "message"), CLI_BAD_INPUT)
def test_sim_refuses_bad_input_before_training_and_writes_nothing(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "runs"
    assert main(["sim", *argv, "--out", str(out)]) == 2
    printed = " ".join(capsys.readouterr().out.split())
    assert "flowerbed sim: error:" in printed and message in printed
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
