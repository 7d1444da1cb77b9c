"""JSON request bodies: checks and decoding in time linear in the body.

A phone's JSON body (hello, complete, fail) is checked for nesting depth before
it is parsed, then decoded; both steps are linear in the body's length and
together have a CPU budget, :data:`JSON_CPU_BUDGET_S`. The server runs them in
its worker pool, never on its event loop (docs/bridge.md, "Security").
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flowerbed.clients.bridge.tasks import ProtocolError

MAX_JSON_DEPTH = 32
"""Deepest JSON nesting accepted (the protocol's bodies nest 2 levels)."""
JSON_CPU_BUDGET_S = 0.05
"""CPU seconds one body's checks and decoding may take; over it: 413.

Checking and decoding a 64 KiB body costs a few milliseconds (an array of small
numbers is the slowest shape); the protocol's own bodies, well under one.
"""

_BLOCK_BYTES = 16 * 1024
"""Bytes the depth check scans at once: its arrays stay small enough to be reused
from the cache, so a byte costs the same in a short body as in a long one."""
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPEN_ARRAY, _CLOSE_ARRAY, _OPEN_OBJECT, _CLOSE_OBJECT = b"[]{}"


@dataclass
class CpuBudget:
    """CPU time the calling thread may spend from now on one request body."""

    limit_s: float
    start: float = field(default_factory=time.thread_time)

    def check(self) -> None:
        """Raise :class:`ProtocolError` 413, naming the limit, once it is spent."""
        spent = time.thread_time() - self.start
        if spent > self.limit_s:
            raise ProtocolError(
                413,
                f"body JSON took {spent * 1e3:.1f} ms of CPU to check and decode; "
                f"the limit is {self.limit_s * 1e3:g} ms",
            )


def json_depth(raw: bytes, budget: CpuBudget | None = None) -> int:
    """Deepest nesting of ``[``/``{`` in JSON text, strings skipped; linear time.

    A few NumPy passes over each block of :data:`_BLOCK_BYTES`, none of which
    goes back over bytes it has read, so the cost is proportional to
    ``len(raw)`` whatever the bytes are:

    - backslashes come in runs; a run of odd length escapes the byte after it;
    - a quote that is not escaped opens or closes a string, so a byte lies inside
      a string when an odd number of such quotes precede it (a running sum);
    - brackets outside strings step the depth up or down (a running sum).

    A block hands the next one the parity of its last run of backslashes, whether
    it ended inside a string, and the depth. ``budget`` is checked after each
    block. UTF-8 multi-byte characters hold no ASCII bytes, so the bytes are
    scanned without decoding them. Text that is not JSON gets a bound on how deep
    the parser nests before it stops at the first error (a backslash outside a
    string, an unterminated string).
    """
    deepest = depth = escaping = in_string = 0
    for offset in range(0, len(raw), _BLOCK_BYTES):
        size = min(_BLOCK_BYTES, len(raw) - offset)
        block = np.frombuffer(raw, dtype=np.uint8, count=size, offset=offset)
        # One backslash more in front when the last block ended in an odd run:
        # only a run's parity matters.
        backslashes = np.zeros(size + 3, dtype=np.int8)
        backslashes[1] = escaping
        backslashes[2:-1] = block == _BACKSLASH
        edges = np.diff(backslashes)
        rises, falls = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        escaped = falls[((falls - rises) & 1) == 1] - 1  # the byte after an odd run
        escaping = int(escaped.size > 0 and escaped[-1] == size)
        quotes = block == _QUOTE
        quotes[escaped[: escaped.size - escaping]] = False
        strings = (np.cumsum(quotes, dtype=np.int32) + in_string) & 1
        in_string = int(strings[-1])
        opens = (block == _OPEN_ARRAY) | (block == _OPEN_OBJECT)
        closes = (block == _CLOSE_ARRAY) | (block == _CLOSE_OBJECT)
        steps = np.where(strings == 0, opens.view(np.int8) - closes.view(np.int8), 0)
        levels = np.cumsum(steps, dtype=np.int32) + depth
        deepest, depth = max(deepest, int(levels.max())), int(levels[-1])
        if budget is not None:
            budget.check()
    return deepest


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes, budget_s: float = JSON_CPU_BUDGET_S) -> Any:
    """Decode a JSON request body; :class:`ProtocolError` 400 for anything invalid.

    NaN and Infinity literals are refused (they are not JSON), and so is nesting
    deeper than :data:`MAX_JSON_DEPTH`, checked before parsing: the parser would
    otherwise recurse into a ``RecursionError``, which in CPython 3.11 can leave
    the interpreter unable to compile code afterwards. The CPU time this thread
    spends is checked against ``budget_s`` after each block of the depth check
    and after decoding: over it, :class:`ProtocolError` 413 naming the limit.
    Takes up to a few milliseconds per 64 KiB: call it off the event loop.
    """
    if not raw:
        return {}
    budget = CpuBudget(budget_s)
    if json_depth(raw, budget) > MAX_JSON_DEPTH:
        raise ProtocolError(
            400, f"body JSON is nested too deeply (more than {MAX_JSON_DEPTH} levels)"
        )
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_no_constants)
    except (UnicodeDecodeError, ValueError) as err:
        raise ProtocolError(400, f"body is not UTF-8 JSON: {err}") from None
    budget.check()
    return body
