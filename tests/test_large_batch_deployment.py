"""LargeBatchSync in a real deployment: 3 flower-supernode processes on 127.0.0.1.

The boards run ``flowerbed.clients.span_app:app`` (DDP over gloo between the
SuperNodes' ClientApp processes); one SuperNode is killed with its ClientApp
while the first segment runs: that segment fails fast and the next one
completes with the other two.
"""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import pytest
from procs import Federation, free_port

pytestmark = pytest.mark.slow

SETTLE_S = 5.0
"""Seconds from the segment's ClientApp start to the kill: time to join the group
(a kill before that is a loss at the rendezvous, which the test accepts too)."""

SERVER_APP = """
import json

from flowerbed.models import build_sequential
from flowerbed.strategies import LargeBatchSync
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

app = ServerApp()
ARGS = {"hidden": 16, "depth": 3}


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    strategy = LargeBatchSync(
        fraction_evaluate=0.0,
        min_train_nodes=2,
        min_available_nodes=3,
        model="deep-mlp",
        model_args=ARGS,
        dataset="digits",
        batch_size=16,
        steps_per_round=int(cfg["steps"]),
        optimizer="lars",
        base_lr=0.5,
        base_batch=16,
        trust=0.02,
        rendezvous_port=int(cfg["port"]),
        rendezvous_ports=5,
        join_timeout_s=45.0,
        timeout_s=20.0,
        reply_margin_s=10.0,
    )
    model = build_sequential("deep-mlp", ARGS, seed=0)
    arrays = ArrayRecord(model.state_dict())
    result = strategy.start(grid, arrays, num_rounds=2, timeout=600)
    rounds = {str(r): dict(m) for r, m in result.train_metrics_clientapp.items()}
    with open(str(cfg["out-file"]), "w") as fh:
        json.dump({"rounds": rounds, "lost": sorted(strategy.lost)}, fh)
"""

PYPROJECT = """
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fblargebatch"
version = "1.0.0"
description = "flowerbed large-batch deployment test app"
license = "Apache-2.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "flowerbed"

[tool.flwr.app.components]
serverapp = "fblargebatch.server:app"
clientapp = "flowerbed.clients.span_app:app"

[tool.flwr.app.config]
steps = 40
port = 29500
out-file = ""
"""


def write_app(root: Path) -> Path:
    app_dir = root / "app"
    package = app_dir / "fblargebatch"
    package.mkdir(parents=True)
    (app_dir / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT))
    (package / "__init__.py").write_text("")
    (package / "server.py").write_text(SERVER_APP)
    return app_dir


def test_a_supernode_killed_mid_segment_and_the_next_segment_completes(
    tmp_path: Path,
) -> None:
    app_dir = write_app(tmp_path)
    out = tmp_path / "result.json"
    with Federation(tmp_path / "fed") as fed:
        fed.start_superlink()
        # equal emulated boards: deep-mlp(16, 3) at 1e5 FLOP/s, ~0.5 s a step
        nodes = [
            fed.add_supernode(
                {"address": "127.0.0.1", "emulate-gflops": 1e-4}, name=f"board{i}"
            )
            for i in range(3)
        ]
        fed.wait_for_nodes(nodes)
        run = fed.submit(
            app_dir, {"steps": 40, "port": free_port(), "out-file": str(out)}
        )
        # Each message starts a ClientApp process: the first the speed profile,
        # the second round 1's segment. Its 40 steps take at least 20 s of
        # emulated compute however idle the host, so a few seconds after that
        # start the board is joining or training, never done.
        started = "Start `flwr-clientapp` process"
        first = nodes[2].wait_for_log(started, timeout=300)
        nodes[2].wait_for_log(started, timeout=300, start=first.end())
        time.sleep(SETTLE_S)
        nodes[2].kill()
        result = run.wait(900)
        logs = "\n".join(f"--- {n.name} ---\n{n.log()[-1500:]}" for n in nodes)
    why = f"{result.log[-4000:]}\n{logs}"
    assert result.status == "finished:completed", why
    assert out.exists(), why
    data = json.loads(out.read_text())
    assert len(data["lost"]) == 1, why
    first, second = data["rounds"]["1"], data["rounds"]["2"]
    assert first["attempts"] >= 2 and first["members"] == 2, why
    assert second["members"] == 2 and second["replica-max-diff"] == 0.0, why
