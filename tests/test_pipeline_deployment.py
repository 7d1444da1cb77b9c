"""PipelineTraining on real Flower processes: a SuperLink and four SuperNodes.

``flower-superlink`` and four ``flower-supernode`` processes run on 127.0.0.1,
each SuperNode with ``address='127.0.0.1'`` and an emulated device speed in its
node_config (the span ClientApp's ``emulate-gflops``); one of them is 10x slower
than the others. A small Flower App written into the test's folder runs
:class:`PipelineTraining` (the ServerApp below) over all four. In round 2, just
after a member logs a replication (so in the middle of the segment), its
SuperNode is killed with SIGKILL, with its ClientApp (a board losing power); in
round 3 another member's ``flower-supernode`` process alone is killed (its
ClientApp must notice and end itself). The job must finish its rounds, the slow
node must hold the fewest layers, at most R steps may be lost per recovery, the
next segment's plan must reach the survivors at most 10 s after each kill and
its first step follow within ``span_kills.FIRST_STEP_BOUND_S`` (a fresh
ClientApp process per message on a busy host), the log must name each lost
member and why, and the final weights must equal
single-process training of the same steps (the pipeline is synchronous). Every
process is stopped by its pid.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import reference
from procs import Federation, alive, tagged, write_app
from span_kills import (
    FLOWER_ENV,
    assert_recovered,
    failure_to_next_step,
    kill,
    segments_started,
    wait_all_gone,
)

pytestmark = pytest.mark.slow

MODEL, ARGS = "deep-mlp", {"in_features": 64, "hidden": 48, "depth": 8}
K, R, BATCH, LR, ROUNDS = 12, 3, 16, 0.1, 3
FAST, SLOW = 0.01, 0.001  # GFLOP/s: the slow node is 10x slower
RUN_TIMEOUT_S = 600.0

SERVER_APP = '''
"""ServerApp of the pipeline deployment test: PipelineTraining, results to a file."""

import json

import numpy as np
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from flowerbed.models import build_sequential
from flowerbed.strategies import PipelineTraining
from flowerbed.strategies.pipeline_options import Pipelining
from flowerbed.strategies.span_options import SpanGroup

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    args = {"in_features": 64, "hidden": int(cfg["hidden"]), "depth": int(cfg["depth"])}
    strategy = PipelineTraining(
        fraction_evaluate=0.0,
        min_train_nodes=2,
        min_available_nodes=int(cfg["num-nodes"]),
        model=str(cfg["model"]),
        model_args=args,
        input_shape=(1, 8, 8),
        dataset="digits",
        steps_per_round=int(cfg["steps"]),
        batch_size=int(cfg["batch"]),
        pipelining=Pipelining(replicate_every=int(cfg["replicate-every"])),
        lr=float(cfg["lr"]),
        group=SpanGroup(
            rendezvous_port=int(cfg["port"]),
            rendezvous_ports=10,
            join_timeout_s=90.0,
            timeout_s=10.0,
            reply_margin_s=10.0,
        ),
    )
    model = build_sequential(str(cfg["model"]), args, seed=0)
    result = strategy.start(
        grid, ArrayRecord(model.state_dict()), num_rounds=int(cfg["num-rounds"])
    )
    arrays = {k: v.numpy() for k, v in result.arrays.items()}
    np.savez(str(cfg["out-file"]) + ".npz", **arrays)
    out = {
        "rounds": {
            str(r): dict(m) for r, m in result.train_metrics_clientapp.items()
        },
        "events": strategy.events,
        "layouts": {str(r): v for r, v in strategy.layouts.items()},
        "power": {str(n): p for n, p in strategy.profiled_power.items()},
        "labels": {str(n): m.label for n, m in strategy.members.items()},
    }
    with open(str(cfg["out-file"]), "w") as fh:
        json.dump(out, fh)
'''

DEFAULTS: dict[str, str | int | float] = {
    "num-rounds": 2,
    "num-nodes": 4,
    "model": "deep-mlp",
    "hidden": 48,
    "depth": 8,
    "steps": 12,
    "batch": 16,
    "replicate-every": 3,
    "lr": 0.1,
    "port": 29500,
    "out-file": "",
}


def test_pipeline_survives_a_killed_supernode_and_puts_few_layers_on_the_slow_one(
    tmp_path: Path,
) -> None:
    from flowerbed.parallel.group import free_port

    app_dir = write_app(tmp_path, "fbpipelinetest", SERVER_APP, DEFAULTS)
    out = tmp_path / "result.json"
    speeds = {"n0": FAST, "n1": FAST, "n2": SLOW, "n3": FAST}
    with Federation(tmp_path / "fed", env=FLOWER_ENV) as fed:
        fed.start_superlink()
        nodes = [
            fed.add_supernode(
                {
                    "address": "127.0.0.1",
                    "device": name,
                    "emulate-gflops": gflops,
                    "state-dir": str(tmp_path / "state" / name),
                },
                name=name,
            )
            for name, gflops in speeds.items()
        ]
        fed.wait_for_nodes(nodes)
        handle = fed.submit(
            app_dir,
            {
                "num-rounds": ROUNDS,
                "num-nodes": 4,
                "model": MODEL,
                "hidden": ARGS["hidden"],
                "depth": ARGS["depth"],
                "steps": K,
                "batch": BATCH,
                "replicate-every": R,
                "lr": LR,
                "port": free_port(),
                "out-file": str(out),
            },
        )
        # Mid-segment in round 2 (steps 12-23): right after the victim replicated
        # at step 15 (R = 3), cut its power; the survivors hold step 15.
        victim = nodes[1]
        victim.wait_for_log(r"replicated at step 15\b", 400)
        board = set(tagged(victim.tag))
        segment = max(segments_started(victim))
        killed_at = kill(victim, "board")
        assert not [pid for pid in board if alive(pid)]
        survivors = [n for n in nodes if n is not victim]
        seconds = {}
        seconds["board"] = failure_to_next_step(
            survivors, killed_at, segment, also={"server": handle.log}
        )
        # Mid-segment in round 3 (steps 24-35): only the flower-supernode process
        # of another member; its ClientApp must end itself.
        victim = nodes[3]
        victim.wait_for_log(r"replicated at step 27\b", 400)
        segment = max(segments_started(victim))
        killed_at = kill(victim, "supernode")
        survivors = [n for n in survivors if n is not victim]
        seconds["supernode"] = failure_to_next_step(
            survivors, killed_at, segment, also={"server": handle.log}
        )
        left = wait_all_gone(victim)
        run = handle.wait(RUN_TIMEOUT_S)
        why = "\n".join(
            [f"--- run ---\n{run.log[-6000:]}"]
            + [f"--- {n.name} ---\n{n.log()[-2000:]}" for n in fed.supernodes]
        )
    assert_recovered("pipeline", seconds, left, why, fed.supernodes)
    assert run.status == "finished:completed", why
    result = json.loads(out.read_text())
    rounds = result["rounds"]
    assert sorted(rounds) == ["1", "2", "3"], why

    # The 10x slower board holds the fewest layers of the first layout: none
    # when one layer on it would pace the pipeline below what the other three
    # reach without it (the planner keeps it on standby and says so).
    first_layout = result["layouts"]["1"]
    layers = {name: 0 for name in speeds}
    layers.update({s["device"]: s["layers"][1] - s["layers"][0] for s in first_layout})
    assert layers["n2"] == min(layers.values()), why
    assert layers["n2"] < max(layers.values())
    if layers["n2"] == 0:
        assert "standby" in result["events"][0], why

    # Each loss was recovered in its round, at most R steps lost each time, and
    # the log says which member was lost and why (its peers found it gone).
    for r in ("2", "3"):
        assert rounds[r]["recoveries"] >= 1, why
        assert 0 <= rounds[r]["lost-steps"] <= R * rounds[r]["recoveries"], why
    assert any("restart at step" in e for e in result["events"]), why
    assert "restart at step" in run.log
    assert run.log.count("found it gone") >= 2, why
    assert "refused the connection: its process is gone" in run.log, why

    # Synchronous: the final weights are those of 36 single-process steps.
    got = dict(np.load(str(out) + ".npz"))
    want = reference.single_process(MODEL, ARGS, ROUNDS * K, BATCH, LR)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=0, atol=5e-6, err_msg=name)
