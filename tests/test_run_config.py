"""Every documented run-config key works as written: in pyproject.toml's
``[tool.flwr.app.config]`` (so ``flwr run -c`` takes it), in the scenario, and in
``flowerbed sim -c`` with Flower's own syntax."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import tomllib
from flowerbed.cli import build_parser
from flowerbed.sims.cli import run_config_from_args
from flowerbed.sims.config import ConfigError, Scenario
from flwr.common.config import flatten_dict, fuse_dicts, parse_config_args

ROOT = Path(__file__).parents[1]
EXAMPLES: dict[str, Any] = {
    "fleet": "phones-10x",
    "num-nodes": 2,
    "num-rounds": 1,
    "strategy": "deadline",
    "model": "lenet",
    "dataset": "digits",
    "data-dir": "unused-for-digits",
    "partition": "dirichlet",
    "alpha": 1.0,
    "batch-size": 8,
    "local-steps": 2,
    "learning-rate": 0.1,
    "fraction-train": 1.0,
    "dropout": 0.0,
    "target-accuracy": 0.5,
    "seed": 7,
    "output-dir": "runs",
    "round-timeout-s": 600.0,
    "deadline-s": 30.0,
    "proximal-mu": 0.1,
    "charge-as": "mobilenet-v1",
    "affinity": 0.8,
}
"""A valid value for every key (most of them not the default)."""


def documented_keys() -> list[str]:
    """Keys in the run-config table of docs/simulation.md (first column)."""
    page = (ROOT / "docs" / "simulation.md").read_text()
    table = re.split(r"\n##+ ", page.split("## Run config", 1)[1], maxsplit=1)[0]
    keys: list[str] = []
    for line in table.splitlines():
        if line.startswith("| `"):
            keys += re.findall(r"`([a-z-]+)`", line.split("|")[1])
    return keys


def app_config() -> dict[str, Any]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return dict(pyproject["tool"]["flwr"]["app"]["config"])


def toml_value(value: Any) -> str:
    return f"'{value}'" if isinstance(value, str) else repr(value)


def test_documented_keys_are_the_app_config_and_the_scenarios() -> None:
    keys = documented_keys()
    assert len(keys) == len(set(keys)) == 22
    assert set(keys) == set(app_config()) == set(Scenario.keys()) == set(EXAMPLES)
    assert Scenario.from_run_config(app_config()) == Scenario()


@pytest.mark.parametrize("key", sorted(EXAMPLES))
def test_flower_takes_every_documented_key(key: str) -> None:
    # What the SuperLink does with `flwr run -c`: parse, then fuse with the app's
    # defaults, refusing keys the app does not declare.
    override = parse_config_args([f"{key}={toml_value(EXAMPLES[key])}"])
    assert override == {key: EXAMPLES[key]}
    fused = fuse_dicts(flatten_dict(app_config()), override)
    assert Scenario.from_run_config(fused).to_run_config()[key] == EXAMPLES[key]


@pytest.mark.parametrize("key", sorted(EXAMPLES))
def test_flowerbed_sim_takes_every_documented_key(key: str) -> None:
    args = build_parser().parse_args(
        ["sim", "-c", f"{key}={toml_value(EXAMPLES[key])}"]
    )
    scenario = Scenario.from_run_config(run_config_from_args(args))
    assert scenario.to_run_config()[key] == EXAMPLES[key]


def test_flower_refuses_an_undeclared_key() -> None:
    with pytest.raises(ValueError, match="num-rnds"):
        fuse_dicts(flatten_dict(app_config()), {"num-rnds": 3})


def test_the_readme_example_means_the_same_in_flwr_run_and_flowerbed_sim() -> None:
    readme = (ROOT / "README.md").read_text()
    [example] = set(re.findall(r'-c "([^"]+)"', readme))
    args = build_parser().parse_args(["sim", "-c", example])
    config = run_config_from_args(args)
    assert config == parse_config_args([example])
    assert config == {"fleet": "phones-10x", "strategy": "deadline", "num-rounds": 20}
    Scenario.from_run_config(config)


def test_sim_takes_a_toml_file_and_several_c_options(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text('fleet = "boards"\nnum-rounds = 4\n')
    args = build_parser().parse_args(["sim", "-c", str(toml)])
    assert run_config_from_args(args) == {"fleet": "boards", "num-rounds": 4}
    args = build_parser().parse_args(
        ["sim", "-c", "num-rounds=4", "-c", "seed=3", "--rounds", "5"]
    )
    assert run_config_from_args(args) == {"num-rounds": 5, "seed": 3}


def test_sim_refuses_what_flwr_run_refuses_with_flowers_message() -> None:
    args = build_parser().parse_args(["sim", "-c", "fleet=boards"])  # unquoted
    with pytest.raises(ConfigError, match="-c 'fleet=boards': The provided config"):
        run_config_from_args(args)


@pytest.mark.slow
def test_flwr_run_takes_every_documented_key_and_fails_a_bad_one_in_one_line(
    tmp_path: Path,
) -> None:
    from procs import Federation

    out = tmp_path / "runs"
    with Federation(tmp_path / "fed") as fed:
        fed.start_superlink(simulated_supernodes=EXAMPLES["num-nodes"])
        run = fed.run(ROOT, {**EXAMPLES, "output-dir": str(out)}, timeout=300)
        assert run.status == "finished:completed", run.log[-3000:]
        bad = fed.run(ROOT, {"num-nodes": 2, "proximal-mu": 1e308}, timeout=300)
    [folder] = out.iterdir()
    config = json.loads((folder / "results.json").read_text())["config"]
    assert config == {**EXAMPLES, "output-dir": str(out)}
    assert bad.status == "finished:failed"
    line = "RunFailed: flowerbed: run-config 'proximal-mu' must be in [0, 1000]"
    assert bad.log.count(line) == 1
    assert "Traceback" not in bad.log


def test_the_documented_ranges_are_the_checked_ones() -> None:
    from dataclasses import replace

    from flowerbed.sims.config import LIMITS

    page = (ROOT / "docs" / "simulation.md").read_text()
    table = re.split(r"\n##+ ", page.split("## Run config", 1)[1], maxsplit=1)[0]
    documented: dict[str, str] = {}
    for line in table.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            keys = re.findall(r"`([a-z-]+)`", cells[0])
            for key, valid in zip(keys, cells[2].split("; "), strict=True):
                documented[key] = valid
    for key, limit in LIMITS.items():
        assert documented[key] == replace(limit, note="").describe(), key
