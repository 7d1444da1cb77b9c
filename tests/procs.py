"""A real Flower deployment on 127.0.0.1 for tests: SuperLink, SuperNodes, runs.

Starts the installed ``flower-superlink`` and ``flower-supernode`` programs (the
current Python environment's), each with free ports, its own log file and, for
SuperNodes, its own ``node_config``, all sharing a temporary ``FLWR_HOME`` whose
``config.toml`` names the SuperLink connection. In flwr 1.41 the SuperLink serves
the Fleet, Control and Runtime APIs on one ``--host``/``--port``, and each SuperNode
opens its own Runtime API for its ClientApps on ``--port`` (the former
``--clientappio-api-address``), which must differ between SuperNodes on one host.
Runs are submitted with ``flwr run <app_dir> <connection> --stream`` with
``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1``, so the ServerApp and ClientApps
run in this environment (nothing is installed, nothing downloaded). Telemetry and
update checks are off.

Every process is stopped by its pid: SIGTERM, then SIGKILL after a grace period,
together with every descendant it spawned (Flower's SuperExec and its
``flwr-serverapp``/``flwr-clientapp`` processes, which Flower detaches into their
own sessions). Descendants are found by a variable each start puts into the
environment (:data:`TAG_VARIABLE`), which children inherit and keep when they are
orphaned. :class:`Federation` does this on exit, also when the test fails.

Typical use (a pytest test; ``tmp_path`` is pytest's; pyproject.toml puts
``tests/`` on pytest's ``pythonpath``, so ``procs`` imports as a module)::

    from procs import Federation

    def test_something(tmp_path):
        with Federation(tmp_path) as fed:
            fed.start_superlink()
            nodes = [fed.add_supernode({"dataset-path": str(p)}) for p in paths]
            fed.wait_for_nodes(nodes)
            run = fed.run(app_dir, run_config={"num-rounds": 3}, timeout=120)
            assert run.status == "finished:completed", run.log

Or the fixture :func:`federation` (``from procs import federation`` in a test
module makes it available). Mid-run actions: ``handle = fed.submit(app_dir)``,
then for example ``nodes[0].kill()`` and ``fed.restart_supernode(nodes[0])``, then
``handle.wait(timeout)``.

Timing facts of flwr 1.41 worth knowing when writing such tests: a SuperNode polls
for work every 3 s when idle and starts a fresh ``flwr-clientapp`` process per
message (imports included); a SuperNode killed with SIGKILL stays "online" at the
SuperLink for up to 2 heartbeats (60 s; then its pending messages get a "Node
Unavailable" error reply), while one stopped with SIGTERM deactivates itself at
once; a restarted SuperNode registers under a new node id. The ServerApp's output
is in the run's log (:attr:`RunResult.log`), each ClientApp's in its SuperNode's
log (:meth:`Process.log`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import pytest
from flowerbed.bench.local_flower import (
    HOST,
    UserValue,
    connection_toml,
    format_user_config,
    free_port,
    program,
    superlink_command,
    supernode_command,
    write_pyproject,
)

CONNECTION = "flowerbed-test"
"""Name of the SuperLink connection written into the temporary config.toml."""
STOP_GRACE_S = 5.0
"""Seconds a process gets to exit after SIGTERM before SIGKILL."""
TAG_VARIABLE = "FLOWERBED_TEST_PROCESS"
"""Environment variable that marks each started process and all its descendants."""
NODE_ID_PATTERN = re.compile(r"SuperNode ID: (\d+)")
TEST_APP = "flowerbed test app"
"""The description in the pyproject.toml of the apps written here."""
RUN_ID_PATTERN = re.compile(r"Successfully started run (\d+)")


def write_app(
    root: Path,
    package: str,
    server_source: str,
    config: Mapping[str, UserValue],
    clientapp: str = "flowerbed.clients.span_app:app",
) -> Path:
    """A Flower App folder under ``root``: ``pyproject.toml`` and ``package``.

    The ServerApp is ``server_source`` (module ``<package>.server``, object
    ``app``), the ClientApp ``clientapp``; ``config`` becomes the run config's
    defaults (``[tool.flwr.app.config]``). Returns the folder, for
    :meth:`Federation.submit`.
    """
    app_dir = root / "app"
    (app_dir / package).mkdir(parents=True)
    write_pyproject(
        app_dir, package, f"{package}.server:app", clientapp, config, TEST_APP
    )
    (app_dir / package / "__init__.py").write_text("")
    (app_dir / package / "server.py").write_text(server_source)
    return app_dir


def start_flwr_run(
    app_dir: Path, superlink_port: int, log: Path
) -> subprocess.Popen[bytes]:
    """``flwr run <app_dir> local --stream`` against the SuperLink on
    ``127.0.0.1:superlink_port`` (connection ``local``, insecure, in the
    ``FLWR_HOME`` ``flwr-home`` beside ``app_dir``), its output to ``log``."""
    home = app_dir.parent / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text(connection_toml("local", superlink_port))
    with open(log, "wb") as out:
        return subprocess.Popen(
            ["flwr", "run", str(app_dir), "local", "--stream"],
            env={**os.environ, "FLWR_HOME": str(home)},
            stdout=out,
            stderr=subprocess.STDOUT,
        )


# --------------------------------------------------------------------------------------
# Process trees (Linux /proc)
# --------------------------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process, else None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None  # a zombie: already dead, only waiting to be reaped
    return int(fields[1]), int(fields[19])


def alive(pid: int) -> bool:
    """Whether a process with this pid exists and is not a zombie."""
    return _stat(pid) is not None


def _alive(pid: int, start: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[1] == start


def _signal(pid: int, start: int, sig: int) -> None:
    if _alive(pid, start):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def proc_files(name: str) -> Iterator[tuple[int, bytes]]:
    """``(pid, bytes of /proc/<pid>/<name>)`` of each process whose file could be
    read (a process that ends meanwhile, or of another user, is passed over)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            content = (entry / name).read_bytes()
        except OSError:
            continue
        yield int(entry.name), content


def tagged(tag: str) -> dict[int, int]:
    """Live processes whose environment holds ``FLOWERBED_TEST_PROCESS=<tag>``.

    Returns ``{pid: start time}``. Children inherit the environment, and keep it
    when their parent dies and they are re-parented, so this finds every process a
    start spawned, orphans included.
    """
    marker = f"{TAG_VARIABLE}={tag}".encode()
    found: dict[int, int] = {}
    for pid, environ in proc_files("environ"):
        if marker in environ.split(b"\0"):
            stat = _stat(pid)
            if stat is not None:
                found[pid] = stat[1]
    return found


def _signal_tagged(tag: str, sig: int, seen: dict[int, int]) -> bool:
    """Signal the tag's live processes; add them to ``seen``; True if any is left.

    A process stays "left" until it is gone from ``/proc`` or a zombie: a dying
    process has already lost its environment, so the tag alone would miss it.
    """
    for pid, start in tagged(tag).items():
        seen[pid] = start
        _signal(pid, start, sig)
    return any(_alive(pid, start) for pid, start in seen.items())


def _wait_gone(tag: str, seen: dict[int, int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _signal_tagged(tag, 0, seen):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def stop_tree(
    root: subprocess.Popen[bytes], tag: str, grace_s: float = STOP_GRACE_S
) -> None:
    """Stop ``root`` and every process it spawned, by pid: SIGTERM, then SIGKILL.

    The root gets SIGTERM first (a SuperNode then deregisters, a SuperLink stops its
    SuperExec); whatever still carries the root's tag afterwards gets SIGTERM, and
    after ``grace_s`` SIGKILL.
    """
    seen = tagged(tag)
    if root.poll() is None:
        root.send_signal(signal.SIGTERM)
    try:
        root.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        root.kill()
        root.wait()
    if _signal_tagged(tag, signal.SIGTERM, seen) and not _wait_gone(tag, seen, grace_s):
        kill_tree(root, tag)


def kill_tree(root: subprocess.Popen[bytes], tag: str, timeout: float = 10.0) -> None:
    """SIGKILL ``root`` and every process it spawned: a board losing power.

    Returns once none of them is alive; raises ``RuntimeError`` if one survives
    ``timeout`` seconds of SIGKILLs.
    """
    seen: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while True:
        if root.poll() is None:
            root.kill()
        if not _signal_tagged(tag, signal.SIGKILL, seen) and root.poll() is not None:
            break
        if time.monotonic() > deadline:
            left = [pid for pid, start in seen.items() if _alive(pid, start)]
            raise RuntimeError(f"processes {left} survived SIGKILL")
        time.sleep(0.05)
    root.wait()


# --------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------


@dataclass
class Process:
    """One started program, its log file, and how to stop it."""

    name: str
    args: list[str]
    log_path: Path
    env: dict[str, str]
    popen: subprocess.Popen[bytes] | None = None
    tag: str = ""
    """Value of :data:`TAG_VARIABLE` in this launch's environment (new per start)."""

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.tag = f"{self.name}-{uuid.uuid4().hex}"
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                self.args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**self.env, TAG_VARIABLE: self.tag},
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        if self.popen is None:
            raise RuntimeError(f"{self.name} was never started")
        return self.popen.pid

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM, then SIGKILL, this process and its descendants."""
        if self.popen is not None:
            stop_tree(self.popen, self.tag, grace_s)

    def kill(self) -> None:
        """SIGKILL this process and its descendants (a crash, no goodbye)."""
        if self.popen is not None:
            kill_tree(self.popen, self.tag)

    def log(self) -> str:
        """Everything the process wrote so far (stdout and stderr)."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_for_log(
        self, pattern: str | re.Pattern[str], timeout: float, start: int = 0
    ) -> re.Match[str]:
        """Wait until the log (from character ``start``) matches ``pattern``."""
        regex = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        while True:
            match = regex.search(self.log(), start)
            if match:
                return match
            if not self.running:
                raise RuntimeError(
                    f"{self.name} exited (code {self.popen and self.popen.poll()}) "
                    f"before its log matched {regex.pattern!r}:\n{self.log()[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.name}: no {regex.pattern!r} in its log after {timeout} s:"
                    f"\n{self.log()[-3000:]}"
                )
            time.sleep(0.2)


@dataclass
class SuperNode(Process):
    """A SuperNode process; ``node_id`` is known once it has connected."""

    node_config: dict[str, UserValue] = field(default_factory=dict)
    node_id: int | None = None
    log_mark: int = 0
    """Log offset where the current incarnation's output starts."""
    past_node_ids: list[int] = field(default_factory=list)
    """Node ids of earlier incarnations (see :meth:`Federation.restart_supernode`)."""


@dataclass
class RunResult:
    """A finished run: its id, final status (``finished:completed`` ...) and log."""

    run_id: int
    status: str
    log: str
    seconds: float


class RunHandle:
    """A run submitted with ``flwr run --stream``, still streaming its log."""

    def __init__(self, fed: Federation, cli: Process) -> None:
        self._fed = fed
        self._cli = cli
        self.log_path = cli.log_path
        self.started = time.monotonic()

    def log(self) -> str:
        return self._cli.log()

    @property
    def run_id(self) -> int | None:
        match = RUN_ID_PATTERN.search(self.log())
        return int(match.group(1)) if match else None

    def wait(self, timeout: float) -> RunResult:
        """Wait for the run to end; on timeout stop it and raise ``TimeoutError``."""
        assert self._cli.popen is not None
        try:
            self._cli.popen.wait(
                timeout=max(0.0, self.started + timeout - time.monotonic())
            )
        except subprocess.TimeoutExpired:
            self._cli.stop()
            if self.run_id is not None:
                self._fed.flwr("stop", str(self.run_id), CONNECTION, check=False)
            tail = self.log()[-4000:]
            raise TimeoutError(
                f"run did not finish within {timeout} s; log tail:\n{tail}"
            ) from None
        run_id = self.run_id
        if run_id is None:
            raise RuntimeError(f"flwr run did not start a run:\n{self.log()[-4000:]}")
        return RunResult(
            run_id,
            self._fed.run_status(run_id),
            self.log(),
            time.monotonic() - self.started,
        )


# --------------------------------------------------------------------------------------
# The federation
# --------------------------------------------------------------------------------------


class Federation:
    """A SuperLink and SuperNodes on 127.0.0.1, stopped by pid on exit.

    Parameters
    ----------
    workdir : Path
        Folder for ``FLWR_HOME`` (``workdir/flwr-home``) and the logs
        (``workdir/logs/<name>.log``).
    env : Mapping[str, str], optional
        Extra environment variables for every process.
    """

    def __init__(self, workdir: Path, env: Mapping[str, str] | None = None) -> None:
        self.workdir = Path(workdir)
        self.home = self.workdir / "flwr-home"
        self.logs = self.workdir / "logs"
        self.home.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ)
        self.env.update(
            {
                "FLWR_HOME": str(self.home),
                "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                "FLWR_TELEMETRY_ENABLED": "0",
                "FLWR_DISABLE_UPDATE_CHECK": "1",
                # Several SuperNodes share few cores: one thread per ClientApp
                # avoids oversubscribing them (pass env= to change it).
                "OMP_NUM_THREADS": "1",
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}"
                + os.environ.get("PATH", ""),
            }
        )
        self.env.update(env or {})
        self.superlink: Process | None = None
        self.port: int | None = None
        self.supernodes: list[SuperNode] = []
        self._everything: list[Process] = []
        self._runs: list[Process] = []

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Federation:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Stop every process this federation started, SuperNodes first."""
        for cli in self._runs:
            cli.stop()
        for proc in reversed(self._everything):
            proc.stop()

    # ------------------------------------------------------------------ SuperLink
    def start_superlink(
        self, timeout: float = 60.0, simulated_supernodes: int | None = None
    ) -> Process:
        """Start ``flower-superlink --insecure`` and wait for its /health answer.

        With ``simulated_supernodes`` the SuperLink runs Flower's simulation runtime
        (Ray) with that many simulated SuperNodes instead of waiting for real ones.
        """
        if self.superlink is not None:
            raise RuntimeError("this federation already has a SuperLink")
        self.port = free_port()
        args = superlink_command(self.port)
        if simulated_supernodes is not None:
            args += ["--simulation", "--isolation", "subprocess"]
        proc = Process("superlink", args, self.logs / "superlink.log", self.env)
        self._write_connection(simulated_supernodes)
        proc.start()
        self._everything.append(proc)
        self.superlink = proc
        deadline = time.monotonic() + timeout
        url = f"http://{HOST}:{self.port}/health"
        while True:
            try:
                with urllib.request.urlopen(url, timeout=1.0) as answer:
                    if answer.status == 200:
                        return proc
            except (urllib.error.URLError, OSError):
                pass
            if not proc.running:
                raise RuntimeError(f"flower-superlink exited:\n{proc.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"SuperLink not healthy after {timeout} s")
            time.sleep(0.2)

    def _write_connection(self, simulated_supernodes: int | None = None) -> None:
        options = (
            f"options.num-supernodes = {simulated_supernodes}\n"
            if simulated_supernodes is not None
            else ""
        )
        (self.home / "config.toml").write_text(
            connection_toml(CONNECTION, self.port, options), encoding="utf-8"
        )

    # ------------------------------------------------------------------ SuperNodes
    def add_supernode(
        self,
        node_config: Mapping[str, UserValue] | None = None,
        name: str | None = None,
    ) -> SuperNode:
        """Start a ``flower-supernode --insecure`` with its own Runtime API port."""
        if self.port is None:
            raise RuntimeError("start the SuperLink first")
        name = name or f"supernode-{len(self.supernodes)}"
        node = SuperNode(
            name,
            [],
            self.logs / f"{name}.log",
            self.env,
            node_config=dict(node_config or {}),
        )
        self._launch(node)
        self.supernodes.append(node)
        return node

    def _launch(self, node: SuperNode) -> None:
        node.args = supernode_command(self.port, node.node_config)
        node.start()
        if node not in self._everything:
            self._everything.append(node)

    def wait_for_nodes(
        self, nodes: list[SuperNode] | None = None, timeout: float = 60.0
    ) -> list[int]:
        """Wait until each node has connected; return (and record) their node ids."""
        ids = []
        deadline = time.monotonic() + timeout
        for node in nodes if nodes is not None else self.supernodes:
            match = node.wait_for_log(
                NODE_ID_PATTERN, max(0.1, deadline - time.monotonic()), node.log_mark
            )
            node.node_id = int(match.group(1))
            ids.append(node.node_id)
        return ids

    def restart_supernode(self, node: SuperNode, timeout: float = 60.0) -> int:
        """Stop ``node`` if it still runs, start it again with the same node_config.

        Returns the new node id (the SuperLink hands out a fresh one).
        """
        if node.running:
            node.stop()
        if node.node_id is not None:
            node.past_node_ids.append(node.node_id)
            node.node_id = None
        node.log_mark = len(node.log())
        self._launch(node)
        return self.wait_for_nodes([node], timeout)[0]

    # ------------------------------------------------------------------ runs
    def flwr(self, *args: str, check: bool = True, timeout: float = 60.0) -> str:
        """Run the ``flwr`` CLI against this federation; return its stdout."""
        done = subprocess.run(
            [program("flwr"), *args],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
            check=False,
            stdin=subprocess.DEVNULL,
        )
        if check and done.returncode != 0:
            raise RuntimeError(
                f"flwr {' '.join(args)} failed ({done.returncode}):\n"
                f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
            )
        return done.stdout

    def submit(
        self, app_dir: Path, run_config: Mapping[str, UserValue] | None = None
    ) -> RunHandle:
        """Start ``flwr run <app_dir> <connection> --stream`` in the background."""
        args = [program("flwr"), "run", str(app_dir), CONNECTION, "--stream"]
        if run_config:
            args += ["--run-config", format_user_config(run_config)]
        cli = Process(
            f"run-{len(self._runs)}",
            args,
            self.logs / f"run-{len(self._runs)}.log",
            self.env,
        )
        cli.start()
        self._runs.append(cli)
        return RunHandle(self, cli)

    def run(
        self,
        app_dir: Path,
        run_config: Mapping[str, UserValue] | None = None,
        timeout: float = 300.0,
    ) -> RunResult:
        """Submit a run and wait for it to finish (see :meth:`RunHandle.wait`)."""
        return self.submit(app_dir, run_config).wait(timeout)

    def run_status(self, run_id: int) -> str:
        """The run's status as ``flwr ls`` gives it (``finished:completed`` ...)."""
        out = self.flwr("ls", CONNECTION, "--run-id", str(run_id), "--format", "json")
        runs = json.loads(out[out.index("{") :])["runs"]
        return str(runs[0]["status"])


@pytest.fixture
def federation(tmp_path: Path) -> Iterator[Federation]:
    """A started SuperLink (no SuperNodes yet) in ``tmp_path``; stopped afterwards."""
    with Federation(tmp_path) as fed:
        fed.start_superlink()
        yield fed


# --------------------------------------------------------------------------------------
# The phone-fleet demo app (flowerbed.clients.bridge.demo_app)
# --------------------------------------------------------------------------------------

DEMO_APP = "flowerbed.clients.bridge.demo_app"
"""Module of the bridge's demo ServerApp (``app``) and ClientApp (``client_app``)."""


def write_demo_app(root: Path, name: str, config: Mapping[str, UserValue]) -> Path:
    """The Flower App folder ``root/app``, named ``name``, of the bridge's demo
    ServerApp and ClientApp with the run config defaults ``config``."""
    app_dir = root / "app"
    app_dir.mkdir()
    write_pyproject(
        app_dir, name, f"{DEMO_APP}:app", f"{DEMO_APP}:client_app", config, TEST_APP
    )
    return app_dir
