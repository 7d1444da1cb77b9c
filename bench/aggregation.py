"""Aggregation cost: flowerbed streaming against Flower's list, one process each.

Run as ``python -m flowerbed.bench.aggregation METHOD NODES FLOATS``; prints one
JSON line. Each measurement runs in a fresh process so that its peak resident set
size (``ru_maxrss``) is that method's alone.

- ``streaming``: replies arrive one at a time and are folded into
  :class:`flowerbed.strategies.utils.UpdateAccumulator` (float32 running sum of the
  updates, O(model) memory, NaN/Inf check and update norm in the same pass) through
  zero-copy views of the reply's bytes (:func:`flowerbed.strategies.utils.array_view`),
  as the flowerbed strategies do; each reply is dropped after folding.
- ``flower``: all replies are held in a list, then
  ``flwr.serverapp.strategy.strategy_utils.aggregate_arrayrecords`` averages them, as
  Flower's ``FedAvg.aggregate_train`` does (O(nodes x model) memory).
- ``bandwidth``: the memory-bandwidth reference: ``a += b`` over two arrays of
  ``FLOATS`` float32, best of five, in bytes moved per second (two read, one
  written), the STREAM convention (McCalpin, "Memory Bandwidth and Machine Balance
  in Current High Performance Computers", IEEE TCCA Newsletter, 1995). A fold must
  at least read the update and read and write the running sum, so no fold can
  take in more than a third of that in update bytes per second: ``limit_gbps``.

Throughput is ``nodes x FLOATS x 4`` bytes of updates folded per second of
aggregation (reply creation is not timed). Replies are ``base + i x 1e-3`` over a
seeded normal base: as large as real updates and cheap to make.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from typing import Any

import numpy as np

METHODS = ("streaming", "flower", "bandwidth")
RESNET50_FLOATS = 25_557_032
"""Parameters of ResNet-50 (torchvision ``resnet50``), the issue's 25.6 M update."""
NUM_ARRAYS = 16
"""Arrays the update is split into (a model's layers)."""


def _peak_rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _split(floats: int) -> list[int]:
    size, rest = divmod(floats, NUM_ARRAYS)
    return [size + (1 if i < rest else 0) for i in range(NUM_ARRAYS)]


def _base(floats: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        f"layer{i}": rng.standard_normal(n, dtype=np.float32)
        for i, n in enumerate(_split(floats))
    }


def _reply(base: dict[str, np.ndarray], i: int) -> Any:
    from flowerbed import keys
    from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict

    arrays = ArrayRecord({k: Array(v + np.float32(1e-3 * i)) for k, v in base.items()})
    metrics = MetricRecord({keys.NUM_EXAMPLES: 100 + i})
    return RecordDict({keys.ARRAYS: arrays, keys.METRICS: metrics})


def measure_streaming(nodes: int, floats: int) -> dict[str, Any]:
    from flowerbed import keys
    from flowerbed.strategies.utils import UpdateAccumulator, array_view

    base = _base(floats)
    acc = UpdateAccumulator()
    folding = 0.0
    for i in range(nodes):
        reply = _reply(base, i)
        t0 = time.perf_counter()
        record = reply[keys.ARRAYS]
        arrays = {name: array_view(array) for name, array in record.items()}
        weight = reply[keys.METRICS][keys.NUM_EXAMPLES]
        acc.add(arrays, base, float(weight))
        folding += time.perf_counter() - t0
        del reply, record, arrays
    t0 = time.perf_counter()
    acc.result(base)
    folding += time.perf_counter() - t0
    return {"seconds": folding}


def measure_flower(nodes: int, floats: int) -> dict[str, Any]:
    from flowerbed import keys
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    base = _base(floats)
    replies = [_reply(base, i) for i in range(nodes)]
    t0 = time.perf_counter()
    aggregate_arrayrecords(replies, keys.NUM_EXAMPLES)
    return {"seconds": time.perf_counter() - t0}


def measure_bandwidth(floats: int, repeats: int = 5) -> dict[str, Any]:
    a = np.random.default_rng(0).standard_normal(floats, dtype=np.float32)
    b = np.ones_like(a)
    a += b  # fault the pages in before timing
    best = min(_timed_add(a, b) for _ in range(repeats))
    return {
        "seconds": best,
        "bandwidth_gbps": 3 * a.nbytes / best / 1e9,
        "limit_gbps": a.nbytes / best / 1e9,
    }


def _timed_add(a: np.ndarray, b: np.ndarray) -> float:
    t0 = time.perf_counter()
    a += b
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("method", choices=METHODS)
    parser.add_argument("nodes", type=int)
    parser.add_argument("floats", type=int)
    args = parser.parse_args(argv)
    if args.nodes < 1 or args.floats < NUM_ARRAYS:
        parser.error(f"need nodes >= 1 and floats >= {NUM_ARRAYS}")
    if args.method == "bandwidth":
        out = measure_bandwidth(args.floats)
    else:
        fn = measure_streaming if args.method == "streaming" else measure_flower
        out = fn(args.nodes, args.floats)
        out["gbps"] = args.nodes * args.floats * 4 / out["seconds"] / 1e9
    out.update(
        method=args.method,
        nodes=args.nodes,
        floats=args.floats,
        peak_rss_bytes=_peak_rss_bytes(),
    )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
