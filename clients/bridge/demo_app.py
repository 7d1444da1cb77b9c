"""A ServerApp for phone fleets: digits features (64 -> 10) on phones via the bridge.

The models are PyTorch ``nn.Linear`` stacks whose array names are the ones the
Java phone trainer understands: softmax regression ``fc.weight`` [10, 64],
``fc.bias`` [10]; or an MLP ``fc1.weight`` [hidden, 64], ``fc1.bias``,
``fc2.weight`` [10, hidden], ``fc2.bias``. Each phone holds its share of
scikit-learn's digits (8x8 pixels scaled to [0, 1], flattened) as a CSV file
``label,f1,...,f64`` (see :func:`write_phone_csvs`); the ServerApp evaluates the
global model on the held-out digits test split after every round.

The same app runs in Flower's simulation with :data:`client_app`, a Python node
doing what the Java phone does (same model, same data split, same metrics), so a
phone fleet and a simulated one can be compared.

Run config keys (all optional): ``num-rounds`` (5), ``strategy`` (``fedavg``,
``runtime-weighted``, ``deadline`` or ``large-batch``: LargeBatchRounds, one
large batch of ``batch-size`` samples per phone per round), ``hidden`` (0 =
softmax regression), ``local-steps`` (20), ``lr`` (0.5), ``batch-size`` (16),
``deadline-s`` (10, sent to phones; the ``deadline`` strategy's round deadline),
``round-timeout-s`` (30), ``min-nodes`` (2, the strategy's minimum),
``wait-nodes`` (``min-nodes``: phones to wait for before round 1),
``wait-nodes-s`` (60), ``results-path`` ("" = do not write).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flowerbed import keys
from flowerbed.clients.training import evaluate, train_steps
from flowerbed.data import load_dataset, partition
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from torch import nn

NUM_FEATURES = 64
NUM_CLASSES = 10
STRATEGIES = ("fedavg", "runtime-weighted", "deadline", "large-batch")


class SoftmaxRegression(nn.Module):
    """``fc``: one linear layer on the flattened 8x8 image."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(NUM_FEATURES, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1))


class MLP(nn.Module):
    """``fc1`` -> ReLU -> ``fc2`` on the flattened 8x8 image."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(NUM_FEATURES, hidden)
        self.fc2 = nn.Linear(hidden, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def phone_model(hidden: int = 0, seed: int = 0) -> nn.Module:
    """Softmax regression (``hidden == 0``) or an MLP with ``hidden`` units."""
    if hidden < 0:
        raise ValueError(f"hidden must be >= 0 (0 = softmax regression), got {hidden}")
    torch.manual_seed(seed)
    return SoftmaxRegression() if hidden == 0 else MLP(hidden)


def digits_features() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits as flat float32 features in [0, 1]: x_train, y_train, x_test, y_test."""
    data = load_dataset("digits")
    flat = (data.x_train.reshape(len(data.x_train), -1), data.x_test.reshape(-1, 64))
    return flat[0], data.y_train, flat[1], data.y_test


def write_phone_csvs(out_dir: str | Path, num_phones: int, seed: int = 0) -> list[Path]:
    """Split the digits training set IID over phones; one CSV per phone.

    Rows are ``label,f1,...,f64`` (the JVM phone's ``--data`` format).
    """
    x, y, _, _ = digits_features()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, idx in enumerate(partition(y, num_phones, "iid", seed=seed)):
        path = out / f"phone-{i}.csv"
        rows = np.column_stack([y[idx].astype(np.float64), x[idx]])
        fmt = ["%d"] + ["%.6g"] * NUM_FEATURES
        np.savetxt(path, rows, fmt=fmt, delimiter=",")
        paths.append(path)
    return paths


def _number(cfg: Any, key: str, default: float) -> float:
    """A numeric run-config or ConfigRecord value; ValueError names the key."""
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"config {key!r} must be a number, got {value!r}")
    return float(value)


def _strategy(
    name: str, min_nodes: int, deadline_s: float, batch_size: int = 16
) -> FedAvg:
    common: dict[str, Any] = {
        "fraction_train": 1.0,
        "fraction_evaluate": 0.0,
        "min_train_nodes": min_nodes,
        "min_evaluate_nodes": 0,
        "min_available_nodes": min_nodes,
    }
    if name == "fedavg":
        return FedAvg(**common)
    from flowerbed.strategies import RuntimeWeightedFedAvg

    if name == "runtime-weighted":
        return RuntimeWeightedFedAvg(**common)
    if name == "large-batch":
        from flowerbed.strategies import LargeBatchRounds

        # one large batch of batch-size samples per phone, momentum SGD on the
        # server at the batch's rate (docs/large-batch.md)
        batch = batch_size * min_nodes
        return LargeBatchRounds.from_settings(
            **common,
            deadline_s=deadline_s,
            batch_size=batch,
            optimizer="sgd",
            base_lr=0.5,
            base_batch=batch,
        )
    from flowerbed.strategies import DeadlineFedAvg

    return DeadlineFedAvg.from_settings(**common, deadline_s=deadline_s)


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Train the phone model for ``num-rounds`` rounds; record accuracy per round."""
    cfg = context.run_config
    name = str(cfg.get("strategy", "fedavg"))
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; valid: {', '.join(STRATEGIES)}")
    min_nodes = int(_number(cfg, "min-nodes", 2))
    deadline_s = _number(cfg, "deadline-s", 10.0)
    wait_nodes = int(_number(cfg, "wait-nodes", min_nodes))
    wait_until = time.monotonic() + _number(cfg, "wait-nodes-s", 60.0)
    while len(list(grid.get_node_ids())) < wait_nodes:
        if time.monotonic() > wait_until:
            raise RuntimeError(f"fewer than {wait_nodes} phones connected in time")
        time.sleep(0.5)

    model = phone_model(int(_number(cfg, "hidden", 0)))
    _, _, x_test, y_test = digits_features()
    rounds: list[dict[str, Any]] = []
    started = time.monotonic()

    def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, acc = evaluate(model, x_test, y_test)
        rounds.append(
            {
                "round": server_round,
                "accuracy": acc,
                "loss": loss,
                "elapsed-s": time.monotonic() - started,
            }
        )
        return MetricRecord({"accuracy": acc, "loss": loss})

    train_config = ConfigRecord(
        {
            keys.LOCAL_STEPS: int(_number(cfg, "local-steps", 20)),
            keys.LEARNING_RATE: _number(cfg, "lr", 0.5),
            keys.BATCH_SIZE: int(_number(cfg, "batch-size", 16)),
            keys.DEADLINE_S: deadline_s,
        }
    )
    batch = int(_number(cfg, "batch-size", 16))
    result = _strategy(name, min_nodes, deadline_s, batch).start(
        grid,
        ArrayRecord(model.state_dict()),
        num_rounds=int(_number(cfg, "num-rounds", 5)),
        timeout=_number(cfg, "round-timeout-s", 30.0),
        train_config=train_config,
        evaluate_fn=central,
    )
    path = str(cfg.get("results-path", ""))
    if path:
        train = {str(r): dict(m) for r, m in result.train_metrics_clientapp.items()}
        Path(path).write_text(
            json.dumps({"strategy": name, "rounds": rounds, "train": train}, indent=1)
        )


client_app = ClientApp()


@client_app.train()
def train(msg: Message, context: Context) -> Message:
    """Train on partition ``partition-id`` of ``num-partitions`` (simulation)."""
    pid = int(context.node_config["partition-id"])
    parts = int(context.node_config["num-partitions"])
    x, y, _, _ = digits_features()
    idx = partition(y, parts, "iid")[pid]
    arrays = msg.content[keys.ARRAYS]
    cfg = msg.content[keys.CONFIG]
    assert isinstance(arrays, ArrayRecord) and isinstance(cfg, ConfigRecord)
    state = arrays.to_torch_state_dict()
    hidden = 0 if "fc.weight" in state else int(state["fc1.weight"].shape[0])
    model = phone_model(hidden)
    model.load_state_dict(state)
    started = time.monotonic()
    stats = train_steps(
        model,
        x[idx],
        y[idx],
        steps=int(_number(cfg, keys.LOCAL_STEPS, 20)),
        batch_size=int(_number(cfg, keys.BATCH_SIZE, 16)),
        lr=_number(cfg, keys.LEARNING_RATE, 0.5),
        seed=int(_number(cfg, keys.SERVER_ROUND, 0)) * 1000 + pid,
    )
    metrics = MetricRecord(
        {
            keys.NUM_EXAMPLES: len(idx),
            keys.NUM_STEPS: stats.num_steps,
            keys.TRAIN_TIME_S: time.monotonic() - started,
        }
    )
    content = RecordDict(
        {keys.ARRAYS: ArrayRecord(model.state_dict()), keys.METRICS: metrics}
    )
    return Message(content, reply_to=msg)
