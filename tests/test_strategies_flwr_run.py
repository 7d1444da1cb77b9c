"""The strategies inside an unmodified Flower ServerApp under `flwr run` (Ray).

The app below is what a Flower user has: a ServerApp written like Flower's
templates with ``FedAvg`` swapped for each flowerbed strategy, and plain ClientApps
that report nothing but ``num-examples``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from flowerbed.parallel.group import free_port
from procs import proc_files

PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "plainfl"
version = "1.0.0"
dependencies = ["flwr[simulation]>=1.41.0"]

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "flowerbed-tests"

[tool.flwr.app.components]
serverapp = "plainfl.server_app:app"
clientapp = "plainfl.client_app:app"

[tool.flwr.app.config]
num-rounds = 2
out-file = ""
"""

CLIENT_APP = '''\
"""A plain Flower ClientApp: least squares on local data, reports num-examples only."""

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


def local_data(context: Context) -> tuple[np.ndarray, np.ndarray]:
    pid = int(context.node_config["partition-id"])
    rng = np.random.default_rng(pid)
    x = rng.normal(size=(20 + 10 * pid, 3))
    return x, x @ np.array([1.0, -2.0, 0.5])


@app.train()
def train(msg: Message, context: Context) -> Message:
    w = msg.content["arrays"]["w"].numpy()
    x, y = local_data(context)
    for _ in range(5):
        w = w - 0.1 * x.T @ (x @ w - y) / len(x)
    content = RecordDict(
        {
            "arrays": ArrayRecord({"w": Array(w)}),
            "metrics": MetricRecord({"num-examples": len(x)}),
        }
    )
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    w = msg.content["arrays"]["w"].numpy()
    x, y = local_data(context)
    loss = float(np.mean((x @ w - y) ** 2))
    metrics = MetricRecord({"num-examples": len(x), "loss": loss})
    return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)
'''

SERVER_APP = '''\
"""A Flower ServerApp as Flower's templates write it, with FedAvg swapped out."""

import json

import numpy as np
from flwr.app import Array, ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from flowerbed.strategies import DeadlineFedAvg, FedBuff, RuntimeWeightedFedAvg

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    num_rounds = int(context.run_config["num-rounds"])
    strategies = {
        "RuntimeWeightedFedAvg": RuntimeWeightedFedAvg(
            fraction_evaluate=0.5, weighting="runtime"
        ),
        "DeadlineFedAvg": DeadlineFedAvg(fraction_evaluate=0.5, deadline_s=60.0),
        "FedBuff": FedBuff(fraction_evaluate=0.5, buffer_size=2),
    }
    report = {}
    for name, strategy in strategies.items():
        initial = ArrayRecord({"w": Array(np.zeros(3))})
        result = strategy.start(grid, initial_arrays=initial, num_rounds=num_rounds)
        report[name] = {
            "w": result.arrays["w"].numpy().tolist(),
            "train_rounds": sorted(result.train_metrics_clientapp),
            "evaluate_loss": {
                r: m["loss"] for r, m in result.evaluate_metrics_clientapp.items()
            },
        }
    with open(str(context.run_config["out-file"]), "w") as f:
        json.dump(report, f)
'''

STRATEGIES = ("RuntimeWeightedFedAvg", "DeadlineFedAvg", "FedBuff")


def superlink_pids(flwr_home: Path) -> list[int]:
    """PIDs of the local SuperLink that `flwr run` started for this FLWR_HOME."""
    pids = []
    for pid, raw in proc_files("cmdline"):
        cmdline = raw.replace(b"\0", b" ").decode()
        if "flower-superlink" in cmdline and str(flwr_home) in cmdline:
            pids.append(pid)
    return pids


@pytest.fixture
def flwr_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """Environment for `flwr run`; stops the SuperLink it starts, even on failure."""
    home = tmp_path / "flwr-home"
    home.mkdir()
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(free_port()),
    }
    try:
        yield env
    finally:
        for pid in superlink_pids(home):
            # flwr starts it in its own session: stop its process group.
            os.killpg(pid, signal.SIGTERM)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="finds the SuperLink via /proc")
def test_strategies_run_in_an_unmodified_serverapp_with_plain_clients(
    tmp_path: Path, flwr_env: dict[str, str]
) -> None:
    app = tmp_path / "app"
    (app / "plainfl").mkdir(parents=True)
    (app / "pyproject.toml").write_text(PYPROJECT)
    (app / "plainfl" / "__init__.py").write_text("")
    (app / "plainfl" / "client_app.py").write_text(CLIENT_APP)
    (app / "plainfl" / "server_app.py").write_text(SERVER_APP)
    out = tmp_path / "out.json"
    command = [
        "flwr",
        "run",
        str(app),
        "--stream",
        "--federation-config",
        "num-supernodes=4",
        "--run-config",
        f"out-file='{out}'",
    ]
    proc = subprocess.Popen(
        command, env=flwr_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        log, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    report = json.loads(out.read_text())
    assert sorted(report) == sorted(STRATEGIES)
    for name in STRATEGIES:
        assert report[name]["train_rounds"] == [1, 2], name
        loss = report[name]["evaluate_loss"]
        assert loss["2"] < loss["1"], name
    # The clients send neither train-time-s nor num-steps: the strategies say how
    # they fell back (runtime weighting measures round trips; FedNova, the
    # default, counts one step per node).
    assert "using the measured reply round-trip time" in text
    assert "fednova weighting without 'num-steps'" in text
