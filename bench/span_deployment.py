"""A span job on a real Flower deployment, and how fast it recovers from a kill.

A ``flower-superlink`` and four ``flower-supernode`` processes on 127.0.0.1 (each
board's SuperNode with the span ClientApp, ``flowerbed.clients.span_app:app``,
and an emulated speed in its node_config, one of them 10x slower) run
:class:`~flowerbed.strategies.PipelineTraining` for three rounds of 12 steps,
replicating every 3 steps. Mid-round 2 one board is killed with its ClientApp
(SIGKILL of its process group: a board losing power); mid-round 3 another
board's ``flower-supernode`` process alone (its ClientApp must notice and end
itself). For each kill mode, :func:`kill_and_recover` measures from the kill

- ``delivered-s``: until a survivor's SuperNode received the next segment's
  message (the job found the loss, re-planned, and Flower delivered the plan:
  a SuperNode looks for messages every 3 s when it has none);
- ``failure-to-next-step-s``: until a survivor logged the next segment's start
  (right before its first step), and that member's set-up as it reported it
  (the fresh ``flwr-clientapp`` process's start with its imports, the
  rendezvous, the rest: :mod:`flowerbed.parallel.setup_time`).

Every process is started in its own session and stopped by its process group.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowerbed.bench.local_flower import (
    HOST,
    UserValue,
    connection_toml,
    free_port,
    program,
    superlink_command,
    supernode_command,
    write_pyproject,
)

CONNECTION = "bench"
KILL_MODES = ("board", "supernode")
SPEEDS = {"n0": 0.01, "n1": 0.01, "n2": 0.001, "n3": 0.01}
"""Emulated GFLOP/s of the four boards (``n2`` 10x slower)."""
VICTIMS = {"board": ("n1", 15), "supernode": ("n3", 27)}
"""Kill mode -> (board, the step whose replication triggers the kill): mid-round
2 (steps 12-23) and mid-round 3 (steps 24-35)."""
RUN_CONFIG: dict[str, int | float] = {
    "num-rounds": 3,
    "steps": 12,
    "replicate-every": 3,
}
FLOWER_ENV = {
    "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.2",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "OMP_NUM_THREADS": "1",
}
"""The processes' environment: a SuperExec that looks for ClientApp tasks every
0.2 s (docs/deploy-boards.md recommends it for span jobs), one thread each."""
SEGMENT_START = re.compile(
    r"segment (\d+): rank \d+ of \d+[^\n]*?set-up ([\d.]+) s: ClientApp start "
    r"([\d.]+) s, rendezvous ([\d.]+) s"
)
RECEIVED = "Receiving: train message"
ROUND_SETUP = re.compile(
    r"round (\d+) set-up ([\d.]+) s of the segment's ([\d.]+) s \((\d+)%; slowest "
    r"member: ([\d.]+) s to its first step\); next rounds (\d+) steps"
)
"""The strategy's log line of a completed round's set-up
(:mod:`flowerbed.strategies.span_sizing`)."""

SERVER_APP = '''
"""ServerApp of flowerbed's pipeline deployment bench."""

from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp

from flowerbed.models import build_sequential
from flowerbed.strategies import PipelineTraining
from flowerbed.strategies.pipeline_options import Pipelining
from flowerbed.strategies.span_options import SpanGroup

app = ServerApp()
ARGS = {"in_features": 64, "hidden": 48, "depth": 8}


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    strategy = PipelineTraining(
        fraction_evaluate=0.0,
        min_train_nodes=2,
        min_available_nodes=4,
        model="deep-mlp",
        model_args=ARGS,
        input_shape=(1, 8, 8),
        dataset="digits",
        steps_per_round=int(cfg["steps"]) or None,  # 0: sized by the strategy
        batch_size=16,
        pipelining=Pipelining(replicate_every=int(cfg["replicate-every"])),
        lr=0.1,
        group=SpanGroup(
            rendezvous_port=int(cfg["port"]),
            rendezvous_ports=10,
            join_timeout_s=90.0,
            timeout_s=10.0,
            reply_margin_s=10.0,
        ),
    )
    model = build_sequential("deep-mlp", ARGS, seed=0)
    strategy.start(
        grid, ArrayRecord(model.state_dict()), num_rounds=int(cfg["num-rounds"])
    )
'''


def write_app(root: Path) -> Path:
    """The Flower App folder of the bench's ServerApp (and the span ClientApp)."""
    app = root / "app"
    (app / "fbspanbench").mkdir(parents=True, exist_ok=True)
    write_pyproject(
        app,
        "fbspanbench",
        "fbspanbench.server:app",
        "flowerbed.clients.span_app:app",
        {**RUN_CONFIG, "port": 29500},
    )
    (app / "fbspanbench" / "__init__.py").write_text("")
    (app / "fbspanbench" / "server.py").write_text(SERVER_APP)
    return app


@dataclass
class Proc:
    """A started process (its own session) and its log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def kill_group(self) -> None:
        """SIGKILL the process's group: it and everything it started."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait()


class Deployment:
    """A SuperLink and SuperNodes on 127.0.0.1 under ``workdir``; every process
    group is killed on exit."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.home = workdir / "flwr-home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, **FLOWER_ENV, "FLWR_HOME": str(self.home)}
        self.env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}" + (
            os.environ.get("PATH", "")
        )
        self.procs: list[Proc] = []
        self.port = 0

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in reversed(self.procs):
            proc.kill_group()

    def start(self, name: str, args: Sequence[str]) -> Proc:
        path = self.workdir / f"{name}.log"
        with open(path, "wb") as fh:
            popen = subprocess.Popen(
                list(args),
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )
        proc = Proc(name, popen, path)
        self.procs.append(proc)
        return proc

    def superlink(self, timeout: float = 60.0) -> None:
        self.port = free_port()
        (self.home / "config.toml").write_text(connection_toml(CONNECTION, self.port))
        link = self.start("superlink", superlink_command(self.port))
        deadline = time.monotonic() + timeout
        while True:
            try:
                url = f"http://{HOST}:{self.port}/health"
                with urllib.request.urlopen(url, timeout=1.0) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if link.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"flower-superlink did not start:\n{link.log()}")
            time.sleep(0.2)

    def supernode(self, name: str, node_config: Mapping[str, UserValue]) -> Proc:
        return self.start(name, supernode_command(self.port, node_config))


def wait_for(proc: Proc, pattern: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not re.search(pattern, proc.log()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{proc.name}: no {pattern!r} in {timeout} s")
        time.sleep(0.05)


def segments(proc: Proc) -> list[tuple[int, float, float, float]]:
    """(segment, set-up s, ClientApp start s, rendezvous s) per segment start:
    the set-up is the member's whole, from its process's start to the first step."""
    return [
        (int(m[1]), float(m[2]), float(m[3]), float(m[4]))
        for m in SEGMENT_START.finditer(proc.log())
    ]


def round_setups(log: str) -> dict[str, dict[str, float]]:
    """Each completed round's set-up from the ServerApp's log: seconds, the
    segment's wall seconds, the share, the slowest member's own set-up."""
    return {
        m[1]: {
            "setup-s": float(m[2]),
            "segment-s": float(m[3]),
            "setup-share": float(m[2]) / float(m[3]) if float(m[3]) > 0 else 0.0,
            "member-setup-s": float(m[5]),
            "next-steps": int(m[6]),
        }
        for m in ROUND_SETUP.finditer(log)
    }


def kill_and_recover(
    victim: Proc, mode: str, survivors: Sequence[Proc], timeout: float = 120.0
) -> dict[str, Any]:
    """Kill ``victim`` the ``mode`` way; time the survivors' next segment."""
    after = max((s[0] for s in segments(victim)), default=0)
    received = {p.name: p.log().count(RECEIVED) for p in survivors}
    if mode == "board":
        victim.kill_group()
    else:
        os.kill(victim.popen.pid, signal.SIGKILL)
        victim.popen.wait()
    killed = time.monotonic()
    delivered = None
    deadline = killed + timeout
    while time.monotonic() < deadline:
        now = time.monotonic() - killed
        if delivered is None and any(
            p.log().count(RECEIVED) > received[p.name] for p in survivors
        ):
            delivered = now
        later = [s for p in survivors for s in segments(p) if s[0] > after]
        if later:
            first = min(later, key=lambda s: s[1])
            return {
                "delivered-s": delivered if delivered is not None else now,
                "failure-to-next-step-s": now,
                "member-setup-s": first[1],
                "clientapp-start-s": first[2],
                "rendezvous-s": first[3],
            }
        time.sleep(0.05)
    raise TimeoutError(f"{mode} kill: no segment after {after} in {timeout} s")


def run(
    workdir: Path, run_timeout: float = 600.0, *, sized: bool = False
) -> dict[str, Any]:
    """The deployment, both kills, the job to its end (module doc). ``sized``:
    instead, two rounds without kills and with segments sized by the strategy
    (``steps_per_round=None``, set-up at most 10% of a round)."""
    workdir.mkdir(parents=True, exist_ok=True)
    app = write_app(workdir)
    out: dict[str, Any] = {"speeds": dict(SPEEDS), "kills": {}}
    with Deployment(workdir) as dep:
        dep.superlink()
        nodes = {
            name: dep.supernode(
                name,
                {
                    "address": HOST,
                    "device": name,
                    "emulate-gflops": gflops,
                    "state-dir": str(workdir / "state" / name),
                },
            )
            for name, gflops in SPEEDS.items()
        }
        for node in nodes.values():
            wait_for(node, r"SuperNode ID: \d+", 60.0)
        settings = {**RUN_CONFIG, "port": free_port()}
        if sized:
            settings.update({"num-rounds": 2, "steps": 0})
        config = " ".join(f"{k}={v}" for k, v in settings.items())
        began = time.monotonic()
        cli = dep.start(
            "run",
            [
                program("flwr"),
                "run",
                str(app),
                CONNECTION,
                "--stream",
                "--run-config",
                config,
            ],
        )
        survivors = list(nodes.values())
        for mode in () if sized else KILL_MODES:
            name, step = VICTIMS[mode]
            victim = nodes[name]
            wait_for(victim, rf"replicated at step {step}\b", run_timeout)
            survivors = [p for p in survivors if p is not victim]
            out["kills"][mode] = kill_and_recover(victim, mode, survivors)
        cli.popen.wait(timeout=max(1.0, began + run_timeout - time.monotonic()))
        out["job-wall-s"] = time.monotonic() - began
        out["finished"] = cli.popen.returncode == 0
        out["found-gone"] = cli.log().count("found it gone")
        out["rounds"] = round_setups(cli.log())
    return out
