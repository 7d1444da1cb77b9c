"""Node-task throughput of the in-process engine, one process per measurement.

Run as ``python -m flowerbed.bench.throughput MODE POPULATION COHORT ROUNDS``;
prints one JSON line. ``MODE`` is how node tasks use the machine
(:func:`flowerbed.sims.scenario.run_scenario`):

- ``per-node``: one ClientApp call per message, one after another (``batch=False``),
  as before batching existed;
- ``batched``: a round's nodes trained as one batched computation, in this process;
- ``workers``: batched, over one worker process per core this process may use.

The scenario is the default one (LeNet-5 on digits, ``mixed`` fleet, FedAvg, 10
local steps of 16 samples) with ``POPULATION`` devices of which ``COHORT`` are
sampled per round (``fraction-train``), no dropouts, seed 1. A warm-up run
(imports, data, first use of each code path) is not measured. CPU seconds are
this process's plus its reaped children's (the workers), user + system.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from typing import Any

MODES = ("per-node", "batched", "workers")


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its reaped children."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def scenario(population: int, cohort: int, rounds: int) -> dict[str, Any]:
    """The measured run config."""
    return {
        "num-nodes": population,
        "fraction-train": cohort / population,
        "num-rounds": rounds,
        "dropout": 0.0,
        "seed": 1,
    }


def measure(mode: str, population: int, cohort: int, rounds: int) -> dict[str, Any]:
    from flowerbed.sims.scenario import default_workers, run_scenario

    options = {
        "per-node": {"batch": False, "workers": 0},
        "batched": {"batch": True, "workers": 0},
        "workers": {"batch": True, "workers": default_workers()},
    }[mode]
    warm = scenario(population, min(cohort, 10), 1)
    run_scenario(warm, write=False, **options)  # type: ignore[arg-type]
    cpu0, wall0 = cpu_seconds(), time.monotonic()
    outcome = run_scenario(
        scenario(population, cohort, rounds),
        write=False,
        **options,  # type: ignore[arg-type]
    )
    cpu, wall = cpu_seconds() - cpu0, time.monotonic() - wall0
    tasks = int(outcome.results["trained_tasks"])
    walls = [float(r["wall_time_s"]) for r in outcome.results["rounds"]]
    return {
        "tasks": tasks,
        "cpu_s": cpu,
        "wall_s": wall,
        "tasks_per_cpu_s": tasks / cpu,
        "wall_s_per_round": walls[-1] / len(walls),
        "workers": options["workers"],
        "final_accuracy": outcome.results["final_accuracy"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("population", type=int)
    parser.add_argument("cohort", type=int)
    parser.add_argument("rounds", type=int)
    args = parser.parse_args(argv)
    if not 1 <= args.cohort <= args.population or args.rounds < 1:
        parser.error("need 1 <= cohort <= population and rounds >= 1")
    out = measure(args.mode, args.population, args.cohort, args.rounds)
    out.update(
        mode=args.mode,
        population=args.population,
        cohort=args.cohort,
        rounds=args.rounds,
    )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
