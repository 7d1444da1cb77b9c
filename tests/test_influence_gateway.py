"""One poisoning phone through the real gateway: the run trains on regardless.

Issue 17's scenario, end to end on 127.0.0.1: a local SuperLink, ``flowerbed
bridge``, ``flwr run`` of the phone-fleet ServerApp (``flowerbed.clients.bridge.
demo_app``, DeadlineFedAvg with its default influence bound) and Python phones
(``SimPhone``) training softmax regression on their share of digits.

One run has four honest phones; the other has the same four plus a phone that
returns the model it was sent times 1e6 and claims ``num-examples`` 1e15, then
1e308 (the gateway refuses both: above the strategies' ceiling), then 1e9
(accepted, at the ceiling: the weight cap and norm clipping must hold it), in
turn. Every round of the poisoned run must update the model and its final
accuracy must be within 2 points of the honest run's.
"""

from __future__ import annotations

import json
import math
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from flowerbed import keys
from flowerbed.clients.bridge.demo_app import phone_model, write_phone_csvs
from flowerbed.clients.bridge.procs import (
    free_port,
    start_gateway,
    stop_processes,
)
from flowerbed.clients.bridge.simphone import SimPhone
from flowerbed.clients.training import train_steps
from procs import UserValue, start_flwr_run, write_demo_app
from test_bridge_e2e import superlink  # the bridge e2e harness

pytestmark = pytest.mark.slow

HONEST = 4
ROUNDS = 10
CLAIMS = (1e15, 1e308, 1e9)
"""What the poisoning phone reports as num-examples, task after task."""
DEMO_CONFIG: dict[str, UserValue] = {
    "num-rounds": ROUNDS,
    "strategy": "deadline",
    "min-nodes": 2,
    "deadline-s": 10.0,
    "round-timeout-s": 30.0,
    "local-steps": 20,
    "lr": 0.5,
}
"""The demo app's run config in this test (``wait-nodes`` and ``results-path``
are each run's own)."""
__all__ = ["superlink"]  # fixture used by name


def honest_phone(url: str, token: str, data: Path, stop: threading.Event) -> None:
    """Train every train task on ``data`` (CSV rows label,f1..f64)."""
    rows = np.loadtxt(data, delimiter=",", dtype=np.float32)
    x, y = rows[:, 1:], rows[:, 0].astype(np.int64)
    model = phone_model(0)
    phone = SimPhone(url, token, timeout=30.0)
    phone.hello()
    while not stop.is_set():
        task = phone.poll(1.0)
        if task is None or task["type"] != "train":
            continue
        tensors = phone.download(task["task_id"])
        model.load_state_dict({n: torch.from_numpy(a.copy()) for n, a in tensors})
        config = task["config"]
        started = time.monotonic()
        stats = train_steps(
            model,
            x,
            y,
            steps=int(config[keys.LOCAL_STEPS]),
            batch_size=int(config[keys.BATCH_SIZE]),
            lr=float(config[keys.LEARNING_RATE]),
            seed=int(config[keys.SERVER_ROUND]) * 100 + int(token[-1]),
        )
        state = model.state_dict()
        phone.upload(task["task_id"], [(n, state[n].numpy()) for n, _ in tensors])
        phone.complete(
            task["task_id"],
            {
                keys.NUM_EXAMPLES: len(y),
                keys.NUM_STEPS: stats.num_steps,
                keys.TRAIN_TIME_S: max(time.monotonic() - started, 1e-3),
            },
        )
    phone.close()


def poisoning_phone(url: str, token: str, stop: threading.Event) -> list[int]:
    """Send the model x 1e6 with the claims in CLAIMS; return complete()'s statuses."""
    phone = SimPhone(url, token, timeout=30.0)
    phone.hello()
    statuses: list[int] = []
    while not stop.is_set():
        task = phone.poll(1.0)
        if task is None or task["type"] != "train":
            continue
        tensors = phone.download(task["task_id"])
        phone.upload(task["task_id"], [(n, a * 1e6) for n, a in tensors])
        claim = CLAIMS[len(statuses) % len(CLAIMS)]
        answer = phone.complete(
            task["task_id"], {keys.NUM_EXAMPLES: claim, keys.NUM_STEPS: 20}
        )
        statuses.append(answer.status)
        if answer.status != 200:
            phone.fail(task["task_id"], "refused")
    phone.close()
    return statuses


def run_fleet(tmp_path: Path, link_port: int, poisoned: bool) -> tuple[dict, list[int]]:  # type: ignore[type-arg]
    """One flwr run with the honest phones (and the poisoning one); its results."""
    data = tmp_path / "data"
    csvs = write_phone_csvs(data, HONEST)
    tokens = {f"phone-token-{i:04d}": f"p{i}" for i in range(HONEST)}
    if poisoned:
        tokens["phone-token-evil"] = "evil"
    (tmp_path / "tokens.txt").write_text(
        "".join(f"{t} {name}\n" for t, name in tokens.items())
    )
    phones = len(tokens)
    results = tmp_path / "results.json"
    config = {**DEMO_CONFIG, "wait-nodes": phones, "results-path": str(results)}
    app = write_demo_app(tmp_path, "poisoning", config)
    procs: list[subprocess.Popen[bytes]] = []
    stop = threading.Event()
    statuses: list[int] = []
    threads = []
    gw_port = free_port()
    try:
        procs.append(
            start_gateway(
                link_port,
                gw_port,
                tmp_path / "tokens.txt",
                tmp_path / "gateway.log",
                extra=("--pull-interval-s=0.2", "--max-poll-s=2"),
            )
        )
        run = start_flwr_run(app, link_port, tmp_path / "flwr-run.log")
        procs.append(run)
        url = f"http://127.0.0.1:{gw_port}"
        for i, csv in enumerate(csvs):
            token = f"phone-token-{i:04d}"
            threads.append(
                threading.Thread(target=honest_phone, args=(url, token, csv, stop))
            )
        if poisoned:

            def evil() -> None:
                statuses.extend(poisoning_phone(url, "phone-token-evil", stop))

            threads.append(threading.Thread(target=evil))
        for thread in threads:
            thread.start()
        run.wait(timeout=600)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
        stop_processes(procs, timeout=5)
    if not results.exists():
        log_tail = (tmp_path / "flwr-run.log").read_text()[-3000:]
        pytest.fail(f"no results; ServerApp log:\n{log_tail}")
    return json.loads(results.read_text()), statuses


def test_a_poisoning_phone_leaves_the_run_training_within_two_points(
    tmp_path: Path, superlink: int
) -> None:
    honest, _ = run_fleet(tmp_path / "honest", superlink, poisoned=False)
    poisoned, statuses = run_fleet(tmp_path / "poisoned", superlink, poisoned=True)

    # The gateway refused the absurd claims and accepted the one at the ceiling.
    assert 200 in statuses and any(s != 200 for s in statuses)
    # Every round of the poisoned run updated the model, which stayed finite.
    assert sorted(int(r) for r in poisoned["train"]) == list(range(1, ROUNDS + 1))
    accuracy = [r["accuracy"] for r in poisoned["rounds"]]
    assert all(math.isfinite(a) for a in accuracy)
    final = {"honest": honest["rounds"][-1], "poisoned": poisoned["rounds"][-1]}
    assert final["honest"]["accuracy"] > 0.8
    assert final["poisoned"]["accuracy"] >= final["honest"]["accuracy"] - 0.02, final
