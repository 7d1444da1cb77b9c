"""A span member stops itself when its SuperNode is gone.

Flower runs each ClientApp in its own ``flwr-clientapp`` process, started by the
SuperNode's SuperExec and talking to the SuperNode only through the SuperNode's
Runtime API (the ``--runtime-api-address`` it was started with; flwr 1.42,
``flwr/supernode/runtime/run_clientapp.py``). When the SuperNode process dies
alone (killed, or crashed) while the ClientApp is in a segment, the ClientApp can
no longer reply, yet it would train on with its peers to the end of the
segment, and they would learn nothing until Flower's node heartbeat expires (a
minute). :func:`start_supernode_watchdog` starts a daemon thread that connects
to that address every :data:`WATCH_INTERVAL_S` seconds; after
:data:`MISSES_TO_STOP` failed connections in a row it logs why and ends the
process at once (``os._exit``), which closes its gloo connections, so its peers'
collectives fail within milliseconds and they report its rank gone
(:func:`flowerbed.parallel.group.probe_peers`).

Outside a ``flwr-clientapp`` process (no ``--runtime-api-address`` on the command
line: tests, :class:`~flowerbed.sims.process_grid.ProcessGrid`) there is no
SuperNode to watch, and nothing is started.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from logging import ERROR

from flwr.supercore import log

from .group import close_all_liveness

RUNTIME_API_FLAG = "--runtime-api-address"
"""flwr-clientapp's option naming its SuperNode's Runtime API (flwr 1.42)."""
WATCH_INTERVAL_S = 0.2
"""Seconds between two connections to the SuperNode's Runtime API."""
PROBE_TIMEOUT_S = 1.0
"""Seconds a connection may take before it counts as a miss."""
MISSES_TO_STOP = 2
"""Failed connections in a row after which the SuperNode counts as gone."""
WATCHDOG_EXIT_CODE = 75
"""Exit code of a member that stopped because its SuperNode was gone."""

_started: dict[str, threading.Thread] = {}
_lock = threading.Lock()


def runtime_api_address(argv: Sequence[str] | None = None) -> str | None:
    """The ``HOST:PORT`` of this process's SuperNode (``--runtime-api-address X``
    or ``--runtime-api-address=X`` in ``argv``, default ``sys.argv``), or None."""
    args = list(sys.argv if argv is None else argv)
    for index, arg in enumerate(args):
        if arg == RUNTIME_API_FLAG and index + 1 < len(args):
            return args[index + 1]
        if arg.startswith(RUNTIME_API_FLAG + "="):
            return arg.split("=", 1)[1]
    return None


def split_address(address: str) -> tuple[str, int]:
    """``"127.0.0.1:9094"`` / ``"[::1]:9094"`` -> (host, port); a wildcard host
    (``0.0.0.0``, ``[::]``) is reached on the loopback address."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return host, int(port)


def reachable(host: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to ``host:port`` opens within ``timeout``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _stop(reason: str) -> None:
    log(ERROR, "span member stops: %s", reason)
    sys.stderr.flush()
    close_all_liveness()  # before the gloo connections, so peers find it gone
    os._exit(WATCHDOG_EXIT_CODE)


def watch(
    address: str,
    *,
    interval_s: float = WATCH_INTERVAL_S,
    misses: int = MISSES_TO_STOP,
    on_gone: Callable[[str], None] = _stop,
) -> threading.Thread:
    """Start a daemon thread that calls ``on_gone(reason)`` once ``address``
    (``HOST:PORT``) refuses or ignores ``misses`` connections in a row; by default
    that ends the process (module doc)."""
    host, port = split_address(address)

    def loop() -> None:
        missed = 0
        while True:
            missed = 0 if reachable(host, port) else missed + 1
            if missed >= misses:
                on_gone(
                    f"its SuperNode's Runtime API at {address} refused or ignored "
                    f"{missed} connections in a row: the SuperNode is gone, so this "
                    "ClientApp cannot reply; it ends now so that its peers fail "
                    "fast and report its rank lost"
                )
                return
            time.sleep(interval_s)

    thread = threading.Thread(target=loop, name="span-supernode-watchdog", daemon=True)
    thread.start()
    return thread


def start_supernode_watchdog() -> bool:
    """Watch this ``flwr-clientapp`` process's SuperNode (once per process);
    False when the process is not one (module doc)."""
    address = runtime_api_address()
    if address is None:
        return False
    with _lock:
        if address not in _started:
            _started[address] = watch(address)
    return True
