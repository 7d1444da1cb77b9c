"""Run a function on N local processes (ranks) and collect what each returns.

For tests of code that runs inside a torch.distributed group: ``run_ranks(fn, n,
*args)`` spawns ``n`` processes (``fn(rank, *args)`` in each; ``fn`` must be a
module-level function), waits at most ``timeout`` seconds and returns each
rank's return value or the exception text it raised, by rank. A process that
does not finish in time is killed by its pid and reported as ``"timeout"``;
one that dies without a word as ``"exit <code>"``.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any


def _child(
    fn: Callable[..., Any], rank: int, args: tuple[Any, ...], queue: Any
) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        queue.put((rank, "ok", fn(rank, *args)))
    except BaseException as err:  # report, never hang the parent
        queue.put(
            (rank, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
        )


def run_ranks(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0
) -> dict[int, tuple[str, Any]]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_child, args=(fn, r, args, queue)) for r in range(world)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world and time.monotonic() < deadline:
            try:
                rank, status, value = queue.get(timeout=0.2)
                results[rank] = (status, value)
            except Exception:
                if all(not p.is_alive() for p in procs) and queue.empty():
                    break
    finally:
        for rank, proc in enumerate(procs):
            proc.join(max(0.0, min(5.0, deadline - time.monotonic())))
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
                proc.join()
                results.setdefault(rank, ("timeout", None))
            results.setdefault(rank, (f"exit {proc.exitcode}", None))
    return results
