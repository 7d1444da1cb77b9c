"""Node-task throughput of the in-process engine, one process per measurement.

Run as ``python -m flowerbed.bench.throughput MODE POPULATION COHORT ROUNDS``;
prints one JSON line. ``MODE`` is how node tasks use the machine
(:func:`flowerbed.sims.scenario.run_scenario`):

- ``legacy``: the per-node path as it was before batching, reproduced here as
  the baseline: one ClientApp call per message that
  builds and He-initialises a fresh model and decodes the round's arrays for
  every message (:func:`legacy_train`);
- ``per-node``: one ClientApp call per message, one after another (``batch=False``),
  on one cached model per process, as the per-node path runs today;
- ``batched``: a round's nodes trained as one batched computation, in this
  process, on the default path (the numba kernels,
  :mod:`flowerbed.sims.numba_kernels`: ``FLOWERBED_C_KERNELS`` and
  ``FLOWERBED_NUMBA_KERNELS`` unset here);
- ``batched-onednn``: the same with the numba kernels off
  (``FLOWERBED_NUMBA_KERNELS=0``: PyTorch's oneDNN);
- ``batched-c``: the same opted in to the compiled C kernels
  (:mod:`flowerbed.sims.conv_kernels`, ``FLOWERBED_C_KERNELS=1``);
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
import logging
import os
import resource
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flowerbed.sims.scenario import RunOutcome
    from flwr.app import Context, Message

MODES = ("legacy", "per-node", "batched", "batched-onednn", "batched-c", "workers")


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


def legacy_train(message: Message, context: Context) -> Message:
    """A train task as the per-node path ran it before batching (the baseline).

    The same plan, training and reply as :func:`flowerbed.sims.node.train`, with
    the per-message costs that path had and later changes removed: a fresh model
    built (and He-initialised) for every message; the message's arrays decoded
    for every node although the whole round shares them; the run config parsed
    and checked and the node's data gathered for every message (now cached per
    process); the reply's arrays encoded by ``np.save`` (now
    :func:`flowerbed.arrays.encode_array`).
    """
    from flowerbed import keys
    from flowerbed.models import build_model
    from flowerbed.sims.config import Scenario
    from flowerbed.sims.node import (
        DEVICE_KEY,
        cached_dataset,
        no_step_reply,
        node_setup,
        plan_train,
        train_reply,
    )
    from flwr.app import ArrayRecord

    config = Scenario.from_run_config(context.run_config)  # uncached, as then
    node_setup(
        config,
        int(context.node_config["partition-id"]),
        int(context.node_config["num-partitions"]),
        str(context.node_config.get(DEVICE_KEY, "")),
    )
    plan = plan_train(message, context)
    if plan.steps == 0:
        return no_step_reply(message, plan)
    s = plan.scenario
    data = cached_dataset(s.dataset, s.data_dir)
    model = build_model(s.model, data.in_channels, data.image_size, data.num_classes)
    model.load_state_dict(
        message.content.array_records[keys.ARRAYS].to_torch_state_dict()
    )
    stats = plan.train(model)
    return train_reply(message, plan, stats, ArrayRecord(model.state_dict()))


def _run(mode: str, run_config: dict[str, Any]) -> RunOutcome:
    from flowerbed.sims.config import Scenario
    from flowerbed.sims.node import evaluate_local, profile
    from flowerbed.sims.scenario import build_fleet_grid, run_server
    from flwr.clientapp import ClientApp

    options = {
        "legacy": {"batch": False, "workers": 0},
        "per-node": {"batch": False, "workers": 0},
        "batched": {"batch": True, "workers": 0},
        "batched-onednn": {"batch": True, "workers": 0},
        "batched-c": {"batch": True, "workers": 0},
        "workers": {"batch": True, "workers": _workers(mode)},
    }[mode]
    scenario = Scenario.from_run_config(run_config)
    grid = build_fleet_grid(scenario.to_run_config(), **options)  # type: ignore[arg-type]
    if mode == "legacy":
        app = ClientApp()
        app.train()(legacy_train)
        app.evaluate()(evaluate_local)
        app.query()(profile)
        grid.client_app = app
    try:
        return run_server(grid, scenario, engine="in-process", write=False)
    finally:
        grid.close()


def _workers(mode: str) -> int:
    from flowerbed.sims.scenario import default_workers

    return default_workers() if mode == "workers" else 0


def measure(mode: str, population: int, cohort: int, rounds: int) -> dict[str, Any]:
    from flowerbed.sims.conv_kernels import ENABLE_ENV
    from flowerbed.sims.numba_kernels import ENABLE_ENV as NUMBA_ENV

    # the C kernels for batched-c only, the numba ones off for batched-onednn
    # only (workers inherit the choice)
    os.environ.pop(ENABLE_ENV, None)
    os.environ.pop(NUMBA_ENV, None)
    if mode == "batched-c":
        os.environ[ENABLE_ENV] = "1"
    elif mode == "batched-onednn":
        os.environ[NUMBA_ENV] = "0"
    # Flower's INFO log off, as `flowerbed sim` runs (without --verbose); after
    # importing Flower, whose logger module sets its level when imported
    import flwr.supercore.logger  # noqa: F401

    logging.getLogger("flwr").setLevel(logging.WARNING)
    _run(mode, scenario(population, min(cohort, 10), 1))  # warm-up
    cpu0, wall0 = cpu_seconds(), time.monotonic()
    outcome = _run(mode, scenario(population, cohort, rounds))
    cpu, wall = cpu_seconds() - cpu0, time.monotonic() - wall0
    tasks = int(outcome.results["trained_tasks"])
    walls = [float(r["wall_time_s"]) for r in outcome.results["rounds"]]
    return {
        "tasks": tasks,
        "cpu_s": cpu,
        "wall_s": wall,
        "tasks_per_cpu_s": tasks / cpu,
        "wall_s_per_round": walls[-1] / len(walls),
        "workers": _workers(mode),
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
    out.update(vars(args))  # the measurement names its arguments
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
