"""Server-side large-batch rounds through the phone gateway, with JVM phones.

The bridge's end-to-end harness (tests/test_bridge_e2e.py: a real SuperLink, the
gateway, the JVM phone) runs the demo ServerApp with ``strategy =
"large-batch"`` (:class:`LargeBatchRounds`): every round each phone trains one
SGD step on its share of one large batch, the server applies momentum SGD to
the examples-weighted pseudo-gradient.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from flowerbed.clients.bridge.demo_app import write_phone_csvs
from flowerbed.clients.bridge.procs import free_port, start_gateway
from test_bridge_e2e import (  # the bridge e2e harness
    APP_TOML,
    FLWR_CONFIG,
    _phone,
    _phone_jar,
    procs,
    superlink,
)

pytestmark = [pytest.mark.slow, pytest.mark.java]
PHONES = 3
__all__ = ["procs", "superlink"]  # fixtures used by name


def test_jvm_phones_train_one_large_batch_per_round(tmp_path, procs, superlink):
    jar = _phone_jar()
    data = tmp_path / "data"
    write_phone_csvs(data, PHONES)
    tokens = tmp_path / "tokens.txt"
    tokens.write_text(
        "".join(f"e2e-token-phone-{i}-0000 p{i}\n" for i in range(PHONES))
    )
    app = tmp_path / "app"
    app.mkdir()
    results = tmp_path / "results.json"
    toml = APP_TOML.format(phones=PHONES, deadline=20.0, results=results, rounds=5)
    toml = toml.replace('strategy = "deadline"', 'strategy = "large-batch"')
    toml = toml.replace("min-nodes = 3", f"min-nodes = {PHONES}")
    (app / "pyproject.toml").write_text(toml)
    home = tmp_path / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(FLWR_CONFIG.format(port=superlink))
    run_log = tmp_path / "flwr-run.log"
    with open(run_log, "wb") as fh:
        run = subprocess.Popen(
            ["flwr", "run", str(app), "e2e", "--stream"],
            env={**os.environ, "FLWR_HOME": str(home)},
            stdout=fh,
            stderr=subprocess.STDOUT,
        )
    procs.append(run)
    gw_port = free_port()
    procs.append(
        start_gateway(
            superlink,
            gw_port,
            tokens,
            tmp_path / "gateway.log",
            extra=("--pull-interval-s=0.5", "--max-poll-s=5"),
        )
    )
    for i in range(PHONES):
        procs.append(_phone(jar, gw_port, i, data, tmp_path / f"p{i}.log"))
    assert run.wait(timeout=300) == 0, run_log.read_text()[-3000:]
    assert results.exists(), run_log.read_text()[-3000:]
    outcome = json.loads(results.read_text())
    assert outcome["strategy"] == "large-batch"
    # 16 samples per phone: one step each, a batch of 48 per round
    for metrics in outcome["train"].values():
        assert metrics["large-batch"] == 16 * PHONES
        assert metrics["participants"] == PHONES
        assert metrics["server-lr"] == pytest.approx(0.5)
    accuracy = [r["accuracy"] for r in outcome["rounds"]]
    assert accuracy[-1] > accuracy[0] + 0.3, accuracy
    # every phone trained the share it was given: one step of 16 samples
    for i in range(PHONES):
        log = (tmp_path / f"p{i}.log").read_text()
        assert "num-steps=1 num-examples=16" in log, log[-800:]
