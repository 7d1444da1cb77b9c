"""JSON request bodies cost time linear in their size, and never stall the gateway.

A body is checked for nesting depth and decoded in time proportional to its length
whatever its bytes, under a CPU budget, in the server's worker pool: a phone
sending 64 KiB hostile bodies four at a time leaves other requests as fast as
they were (docs/bridge.md, "Security").
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import random
import threading
import time
from collections.abc import Callable

import pytest
from bridge_fakes import (
    TOKENS,
    running_bridge,
    task_identity,  # noqa: F401 (fixture)
)
from flowerbed.clients.bridge import json_body
from flowerbed.clients.bridge.json_body import json_depth, parse_json
from flowerbed.clients.bridge.server import MAX_JSON_BYTES
from flowerbed.clients.bridge.tasks import ProtocolError

pytestmark = pytest.mark.usefixtures("task_identity")

ALICE = next(t for t, n in TOKENS.items() if n == "alice")

HOSTILE: dict[str, Callable[[int], bytes]] = {
    # About n bytes each.
    "unterminated string of escaped quotes": lambda n: b'"' + b'\\"' * (n // 2),
    "the same as a hello field": lambda n: b'{"device": "' + b'\\"' * (n // 2),
    "closed string of escaped quotes": lambda n: b'["' + b'\\"' * (n // 2) + b'"]',
    "deep nesting": lambda n: b"[" * n,
    "deep nesting in strings": lambda n: b'["' + b"[" * n + b'"]',
    "long backslash run": lambda n: b'"' + b"\\" * n + b'"',
    "many small strings": lambda n: b"[" + b'"",' * (n // 3) + b'""]',
    "many numbers": lambda n: b"[" + b"1.5," * (n // 4) + b"1]",
}


# -- the depth check -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "depth"),
    [
        (b"", 0),
        (b"1", 0),
        (b'{"a": [1, {"b": []}]}', 4),
        (b'["[[[", "{{{"]', 1),  # brackets in strings do not count
        (b'["\\"[[["]', 1),  # an escaped quote does not end a string
        (b'["\\\\", [[]]]', 3),  # an escaped backslash does not escape the quote
        (b'["\\\\\\"[", []]', 2),  # three backslashes: the quote is escaped
        (b"]]][", 0),
        (b'"' + b"[" * 100, 0),  # an unterminated string: the parser stops there
        ('["\u00e9[", ["\u4e2d"]]'.encode(), 2),  # multi-byte UTF-8 characters
    ],
)
def test_json_depth_counts_brackets_outside_strings(raw, depth):
    assert json_depth(raw) == depth


def _random_json(rng: random.Random, levels: int) -> object:
    """A JSON value nested at most ``levels`` deep, its strings full of the bytes
    that matter to the depth check: quotes, backslashes, brackets."""
    kind = rng.choice(["string", "number", "list", "dict"] if levels else ["string"])
    if kind == "string":
        return "".join(rng.choice('"\\[]{}a\u00e9') for _ in range(rng.randint(0, 6)))
    if kind == "number":
        return rng.uniform(-1, 1)
    items = [_random_json(rng, levels - 1) for _ in range(rng.randint(0, 3))]
    if kind == "list":
        return items
    return {str(_random_json(rng, 0)): item for item in items}


def _depth(value: object) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


@pytest.mark.parametrize("block_bytes", [1, 3, json_body._BLOCK_BYTES])
def test_json_depth_is_the_depth_of_any_json_document(block_bytes, monkeypatch):
    """Whatever the document and wherever the scan's blocks split it (a run of
    backslashes, a string)."""
    monkeypatch.setattr(json_body, "_BLOCK_BYTES", block_bytes)
    rng = random.Random(27)
    for _ in range(500):
        value = _random_json(rng, rng.randint(0, 6))
        for ensure_ascii in (True, False):
            raw = json.dumps(value, ensure_ascii=ensure_ascii).encode("utf-8")
            assert json_depth(raw) == _depth(value), raw


def test_existing_refusals_keep_their_messages():
    with pytest.raises(ProtocolError, match="nested too deeply") as deep:
        parse_json(b"[" * 33 + b"]" * 33)
    with pytest.raises(ProtocolError, match="not a JSON number") as nan:
        parse_json(b'{"protocol": NaN}')
    with pytest.raises(ProtocolError, match="UTF-8 JSON") as invalid:
        parse_json(HOSTILE["unterminated string of escaped quotes"](MAX_JSON_BYTES))
    assert deep.value.status == nan.value.status == invalid.value.status == 400


def test_nesting_up_to_32_levels_is_accepted():
    value = parse_json(b"[" * 32 + b"]" * 32)
    for _ in range(31):
        (value,) = value
    assert value == []


# -- cost ----------------------------------------------------------------------------


def _cpu_cost(body: bytes, repeats: int = 7) -> float:
    """Least CPU time of this thread, in seconds, to check and decode ``body``
    (the least of several runs: other work on the machine only ever adds)."""
    costs = []
    for _ in range(repeats):
        start = time.thread_time()
        with contextlib.suppress(ProtocolError):
            parse_json(body, budget_s=math.inf)
        costs.append(time.thread_time() - start)
    return min(costs)


@pytest.mark.parametrize("make", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_body_four_times_as_long_costs_at_most_about_four_times_as_much(make):
    """Linear: a hostile body four times as long, up to the 64 KiB limit, costs at
    most about four times as much (8x allowed: a quadratic check costs 16x). Sizes
    4x apart, not 2x: at a fraction of a millisecond a busy host has made a
    linear check look 3x as dear at twice the size, as dear as a quadratic one."""
    quarter, full = make(MAX_JSON_BYTES // 4), make(MAX_JSON_BYTES)
    _cpu_cost(quarter, repeats=1)  # warm up
    small, large = _cpu_cost(quarter, repeats=15), _cpu_cost(full, repeats=15)
    assert large < 8 * small, f"{small * 1e3:.3f} ms -> {large * 1e3:.3f} ms"


def test_a_body_over_the_cpu_budget_is_refused_with_413_naming_the_limit():
    body = HOSTILE["many numbers"](MAX_JSON_BYTES)
    with pytest.raises(ProtocolError) as err:
        parse_json(body, budget_s=1e-6)
    assert err.value.status == 413
    assert "CPU" in err.value.reason and "the limit is 0.001 ms" in err.value.reason
    assert len(parse_json(body)) == MAX_JSON_BYTES // 4 + 1  # the default budget


# -- the running gateway ---------------------------------------------------------------


def _slowest(requests: list[Callable[[], object]]) -> float:
    """Seconds the slowest of ``requests`` took."""
    slowest = 0.0
    for request in requests:
        start = time.perf_counter()
        request()
        slowest = max(slowest, time.perf_counter() - start)
    return slowest


def test_hostile_bodies_four_at_a_time_leave_other_requests_fast():
    """An enrolled phone sends 64 KiB hostile bodies to /v1/hello on four
    connections, over and over; the slowest of another phone's hellos and polls
    meanwhile is within 100 ms of the slowest without that load."""
    bodies = [make(MAX_JSON_BYTES - 16) for make in HOSTILE.values()]
    assert all(MAX_JSON_BYTES - 32 < len(body) <= MAX_JSON_BYTES for body in bodies)
    with running_bridge() as (_, _, server, phone):
        bob = phone("bob")
        healthy = [bob.hello, lambda: bob.poll(0)] * 4
        bob.hello()
        calm = _slowest(healthy)

        stop = threading.Event()
        sent = [threading.Event() for _ in range(4)]
        answers: list[tuple[int, str]] = []

        def attack(i: int) -> None:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            headers = {"Authorization": f"Bearer {ALICE}"}
            try:
                while not stop.is_set():
                    body = bodies[(i + len(answers)) % len(bodies)]
                    conn.request("POST", "/v1/hello", body, headers)
                    sent[i].set()
                    resp = conn.getresponse()
                    answers.append((resp.status, json.loads(resp.read())["error"]))
            finally:
                conn.close()

        attackers = [threading.Thread(target=attack, args=(i,)) for i in range(4)]
        for t in attackers:
            t.start()
        try:
            for event in sent:
                assert event.wait(10)
            loaded = _slowest(healthy)
        finally:
            stop.set()
            for t in attackers:
                t.join()
    assert loaded < calm + 0.1, f"{calm * 1e3:.1f} ms calm, {loaded * 1e3:.1f} loaded"
    assert len(answers) >= 4
    assert {status for status, _ in answers} == {400}, answers[:4]
