"""Start and stop the processes of a local bridge setup (tests, benchmarks).

A Flower SuperLink, a ``flowerbed bridge`` gateway and JVM phones, all bound to
127.0.0.1 on free ports, each stopped by its pid (children included: the SuperLink
starts a SuperExec in its own process group).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout: float, proc: subprocess.Popen[bytes]) -> None:
    """Block until 127.0.0.1:``port`` accepts connections; raise if ``proc`` died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def child_pids(pid: int) -> list[int]:
    """Pids of the direct children of ``pid`` (read from /proc)."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Field 4 is the parent pid; the command name (field 2) may hold spaces.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            children.append(int(entry.name))
    return children


def stop_processes(procs: list[subprocess.Popen[bytes]], timeout: float = 10.0) -> None:
    """SIGTERM every process and its children by pid, all at once; SIGKILL what
    is still alive after ``timeout`` seconds."""
    family: dict[int, list[int]] = {}
    for proc in procs:
        if proc.poll() is None:
            family[proc.pid] = [proc.pid, *child_pids(proc.pid)]
    for pids in family.values():
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for pids in family.values():
        for pid in pids[1:]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """:func:`stop_processes` for one process."""
    stop_processes([proc], timeout)


def start_serving(cmd: list[str], port: int, log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``cmd`` with its output in ``log_path`` and wait until it serves ``port``.

    The process is stopped again if it does not listen within 60 s.
    """
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, 60, proc)
    except Exception:
        stop_process(proc)
        raise
    return proc


def start_superlink(port: int, log_path: Path) -> subprocess.Popen[bytes]:
    """``flower-superlink --insecure`` serving every API on 127.0.0.1:``port``."""
    cmd = [
        "flower-superlink",
        "--insecure",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--disable-runtime-dependency-installation",
    ]
    return start_serving(cmd, port, log_path)


def start_gateway(
    superlink_port: int,
    port: int,
    tokens_path: Path,
    log_path: Path,
    extra: tuple[str, ...] = (),
) -> subprocess.Popen[bytes]:
    """``flowerbed bridge`` on 127.0.0.1:``port`` for an insecure local SuperLink."""
    cmd = [
        sys.executable,
        "-m",
        "flowerbed",
        "bridge",
        "--superlink",
        f"127.0.0.1:{superlink_port}",
        "--insecure",
        "--tokens",
        str(tokens_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
    ]
    return start_serving(cmd, port, log_path)


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` (VmRSS in /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")
