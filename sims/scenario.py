"""Run a scenario: build the fleet, the strategy and the recorder, train, write outputs.

The same :func:`run_server` is the body of the ``flwr run`` ServerApp
(``flowerbed.sims.apps``) and of ``flowerbed sim`` on the in-process engine.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flowerbed import keys
from flowerbed.models import build_model
from flowerbed.sims.config import Scenario
from flowerbed.sims.engine import FleetGrid, SimNode
from flowerbed.sims.node import DEVICE_KEY, make_client_app, train_batch
from flowerbed.sims.notices import our_settings
from flowerbed.sims.outputs import check_output_dir, summarise, write_run_folder
from flowerbed.sims.population import cached_dataset, check_population
from flowerbed.sims.recorder import RoundRecord, RunRecorder
from flowerbed.strategies.options import RECOMMENDED_DEADLINES
from flwr.app import ArrayRecord, ConfigRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, FedProx, Strategy

log = logging.getLogger(__name__)

StrategyFactory = Callable[[Scenario], Strategy]


def flower_args(s: Scenario) -> dict[str, Any]:
    """FedAvg's arguments for a scenario: central evaluation only, no waiting room."""
    return {
        "fraction_train": s.fraction_train,
        "fraction_evaluate": 0.0,
        "min_train_nodes": 1,
        "min_available_nodes": 1,
    }


def flowerbed_strategy(name: str, **options: Any) -> StrategyFactory:
    """Factory for a flowerbed strategy; ``options`` map scenario fields to kwargs."""

    def factory(s: Scenario) -> Strategy:
        from flowerbed import strategies

        cls = getattr(strategies, name)
        kwargs = {k: (v(s) if callable(v) else v) for k, v in options.items()}
        return cls.from_settings(**flower_args(s), seed=s.seed, **kwargs)  # type: ignore[no-any-return]

    return factory


STRATEGIES: dict[str, StrategyFactory] = {
    "fedavg": lambda s: FedAvg(**flower_args(s)),
    "fedprox": lambda s: FedProx(proximal_mu=s.proximal_mu, **flower_args(s)),
    "runtime-weighted": flowerbed_strategy("RuntimeWeightedFedAvg"),
    # deadline-s > 0: that fixed deadline; 0: the recommended adaptive one
    # (RECOMMENDED_DEADLINES, DeadlineFedAvg docs)
    "deadline": flowerbed_strategy(
        "DeadlineFedAvg",
        deadlines=lambda s: replace(
            RECOMMENDED_DEADLINES,
            deadline_s=s.deadline_s or None,
            adaptive_deadline=s.deadline_s == 0,
        ),
    ),
    "fedbuff": flowerbed_strategy("FedBuff"),
}
"""Strategy of each run-config ``strategy`` name, built from the scenario."""


def build_strategy(scenario: Scenario) -> Strategy:
    """The scenario's strategy, without Flower's notices about the settings
    flowerbed chose for it (:func:`~flowerbed.sims.notices.our_settings`)."""
    with our_settings():
        return STRATEGIES[scenario.strategy](scenario)


@dataclass
class RunOutcome:
    """What a finished simulation produced."""

    records: list[RoundRecord]
    results: dict[str, Any]
    run_dir: Path | None
    problem: str | None = None
    """Why the run trained nothing (no update ever changed the global model), else
    None; callers exit non-zero with it."""


def no_update_reason(
    records: Sequence[RoundRecord],
    initial: Sequence[np.ndarray],
    final: ArrayRecord | None,
) -> str | None:
    """Why no update was applied, or None if the global model changed.

    The final model equal to the initial one, bit for bit, means no update was
    folded in (an SGD update that changes nothing does not happen in practice).
    """
    after = final.to_numpy_ndarrays() if final is not None else []
    # Flower's Strategy.start leaves Result.arrays empty until an aggregation
    # returns arrays; ours return the last global model.
    if after and (
        len(after) != len(initial)
        or any(
            a.shape != b.shape or not np.array_equal(a, b)
            for a, b in zip(initial, after, strict=True)
        )
    ):
        return None
    failed = sum(len(r.failed) for r in records)
    replied = sum(len(r.participants) for r in records)
    if replied:
        why = f"{replied} replies arrived but the strategy applied none"
    elif failed:
        why = f"all {failed} train tasks failed"
    else:
        why = "no successful train reply arrived"
    return (
        f"no update was applied ({len(records)} round(s) completed): {why}; the "
        "global model is the initial one (check dropout, deadline-s and "
        "round-timeout-s)"
    )


def run_server(
    grid: Grid,
    scenario: Scenario,
    *,
    strategy: Strategy | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
    engine: str = "flower-simulation",
    write: bool = True,
) -> RunOutcome:
    """Train ``scenario`` over ``grid`` with ``strategy`` (default: the scenario's).

    Seeds Python's, NumPy's and torch's generators from the scenario so Flower's own
    node sampling and the model's initial weights repeat. Only the output folder
    and the population's data are checked here: ``flowerbed sim`` and the ServerApp
    run every check first (:func:`flowerbed.sims.preflight.preflight`).
    """
    num_connected = len(list(grid.get_node_ids()))
    if num_connected != scenario.num_nodes:
        log.warning(
            "the federation has %d nodes, the run config asks for num-nodes=%d: "
            "simulating %d (set num-supernodes to match)",
            num_connected,
            scenario.num_nodes,
            num_connected,
        )
        scenario = replace(scenario, num_nodes=num_connected)
    if write:
        check_output_dir(scenario.output_dir)  # before anything trains
    random.seed(scenario.seed)
    np.random.seed(scenario.seed)
    torch.manual_seed(scenario.seed)
    data = cached_dataset(scenario.dataset, scenario.data_dir)
    check_population(
        len(data.y_train), scenario.num_nodes, scenario.partition, scenario.dataset
    )
    model = build_model(
        scenario.model, data.in_channels, data.image_size, data.num_classes
    )
    strategy = strategy if strategy is not None else build_strategy(scenario)
    recorder = RunRecorder(grid, scenario.model, data, on_round)
    train_config = ConfigRecord(
        {
            keys.LEARNING_RATE: scenario.learning_rate,
            keys.LOCAL_STEPS: scenario.local_steps,
            keys.BATCH_SIZE: scenario.batch_size,
        }
    )
    if scenario.deadline_s > 0:
        train_config[keys.DEADLINE_S] = scenario.deadline_s
    initial_arrays = ArrayRecord(model.state_dict())
    initial = initial_arrays.to_numpy_ndarrays()  # a copy the strategy cannot touch
    result = strategy.start(
        grid=recorder.grid,
        initial_arrays=initial_arrays,
        num_rounds=scenario.num_rounds,
        timeout=scenario.round_timeout_s,
        train_config=train_config,
        evaluate_fn=recorder.evaluate_fn,
    )
    results = summarise(
        scenario.to_run_config(),
        recorder.records,
        recorder.initial_accuracy,
        engine,
        recorder.error_summary(),
    )
    run_dir = (
        write_run_folder(scenario.output_dir, results, recorder.records)
        if write
        else None
    )
    problem = no_update_reason(recorder.records, initial, result.arrays)
    return RunOutcome(recorder.records, results, run_dir, problem)


def build_fleet_grid(
    run_config: Mapping[str, Any],
    devices: Sequence[str] | None = None,
    *,
    batch: bool = True,
    workers: int = 0,
) -> FleetGrid:
    """An in-process fleet for ``run_config``.

    ``devices`` pins each node's device class by name (``flowerbed.sims.devices``),
    or ``"offline"`` for a node that never answers; by default the scenario's fleet
    mix decides. ``batch`` trains the nodes of a round as one batched computation
    (:func:`flowerbed.sims.node.train_batch`; False: one ClientApp call per node);
    ``workers`` > 1 spreads them over that many processes (:class:`FleetGrid`).
    Call the grid's ``close()`` when done with it.
    """
    scenario = Scenario.from_run_config(run_config)
    n = len(devices) if devices is not None else scenario.num_nodes
    nodes = []
    for i in range(n):
        node_config: dict[str, bool | float | int | str] = {
            "partition-id": i,
            "num-partitions": n,
        }
        if devices is not None:
            node_config[DEVICE_KEY] = devices[i]
        nodes.append(SimNode(node_id=1000 + i, node_config=node_config))
    config = scenario.to_run_config()
    config["num-nodes"] = n
    return FleetGrid(
        make_client_app(raise_dropouts=True),
        nodes,
        config,
        batch_train=train_batch if batch or workers > 1 else None,
        workers=workers,
    )


def default_workers() -> int:
    """Worker processes for ``flowerbed sim``: one per core this process may use."""
    return (
        len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else (os.cpu_count() or 1)
    )


def run_scenario(
    run_config: Mapping[str, Any],
    *,
    strategy: Strategy | None = None,
    devices: Sequence[str] | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
    write: bool = True,
    batch: bool = True,
    workers: int = 0,
) -> RunOutcome:
    """Run a whole scenario on the in-process engine (what ``flowerbed sim`` does).

    ``batch`` and ``workers`` choose how node tasks use the machine
    (:func:`build_fleet_grid`); they change the speed, not the result (beyond
    float rounding).
    """
    scenario = Scenario.from_run_config(run_config)
    grid = build_fleet_grid(
        scenario.to_run_config(), devices, batch=batch, workers=workers
    )
    if devices is not None:
        scenario = replace(scenario, num_nodes=len(devices))
    try:
        return run_server(
            grid,
            scenario,
            strategy=strategy,
            on_round=on_round,
            engine="in-process",
            write=write,
        )
    finally:
        grid.close()
