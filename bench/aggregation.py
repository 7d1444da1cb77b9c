"""Aggregation cost: flowerbed streaming against Flower's list, one process each.

Run as ``python -m flowerbed.bench.aggregation METHOD NODES FLOATS``; prints one
JSON line. Each measurement runs in a fresh process so that its peak resident set
size is that method's alone: the peak (Linux's ``VmHWM``, else ``ru_maxrss``) is
counted afresh just before the aggregation, without the bandwidth measurement's
arrays.

- ``streaming``: replies arrive one at a time and are folded into
  :class:`flowerbed.strategies.accumulation.UpdateAccumulator` (float32 running sum
  of the updates, O(model) memory, NaN/Inf check and update norm in the same
  pass) through zero-copy views of the reply's bytes
  (:func:`flowerbed.arrays.array_view`), as the flowerbed strategies do; each
  reply is dropped after folding. The fold
  is numba's compiled one-pass kernel (:mod:`flowerbed.strategies.fold_kernel`)
  where numba is installed, else NumPy chunks: each point says which
  (``kernel``) and what the kernel's first use cost the process
  (``kernel_first_use_s``: importing numba and compiling, or loading the
  compiled code from numba's disk cache; not in the timed figures, as a server
  pays it once).
- ``grouped``: the same, but replies come :data:`GROUP` at a time (as a pull
  that returns several, or Flower's list, hands them over) and are folded by
  ``UpdateAccumulator.add_many`` in one pass: the base and the sum are read once
  per group instead of once per reply. Holds ``GROUP`` replies at a time.
- ``strategy``: what a flowerbed strategy does with a round's replies:
  ``RuntimeWeightedFedAvg.aggregate_train`` (FedAvg's weights, ``weighting=
  "examples"``, with the default influence bound: weight cap and clipping) over
  Flower ``Message`` replies as they arrive, validated, folded
  :data:`flowerbed.strategies.runtime_weighted.FOLD_GROUP` at a time through a
  scratch sum (``BoundedSum.add_many``), and the result encoded as the
  ``ArrayRecord`` the strategy returns; after a warm-up round that gives the
  bound its reference and the strategy the memory it keeps between rounds.
  Making the replies is not timed (each is made when the strategy asks for
  it, its CPU time taken off).
- ``flower``: all replies are held in a list, then
  ``flwr.serverapp.strategy.strategy_utils.aggregate_arrayrecords`` averages them, as
  Flower's ``FedAvg.aggregate_train`` does (O(nodes x model) memory).
- ``bandwidth``: the memory-bandwidth reference alone (see below).

The limit: ``a += b`` over two arrays of ``FLOATS`` float32, best of five, in
bytes moved per second (two read, one written), the STREAM convention (McCalpin,
"Memory Bandwidth and Machine Balance in Current High Performance Computers",
IEEE TCCA Newsletter, 1995). A fold must at least read the update and read and
write the running sum, so one fold takes in at most a third of that in update
bytes per second: ``limit_gbps``. (Reading the base as well, as a fold of
differences must, caps a lone fold at 3/4 of it; a group of ``k`` reads base
and sum once, so it can pass it.) Every measuring process measures the limit
itself, just before and just after its aggregation, so that both figures of a
ratio come from the same process at the same time on this shared machine.

Seconds are CPU seconds of the (single-threaded) process, ``time.process_time``:
on a loaded machine, wall time also counts the time other processes held the
core. Throughput is ``nodes x FLOATS x 4`` bytes of updates per CPU second of
aggregation (reply creation is not timed). A warm-up aggregation of two replies
runs first, as a server has done in every round but its first: a fresh
process's first model-sized allocation costs ~0.2 s of the kernel's huge-page
assembly here, which a long-running server does not pay each round; and the
timed aggregation makes its sums in the warm-up's result, as
``RuntimeWeightedFedAvg`` makes each round's in the last round's result once
it has encoded it (fresh memory would cost the kernel ~13 ms of page faults
per 102 MB, about half a fold, each round). Replies are
``base + (1 + (i mod 4) / 4) x 1e-3`` over a seeded normal base: as large as
real updates, within the spread the influence bound leaves alone (the
``strategy`` method clips updates over 3x the median norm), and cheap to make.
"""

from __future__ import annotations

import argparse
import json
import mmap
import resource
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from flowerbed.system import proc_bytes

METHODS = ("streaming", "grouped", "strategy", "flower", "bandwidth")
GROUP = 4
"""Replies folded per pass by the ``grouped`` method."""
RESNET50_FLOATS = 25_557_032
"""Parameters of ResNet-50 (torchvision ``resnet50``): a 25.6 M update."""
NUM_ARRAYS = 16
"""Arrays the update is split into (a model's layers)."""


def _peak_rss_bytes() -> int:
    """The process's peak resident set size since :func:`_reset_peak` (Linux's
    ``VmHWM``), or since it started where that cannot be read."""
    found = proc_bytes("/proc/self/status", "VmHWM:")
    if found is not None:
        return found
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _reset_peak() -> None:
    """Start the peak resident set size afresh from what the process holds now
    (Linux: ``5`` to ``/proc/self/clear_refs``), so that the peak reported is
    the aggregation's, not that of the bandwidth measurement's two arrays."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        pass


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

    step = np.float32(1e-3 * (1 + (i % 4) / 4))
    arrays = ArrayRecord({k: Array(v + step) for k, v in base.items()})
    metrics = MetricRecord({keys.NUM_EXAMPLES: 100 + i})
    return RecordDict({keys.ARRAYS: arrays, keys.METRICS: metrics})


def _streaming(
    base: dict[str, np.ndarray],
    nodes: int,
    group: int,
    memory: dict[str, np.ndarray] | None = None,
) -> tuple[float, dict[str, np.ndarray]]:
    """CPU seconds to fold ``nodes`` replies, ``group`` per pass, and make the
    result (in ``memory``, as a strategy makes it in its last result's), and
    the result."""
    from flowerbed import keys
    from flowerbed.arrays import record_views
    from flowerbed.strategies.accumulation import Update, UpdateAccumulator

    acc = UpdateAccumulator(memory)
    folding = 0.0
    for start in range(0, nodes, group):
        replies = [_reply(base, i) for i in range(start, min(start + group, nodes))]
        t0 = time.process_time()
        updates = []
        for reply in replies:
            record = reply[keys.ARRAYS]
            arrays = record_views(record)
            weight = float(reply[keys.METRICS][keys.NUM_EXAMPLES])
            updates.append(Update(arrays, base, weight))
        if group == 1:
            acc.add(updates[0].arrays, base, updates[0].weight)
        else:
            acc.add_many(updates)
        folding += time.process_time() - t0
        del replies, updates
    t0 = time.process_time()
    result = acc.result(base)
    return folding + time.process_time() - t0, result


def kernel_first_use(group: int = 1) -> dict[str, Any]:
    """Which fold kernel this process uses, and the wall seconds of its first use
    (folds of a tiny update read in place, as the strategies read replies, one
    at a time and, for ``group`` > 1, in each group size the kernel compiles
    for: powers of two up to ``fold_kernel.MOST``)."""
    from flowerbed.arrays import array_view
    from flowerbed.strategies import fold_kernel
    from flowerbed.strategies.accumulation import Update, UpdateAccumulator
    from flwr.app import Array

    small = np.ones(8, np.float32)
    base = {"w": small * 0}
    t0 = time.perf_counter()
    UpdateAccumulator().add({"w": array_view(Array(small))}, base, 1.0)
    count = 2
    while count <= min(group, fold_kernel.MOST):
        updates = [Update({"w": array_view(Array(small))}, base, 1.0)] * count
        UpdateAccumulator().add_many(updates)
        count *= 2
    seconds = time.perf_counter() - t0
    kernel = "numba" if fold_kernel.kernel() is not None else "numpy"
    return {"kernel": kernel, "kernel_first_use_s": seconds}


def measure_streaming(nodes: int, floats: int, group: int = 1) -> dict[str, Any]:
    first = kernel_first_use(group)
    base = _base(floats)
    _, memory = _streaming(base, min(2, nodes), group)  # warm-up (module docstring)
    before = measure_bandwidth(floats)
    _reset_peak()
    seconds, _ = _streaming(base, nodes, group, memory)
    peak = _peak_rss_bytes()
    return {
        "seconds": seconds,
        "peak_rss_bytes": peak,
        **first,
        **_limits(before, measure_bandwidth(floats)),
    }


def _messages(
    base: dict[str, np.ndarray], first: int, count: int, made: list[float]
) -> Iterator[Any]:
    """Train replies ``first .. first + count - 1`` as Flower messages, each made
    when asked for; the CPU seconds spent making them are added to ``made[0]``."""
    from flwr.app import Message, RecordDict

    for i in range(first, first + count):
        t0 = time.process_time()
        sent = Message(RecordDict(), 1 + i, "train")
        reply = Message(_reply(base, i), reply_to=sent)
        del sent
        made[0] += time.process_time() - t0
        yield reply


def _strategy_round(
    strategy: Any, base: dict[str, np.ndarray], server_round: int, nodes: int
) -> float:
    """CPU seconds of one ``aggregate_train`` over ``nodes`` replies."""
    made = [0.0]
    t0 = time.process_time()
    arrays, _ = strategy.aggregate_train(server_round, _messages(base, 0, nodes, made))
    seconds = time.process_time() - t0 - made[0]
    if arrays is None:
        raise RuntimeError("the strategy accepted no reply")
    return seconds


def measure_strategy(nodes: int, floats: int) -> dict[str, Any]:
    from flowerbed.sims.engine import FleetGrid, SimNode
    from flowerbed.strategies import RuntimeWeightedFedAvg
    from flowerbed.strategies.accumulation import to_arrayrecord
    from flowerbed.strategies.robust import MIN_REFERENCE
    from flowerbed.strategies.runtime_weighted import FOLD_GROUP
    from flwr.app import ConfigRecord
    from flwr.clientapp import ClientApp
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id = 1, SUPERLINK_NODE_ID
    TaskIdentity.task_id = 0
    first = kernel_first_use(GROUP)
    base = _base(floats)
    strategy = RuntimeWeightedFedAvg.from_settings(weighting="examples")
    # The model the replies trained from reaches the strategy as in a run, through
    # configure_train (its messages are not sent).
    fleet = FleetGrid(ClientApp(), [SimNode(n, {}) for n in (1, 2)], {})
    strategy.configure_train(1, to_arrayrecord(base), ConfigRecord(), fleet)
    _strategy_round(strategy, base, 1, MIN_REFERENCE + 1)  # warm-up (docstring)
    before = measure_bandwidth(floats)
    _reset_peak()
    seconds = _strategy_round(strategy, base, 2, nodes)
    peak = _peak_rss_bytes()
    return {
        "seconds": seconds,
        "peak_rss_bytes": peak,
        "group": FOLD_GROUP,
        **first,
        **_limits(before, measure_bandwidth(floats)),
    }


def measure_flower(nodes: int, floats: int) -> dict[str, Any]:
    from flowerbed import keys
    from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

    base = _base(floats)
    aggregate_arrayrecords([_reply(base, i) for i in range(2)], keys.NUM_EXAMPLES)
    replies = [_reply(base, i) for i in range(nodes)]
    before = measure_bandwidth(floats)
    _reset_peak()  # from the replies held, as Flower holds them
    t0 = time.process_time()
    aggregate_arrayrecords(replies, keys.NUM_EXAMPLES)
    seconds = time.process_time() - t0
    peak = _peak_rss_bytes()
    del replies
    return {
        "seconds": seconds,
        "peak_rss_bytes": peak,
        **_limits(before, measure_bandwidth(floats)),
    }


def _limits(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The limit measured around a measurement: both, and the larger."""
    return {
        "limit_before_gbps": before["limit_gbps"],
        "limit_after_gbps": after["limit_gbps"],
        "limit_gbps": max(before["limit_gbps"], after["limit_gbps"]),
    }


def measure_bandwidth(floats: int, repeats: int = 5) -> dict[str, Any]:
    a = _fresh(floats)
    a[:] = np.random.default_rng(0).standard_normal(floats, dtype=np.float32)
    b = _fresh(floats)
    b[:] = 1
    a += b  # fault the pages in before timing
    best = min(_timed_add(a, b) for _ in range(repeats))
    return {
        "seconds": best,
        "bandwidth_gbps": 3 * a.nbytes / best / 1e9,
        "limit_gbps": a.nbytes / best / 1e9,
    }


def _fresh(floats: int) -> np.ndarray:
    """``floats`` float32 in memory of their own, mapped for them and backed
    with huge pages where the kernel allows (``MADV_HUGEPAGE``), as NumPy asks
    for its large arrays: measured on memory that ``malloc`` reuses instead
    (what the aggregation before it freed), the limit came out up to 19% lower
    when the kernel had backed that memory with small pages."""
    region = mmap.mmap(-1, floats * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(region, np.float32)


def _timed_add(a: np.ndarray, b: np.ndarray) -> float:
    t0 = time.process_time()
    a += b
    return time.process_time() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("method", choices=METHODS)
    parser.add_argument("nodes", type=int)
    parser.add_argument("floats", type=int)
    args = parser.parse_args(argv)
    if args.nodes < 1 or args.floats < NUM_ARRAYS:
        parser.error(f"need nodes >= 1 and floats >= {NUM_ARRAYS}")
    if args.method == "bandwidth":
        out = {**measure_bandwidth(args.floats), "peak_rss_bytes": _peak_rss_bytes()}
    else:
        if args.method == "flower":
            out = measure_flower(args.nodes, args.floats)
        elif args.method == "strategy":
            out = measure_strategy(args.nodes, args.floats)
        else:
            group = GROUP if args.method == "grouped" else 1
            out = measure_streaming(args.nodes, args.floats, group)
            out["group"] = group
        out["gbps"] = args.nodes * args.floats * 4 / out["seconds"] / 1e9
        out["of_limit"] = out["gbps"] / out["limit_gbps"]
    out.update(vars(args))  # the measurement names its arguments
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
