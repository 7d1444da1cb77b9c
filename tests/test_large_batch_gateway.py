"""Server-side large-batch rounds through the phone gateway, with JVM phones.

The bridge's end-to-end harness (tests/test_bridge_e2e.py: a real SuperLink, the
gateway, the JVM phone) runs the demo ServerApp with ``strategy =
"large-batch"`` (:class:`LargeBatchRounds`): every round each phone trains one
SGD step on its share of one large batch, the server applies momentum SGD to
the examples-weighted pseudo-gradient.
"""

from __future__ import annotations

import json

import pytest
from flowerbed.clients.bridge.procs import free_port, start_gateway
from test_bridge_e2e import (  # the bridge e2e harness
    DEMO_CONFIG,
    _phone,
    _phone_jar,
    phone_files,
    procs,
    start_demo_run,
    superlink,
)

pytestmark = [pytest.mark.slow, pytest.mark.java]
PHONES = 3
__all__ = ["procs", "superlink"]  # fixtures used by name


def test_jvm_phones_train_one_large_batch_per_round(tmp_path, procs, superlink):
    jar = _phone_jar()
    data, tokens = phone_files(tmp_path, PHONES)
    config = {
        **DEMO_CONFIG,
        "num-rounds": 5,
        "strategy": "large-batch",
        "min-nodes": PHONES,
        "wait-nodes": PHONES,
        "deadline-s": 20.0,
    }
    run, results = start_demo_run(tmp_path, config, superlink)
    run_log = tmp_path / "flwr-run.log"
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
