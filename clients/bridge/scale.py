"""How much gateway memory does one connected phone cost?

:func:`measure_memory_per_phone` starts a local SuperLink and a ``flowerbed bridge``
gateway (separate processes, 127.0.0.1, free ports), connects ``n`` simulated
phones (threads of this process speaking protocol version 1, long-polling), waits
until every phone's Flower node is activated at the SuperLink, and compares the
gateway's resident set size (``VmRSS``) with its size before any phone came::

    per_phone = (RSS with n phones connected - RSS with none) / n

Each connected phone costs the gateway one Fleet API connection (an HTTP client
and a heartbeat thread, as a SuperNode has), one relay thread, and one HTTP
connection thread for its long poll.

Run it as ``python -m flowerbed.clients.bridge.scale 100``.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from flowerbed.clients.bridge.procs import (
    free_port,
    rss_bytes,
    start_gateway,
    start_superlink,
    stop_processes,
)
from flowerbed.clients.bridge.simphone import SimPhone

_ONLINE_RE = re.compile(r"phone (\S+): node \d+ online")


@dataclass(frozen=True)
class PhoneMemory:
    """Gateway memory with ``phones`` phones connected, and per phone."""

    phones: int
    baseline_bytes: int
    """Gateway RSS before any phone connected."""
    loaded_bytes: int
    """Gateway RSS with every phone connected and its node active."""
    connect_s: float
    """Seconds from the first hello until every node was active."""

    @property
    def per_phone_bytes(self) -> float:
        return (self.loaded_bytes - self.baseline_bytes) / self.phones


def _token(i: int) -> str:
    return f"scale-phone-token-{i:05d}"


def _phone_loop(url: str, token: str, stop: threading.Event, errors: list[str]) -> None:
    phone = SimPhone(url, token, timeout=30)
    try:
        phone.hello({"model": "simphone"})
        while not stop.is_set():
            phone.poll(2)
    except Exception as err:  # any failure is reported by the measurement
        errors.append(f"{token}: {err}")
    finally:
        phone.close()


def measure_memory_per_phone(
    n: int, workdir: str | Path | None = None, timeout_s: float = 300.0
) -> PhoneMemory:
    """Connect ``n`` simulated phones to a fresh gateway and measure its RSS.

    Parameters
    ----------
    n : int
        Phones to connect (>= 1).
    workdir : str | Path | None
        Where logs and the token file go (default: a temporary directory).
    timeout_s : float
        Give up when the phones' nodes are not all active after this long.

    Raises
    ------
    RuntimeError
        If a phone failed or not every node became active in time.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(workdir) if workdir is not None else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        tokens = work / "tokens.txt"
        tokens.write_text("".join(f"{_token(i)} phone{i}\n" for i in range(n)))
        link_port, gw_port = free_port(), free_port()
        procs = [start_superlink(link_port, work / "superlink.log")]
        stop = threading.Event()
        threads: list[threading.Thread] = []
        errors: list[str] = []
        try:
            gw_log = work / "gateway.log"
            gateway = start_gateway(
                link_port, gw_port, tokens, gw_log, extra=("--max-poll-s=2",)
            )
            procs.append(gateway)
            time.sleep(1.0)
            baseline = rss_bytes(gateway.pid)
            url = f"http://127.0.0.1:{gw_port}"
            started = time.monotonic()
            for i in range(n):
                t = threading.Thread(
                    target=_phone_loop, args=(url, _token(i), stop, errors), daemon=True
                )
                t.start()
                threads.append(t)
            while len(set(_ONLINE_RE.findall(gw_log.read_text()))) < n:
                if errors:
                    raise RuntimeError(f"{len(errors)} phones failed: {errors[:3]}")
                if time.monotonic() - started > timeout_s:
                    raise RuntimeError(
                        f"not all {n} phone nodes active in {timeout_s} s"
                    )
                time.sleep(0.5)
            connect_s = time.monotonic() - started
            time.sleep(2.0)  # a few polls and heartbeats at full load
            loaded = rss_bytes(gateway.pid)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=10)
            stop_processes(procs, timeout=10)
        return PhoneMemory(n, baseline, loaded, connect_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("phones", type=int, nargs="?", default=100)
    parser.add_argument("--workdir", help="keep logs here")
    args = parser.parse_args(argv)
    report = measure_memory_per_phone(args.phones, args.workdir)
    print(
        f"{report.phones} phones: gateway RSS {report.baseline_bytes / 2**20:.1f} MiB "
        f"-> {report.loaded_bytes / 2**20:.1f} MiB, "
        f"{report.per_phone_bytes / 2**10:.0f} KiB per phone; "
        f"all nodes active after {report.connect_s:.1f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
