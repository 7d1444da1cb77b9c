"""TiledTraining on a real Flower deployment on 127.0.0.1.

A ``flower-superlink`` and three ``flower-supernode`` processes (tests/procs.py)
run the boards' span ClientApp (``flowerbed.clients.span_app:app``), each
advertising ``address='127.0.0.1'``; a small Flower App written into the test's
folder runs :class:`~flowerbed.strategies.TiledTraining` on a YOLO-tiny-style
CNN (64x64 inputs, group norm) for one round of three steps (the rounds loop
and the momentum carried between rounds are tested on local processes,
tests/test_tiles_strategy.py). Every message goes through the SuperLink, every
ClientApp is a fresh ``flwr-clientapp`` process, and the members of a segment
meet over gloo on 127.0.0.1. The weights the
ServerApp ends with must equal three steps of single-device training on the
same batches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flowerbed.models import build_sequential
from flowerbed.parallel.group import free_port
from flowerbed.parallel.tiles.runner import JobData
from procs import Federation, UserValue, write_app

pytestmark = pytest.mark.slow

MODEL_ARGS: dict[str, Any] = {
    "image_size": 64,
    "width": 4,
    "num_classes": 10,
    "norm": "group",
}
SEED, BATCH, STEPS, ROUNDS = 3, 2, 3, 1
LR, MOMENTUM = 0.05, 0.9
RUN_TIMEOUT_S = 600.0

SERVER_APP = '''
"""ServerApp of the tile deployment test: TiledTraining, results to out-file."""

import json

import numpy as np
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from flowerbed.models import build_sequential
from flowerbed.strategies import TiledTraining
from flowerbed.strategies.accumulation import to_arrayrecord, to_numpy

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    args = {
        "image_size": int(cfg["image-size"]),
        "width": int(cfg["width"]),
        "num_classes": int(cfg["classes"]),
        "norm": str(cfg["norm"]),
    }
    model = build_sequential("yolo-tiny", args, seed=int(cfg["seed"]))
    initial = {k: v.numpy() for k, v in model.state_dict().items()}
    strategy = TiledTraining(
        model="yolo-tiny",
        model_args=args,
        input_shape=(3, 64, 64),
        dataset="synthetic",
        batch_size=int(cfg["batch-size"]),
        steps_per_round=int(cfg["steps"]),
        lr=float(cfg["lr"]),
        momentum=float(cfg["momentum"]),
        seed=int(cfg["seed"]),
        fraction_evaluate=0.0,
        min_train_nodes=3,
        min_available_nodes=3,
        rendezvous_port=int(cfg["port"]),
        rendezvous_ports=10,
        join_timeout_s=120,
        timeout_s=60,
    )
    result = strategy.start(
        grid, to_arrayrecord(initial), num_rounds=int(cfg["rounds"]), timeout=400
    )
    np.savez(str(cfg["out-file"]) + ".npz", **to_numpy(result.arrays))
    rounds = {
        str(k): {n: v for n, v in m.items()}
        for k, m in result.train_metrics_clientapp.items()
    }
    with open(str(cfg["out-file"]) + ".json", "w") as fh:
        json.dump({"rounds": rounds, "boards": len(strategy.boards)}, fh)
'''

DEFAULTS: dict[str, UserValue] = {
    "image-size": 64,
    "width": 4,
    "classes": 10,
    "norm": "none",
    "seed": 0,
    "batch-size": 2,
    "steps": 2,
    "rounds": 2,
    "lr": 0.05,
    "momentum": 0.9,
    "port": 29500,
    "out-file": "",
}
"""The run config's defaults of the test app."""


def single_device() -> dict[str, np.ndarray]:
    model = build_sequential("yolo-tiny", MODEL_ARGS, seed=SEED)
    model.train()
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    data = JobData("synthetic", (3, 64, 64), int(MODEL_ARGS["num_classes"]))
    for step in range(ROUNDS * STEPS):
        x, y = data.batch(SEED, step, BATCH)
        sgd.zero_grad()
        F.cross_entropy(model(x), y).backward()
        sgd.step()
    return {k: v.numpy() for k, v in model.state_dict().items()}


def test_tiled_training_on_supernodes_equals_single_device_training(
    tmp_path: Path,
) -> None:
    app_dir = write_app(tmp_path, "fbtilestest", SERVER_APP, DEFAULTS)
    out = tmp_path / "result"
    with Federation(tmp_path / "fed") as fed:
        fed.start_superlink()
        nodes = [
            fed.add_supernode(
                {"address": "127.0.0.1", "state-dir": str(tmp_path / f"s{i}")},
                name=f"board{i}",
            )
            for i in range(3)
        ]
        fed.wait_for_nodes(nodes)
        run = fed.run(
            app_dir,
            {
                "image-size": MODEL_ARGS["image_size"],
                "width": MODEL_ARGS["width"],
                "classes": MODEL_ARGS["num_classes"],
                "norm": MODEL_ARGS["norm"],
                "seed": SEED,
                "batch-size": BATCH,
                "steps": STEPS,
                "rounds": ROUNDS,
                "lr": LR,
                "momentum": MOMENTUM,
                "port": free_port(),
                "out-file": str(out),
            },
            timeout=RUN_TIMEOUT_S,
        )
        why = run.log[-3000:] + "".join(n.log()[-1500:] for n in nodes)
    assert run.status == "finished:completed", why
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["boards"] == 3, why
    assert sorted(summary["rounds"]) == [str(r + 1) for r in range(ROUNDS)]
    for metrics in summary["rounds"].values():
        assert metrics["tiles-segment-ok"] == 1, why
        assert metrics["tiles-devices"] == 3
    expected = single_device()
    with np.load(out.with_suffix(".npz")) as found:
        assert set(found.files) == set(expected)
        for name, value in expected.items():
            np.testing.assert_allclose(
                found[name], value, rtol=1e-4, atol=1e-5, err_msg=name
            )
