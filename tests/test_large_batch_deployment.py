"""LargeBatchSync in a real deployment: 4 flower-supernode processes on 127.0.0.1.

The boards run ``flowerbed.clients.span_app:app`` (DDP over gloo between the
SuperNodes' ClientApp processes). In round 1, once a member has started its
segment's steps, its SuperNode is killed with its ClientApp (a board losing
power); in round 2 another member's ``flower-supernode`` process alone (its
ClientApp must notice and end itself). Each time the segment fails fast, the
next one's plan reaches the survivors at most 10 s after the kill and its first
step follows within ``span_kills.FIRST_STEP_BOUND_S``, without the lost board;
the log says which member was lost and why, and the job completes with the
other members.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from procs import Federation, free_port, write_app
from span_kills import (
    FLOWER_ENV,
    assert_recovered,
    failure_to_next_step,
    kill,
    wait_all_gone,
    wait_for_segment,
)

pytestmark = pytest.mark.slow

SERVER_APP = """
import json

from flowerbed.models import build_sequential
from flowerbed.strategies import LargeBatchSync
from flowerbed.strategies.large_batch_options import AllReduceRecipe
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
        min_available_nodes=4,
        model="deep-mlp",
        model_args=ARGS,
        dataset="digits",
        batch_size=16,
        steps_per_round=int(cfg["steps"]),
        rendezvous_port=int(cfg["port"]),
        rendezvous_ports=5,
        join_timeout_s=45.0,
        timeout_s=20.0,
        reply_margin_s=10.0,
        recipe=AllReduceRecipe(
            optimizer="lars",
            base_lr=0.5,
            base_batch=16,
            trust=0.02,
        ),
    )
    model = build_sequential("deep-mlp", ARGS, seed=0)
    arrays = ArrayRecord(model.state_dict())
    result = strategy.start(grid, arrays, num_rounds=2, timeout=600)
    rounds = {str(r): dict(m) for r, m in result.train_metrics_clientapp.items()}
    with open(str(cfg["out-file"]), "w") as fh:
        json.dump({"rounds": rounds, "lost": sorted(strategy.lost)}, fh)
"""

DEFAULTS = {"steps": 20, "port": 29500, "out-file": ""}
"""The run config's defaults (the test sets port and out-file per run)."""


def test_killed_boards_are_found_in_seconds_and_the_next_segments_complete(
    tmp_path: Path,
) -> None:
    app_dir = write_app(tmp_path, "fblargebatch", SERVER_APP, DEFAULTS)
    out = tmp_path / "result.json"
    with Federation(tmp_path / "fed", env=FLOWER_ENV) as fed:
        fed.start_superlink()
        # equal emulated boards: deep-mlp(16, 3) at 1e5 FLOP/s, ~0.5 s a step
        nodes = [
            fed.add_supernode(
                {"address": "127.0.0.1", "emulate-gflops": 1e-4}, name=f"board{i}"
            )
            for i in range(4)
        ]
        fed.wait_for_nodes(nodes)
        run = fed.submit(
            app_dir, {"steps": 20, "port": free_port(), "out-file": str(out)}
        )
        # Round 1: once board 3 has joined and starts its steps (its 20 steps
        # take at least 10 s of emulated compute), cut its power.
        segment = wait_for_segment(nodes[3], 0, timeout=300)
        killed_at = kill(nodes[3], "board")
        seconds = {}
        seconds["board"] = failure_to_next_step(
            nodes[:3], killed_at, segment, also={"server": run.log}
        )
        # Round 2: once board 2 starts a segment after round 1's, kill only its
        # flower-supernode process.
        retry = wait_for_segment(nodes[2], segment, timeout=120)
        segment = wait_for_segment(nodes[2], retry, timeout=300)
        killed_at = kill(nodes[2], "supernode")
        seconds["supernode"] = failure_to_next_step(
            nodes[:2], killed_at, segment, also={"server": run.log}
        )
        left = wait_all_gone(nodes[2])
        result = run.wait(900)
        logs = "\n".join(f"--- {n.name} ---\n{n.log()[-1500:]}" for n in nodes)
    why = f"{result.log[-4000:]}\n{logs}"
    assert_recovered("large batch", seconds, left, why, nodes)
    assert result.status == "finished:completed", why
    assert out.exists(), why
    data = json.loads(out.read_text())
    assert len(data["lost"]) == 2, why
    first, second = data["rounds"]["1"], data["rounds"]["2"]
    # round 1 ends with the three boards left (two, had its retry also failed)
    assert first["attempts"] >= 2 and first["members"] >= 2, why
    assert second["attempts"] >= 2 and second["members"] == 2, why
    assert second["replica-max-diff"] == 0.0, why
    # The log names each lost member and why: its peers found it gone.
    assert result.log.count("found it gone") >= 2, why
    assert "refused the connection: its process is gone" in result.log, why
