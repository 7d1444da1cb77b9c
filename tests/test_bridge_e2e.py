"""End to end: a real SuperLink, the gateway and four JVM phones train digits.

Both tests share one local SuperLink (module fixture).

A ServerApp (``flowerbed.clients.bridge.demo_app``, DeadlineFedAvg with a 5 s
deadline) runs in deployment mode through ``flwr run`` against a local SuperLink.
Phone p3 trains slowly and is killed during its first task: that round must close
at the deadline without it, and after p3 restarts (same token) it must come back as
the same Flower node and be used again. The other phones take ~2 s a task
(``FAST_MS`` per step) so that the rounds after p3's task expires last long enough
for the restarted JVM to be sampled: at full speed they took ~0.7 s each and p3
came back in time for the last round only (one CI run it missed it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
from flowerbed.clients.bridge.demo_app import write_phone_csvs
from flowerbed.clients.bridge.gateway import Gateway, GatewaySettings
from flowerbed.clients.bridge.procs import (
    free_port,
    start_gateway,
    start_superlink,
    stop_processes,
)
from flowerbed.clients.bridge.relay import SuperLinkConnector
from flowerbed.clients.bridge.server import GatewayServer
from flowerbed.clients.bridge.simphone import SimPhone
from flowerbed.strategies.round_metrics import ROUND_PARTICIPANTS, ROUND_STRAGGLERS
from procs import UserValue, start_flwr_run, write_demo_app

ROOT = Path(__file__).resolve().parents[1]
JAR = Path(
    os.environ.get(
        "FLOWERBED_PHONE_JAR",
        ROOT / "android_client" / "core" / "build" / "flowerbed-phone.jar",
    )
)
"""The JVM phone; FLOWERBED_PHONE_JAR points at a prebuilt one."""
PHONES = 4
DEADLINE_S = 5.0
ROUNDS = 6
FAST_MS = 100
"""Milliseconds per local step of the phones that are not killed (20 steps)."""
DEMO_CONFIG: dict[str, UserValue] = {
    "num-rounds": ROUNDS,
    "strategy": "deadline",
    "min-nodes": 3,
    "wait-nodes": PHONES,
    "deadline-s": DEADLINE_S,
    "round-timeout-s": 30.0,
    "local-steps": 20,
    "lr": 0.5,
}
"""The demo app's run config in this test (``results-path`` is each run's own)."""

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def superlink(tmp_path_factory):
    """Port of a local insecure SuperLink, stopped by pid after the module."""
    port = free_port()
    log = tmp_path_factory.mktemp("superlink") / "superlink.log"
    proc = start_superlink(port, log)
    try:
        yield port
    finally:
        stop_processes([proc])


def _phone_jar() -> Path:
    if shutil.which("java") is None:
        pytest.skip("no JDK found (java not on PATH): JVM phones cannot run")
    if not JAR.is_file():
        subprocess.run(
            ["bash", str(ROOT / "android_client" / "core" / "run-tests.sh")],
            cwd=ROOT,
            check=True,
            timeout=600,
        )
    assert JAR.is_file(), f"run-tests.sh did not build {JAR}"
    return JAR


@pytest.fixture()
def procs():
    """Processes started by the test; all stopped by pid, even on failure."""
    started: list[subprocess.Popen[bytes]] = []
    try:
        yield started
    finally:
        stop_processes(started, timeout=5)


def _phone(
    jar: Path, gateway: int, i: int, data: Path, log: Path, slow_ms: int = 0
) -> subprocess.Popen[bytes]:
    cmd = [
        "java",
        "-cp",
        str(jar),
        "org.flowerbed.phone.PhoneMain",
        "--gateway",
        f"http://127.0.0.1:{gateway}",
        "--token",
        f"e2e-token-phone-{i}-0000",
        "--data",
        str(data / f"phone-{i}.csv"),
        "--poll-wait",
        "5",
        "--slow-ms",
        str(slow_ms),
        "--seed",
        str(i),
    ]
    with open(log, "ab") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)


def _wait_for_line(path: Path, pattern: str, timeout: float) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and (m := re.search(pattern, path.read_text())):
            return m
        time.sleep(0.2)
    raise AssertionError(f"no line matching {pattern!r} in {path} within {timeout} s")


def phone_files(root: Path, phones: int) -> tuple[Path, Path]:
    """Digits CSVs of ``phones`` phones in ``root/data`` and their gateway tokens
    (``e2e-token-phone-<i>-0000``, phone ``p<i>``) in ``root/tokens.txt``."""
    data = root / "data"
    write_phone_csvs(data, phones)
    tokens = root / "tokens.txt"
    tokens.write_text(
        "".join(f"e2e-token-phone-{i}-0000 p{i}\n" for i in range(phones))
    )
    return data, tokens


def start_demo_run(
    root: Path, config: Mapping[str, UserValue], superlink_port: int
) -> tuple[subprocess.Popen[bytes], Path]:
    """``flwr run`` of the demo app with run config ``config`` against the local
    SuperLink, its output in ``root/flwr-run.log``: the process and the results
    file the ServerApp writes."""
    results = root / "results.json"
    app = write_demo_app(root, "bridge-e2e", {**config, "results-path": str(results)})
    return start_flwr_run(app, superlink_port, root / "flwr-run.log"), results


@pytest.mark.java
def test_phones_train_digits_and_a_killed_phone_is_a_straggler_then_rejoins(
    tmp_path, procs, superlink
):
    jar = _phone_jar()
    data, tokens = phone_files(tmp_path, PHONES)
    link_port, gw_port = superlink, free_port()
    run, results = start_demo_run(tmp_path, DEMO_CONFIG, link_port)
    run_log = tmp_path / "flwr-run.log"
    procs.append(run)

    gw_log = tmp_path / "gateway.log"
    procs.append(
        start_gateway(
            link_port,
            gw_port,
            tokens,
            gw_log,
            extra=(
                "--pull-interval-s=0.5",
                "--offline-after-s=4",
                "--deadline-slack-s=2",
                "--max-poll-s=5",
            ),
        )
    )
    for i in range(PHONES - 1):
        procs.append(
            _phone(jar, gw_port, i, data, tmp_path / f"p{i}.log", slow_ms=FAST_MS)
        )
    p3_log = tmp_path / "p3.log"
    victim = _phone(jar, gw_port, 3, data, p3_log, slow_ms=400)
    procs.append(victim)

    # Kill p3 while it trains its first task (20 steps x 400 ms > deadline).
    try:
        first = _wait_for_line(gw_log, r"phone p3: train task (\w+)", 120)
    except AssertionError as err:
        tails = {p.name: p.read_text()[-600:] for p in sorted(tmp_path.glob("*.log"))}
        raise AssertionError(f"{err}; log tails: {tails}") from None
    time.sleep(1.0)
    victim.kill()
    victim.wait()
    _wait_for_line(gw_log, rf"phone p3: task {first.group(1)} expired", 30)
    procs.append(_phone(jar, gw_port, 3, data, p3_log, slow_ms=FAST_MS))

    assert run.wait(timeout=300) == 0, run_log.read_text()[-3000:]
    if not results.exists():
        pytest.fail(f"no results; ServerApp log:\n{run_log.read_text()[-3000:]}")
    outcome = json.loads(results.read_text())
    gw_text = gw_log.read_text()

    # Every phone joined: its own log shows the hello answer it understood.
    for i in range(PHONES):
        phone_log = (tmp_path / f"p{i}.log").read_text()
        assert "hello node_id=" in phone_log, f"p{i} never joined: {phone_log[-800:]}"

    # p3 kept its node id across the kill: every hello maps it to one node.
    p3_nodes = set(re.findall(r"hello from phone p3 \(node (\d+)\)", gw_text))
    assert len(p3_nodes) == 1, gw_text[-3000:]
    # Its first task expired unanswered; the round closed at the deadline with 3.
    train = outcome["train"]
    killed_round = int(re.search(rf"{first.group(1)} \(round (\d+)", gw_text)[1])
    assert train[str(killed_round)][ROUND_PARTICIPANTS] == 3
    assert train[str(killed_round)][ROUND_STRAGGLERS] >= 1
    # After its restart p3 completed tasks again and a later round used all four.
    after_restart = gw_text.split(f"task {first.group(1)} expired", 1)[1]
    assert re.search(r"phone p3: task \w+ accepted", after_restart)
    assert any(m[ROUND_PARTICIPANTS] == PHONES for r, m in train.items() if int(r) > 1)
    # The global model improved: round 0 is an untrained 10-class model.
    accuracy = [r["accuracy"] for r in outcome["rounds"]]
    assert len(accuracy) == ROUNDS + 1
    assert accuracy[-1] > accuracy[0] + 0.5


def test_node_ids_survive_a_gateway_restart_with_a_state_dir(tmp_path, superlink):
    token = "restart-test-token-0000"
    node_ids = []
    for _ in range(2):  # the same gateway configuration, started twice
        connector = SuperLinkConnector(
            f"127.0.0.1:{superlink}", insecure=True, state_dir=tmp_path / "state"
        )
        gateway = Gateway({token: "survivor"}, connector, GatewaySettings())
        server = GatewayServer(gateway, "127.0.0.1", 0).start()
        try:
            phone = SimPhone(server.url, token)
            node_ids.append(phone.hello()["node_id"])
            phone.close()
        finally:
            server.stop()
    assert node_ids[0] == node_ids[1]
    assert (tmp_path / "state" / "survivor.pem").stat().st_mode & 0o777 == 0o600


@pytest.mark.java
def test_a_jvm_phone_enrolled_with_a_pin_trains_over_tls_and_refuses_another_key(
    tmp_path, procs
):
    """Issue 18, TLS: a gateway with a self-signed certificate, a phone enrolled with
    `flowerbed bridge enroll --cert` (the URI pins the certificate's key): the phone
    trains one task over HTTPS without installing the certificate; a phone pinned
    to another key never connects."""
    from bridge_fakes import TOKENS, FakeFlower, self_signed
    from flowerbed.clients.bridge.enroll import enrolment_uri, spki_pin
    from flwr.supercore.task_identity import TaskIdentity

    jar = _phone_jar()
    write_phone_csvs(tmp_path, 1)
    cert, key = self_signed(tmp_path)
    flower = FakeFlower()
    gateway = Gateway(TOKENS, flower, GatewaySettings(pull_interval_s=0.05))
    server = GatewayServer(gateway, "127.0.0.1", 0, certfile=cert, keyfile=key).start()
    token = next(t for t, n in TOKENS.items() if n == "alice")
    pin = spki_pin(Path(cert).read_bytes())
    (tmp_path / "other").mkdir()
    other = spki_pin(Path(self_signed(tmp_path / "other")[0]).read_bytes())

    def phone(uri: str, log: Path) -> subprocess.Popen[bytes]:
        cmd = ["java", "-cp", str(jar), "org.flowerbed.phone.PhoneMain", "--enrol"]
        cmd += [uri, "--data", str(tmp_path / "phone-0.csv"), "--max-tasks", "1"]
        with open(log, "wb") as fh:
            return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 7, 0
    try:
        good = phone(
            enrolment_uri(server.url, "alice", token, pin), tmp_path / "ok.log"
        )
        procs.append(good)
        deadline = time.monotonic() + 60
        while gateway.phone("alice").node_id is None and time.monotonic() < deadline:
            time.sleep(0.1)
        node = gateway.phone("alice").node_id
        assert node is not None, (tmp_path / "ok.log").read_text()
        # The digits demo's softmax layout: 64 features, 10 classes.
        import numpy as np
        from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict

        content = RecordDict(
            {
                "arrays": ArrayRecord(
                    {
                        "fc.weight": Array(np.zeros((10, 64), np.float32)),
                        "fc.bias": Array(np.zeros(10, np.float32)),
                    }
                ),
                "config": ConfigRecord({"local-steps": 5, "lr": 0.1}),
            }
        )
        msg = Message(content, dst_node_id=node, message_type="train", ttl=60)
        msg.metadata.__dict__["_message_id"] = "tls-train"
        flower.inbox[node].put(msg)
        reply = flower.reply(timeout=60)
        assert reply.has_content(), reply.error.reason if reply.has_error() else ""
        assert good.wait(timeout=30) == 0
        assert "status=accepted" in (tmp_path / "ok.log").read_text()

        bad = phone(
            enrolment_uri(server.url, "alice", token, other), tmp_path / "no.log"
        )
        procs.append(bad)
        assert bad.wait(timeout=60) == 3  # refused at once, not retried
        refused = (tmp_path / "no.log").read_text()
        assert "refused status=-2" in refused and "is not the enrolled" in refused
        assert "hello node_id" not in refused
    finally:
        TaskIdentity._task_id = TaskIdentity._run_id = TaskIdentity._node_id = None
        server.stop()
