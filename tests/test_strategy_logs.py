"""The log a Flower user reads: Flower's own lines and summary, well-formed trees.

A flowerbed strategy logs every line Flower's ``Strategy.start``/``FedAvg`` log (the
start-up tree, ``[ROUND r/N]``, the sampling and aggregation counts, the aggregated
records, the final summary), adds its own beside them, and prints clock times
relative to the start of the run.
"""

from __future__ import annotations

import logging
import re

import pytest
from flowerbed.strategies import (
    ClusterSelection,
    DeadlineFedAvg,
    FedBuff,
    RuntimeWeightedFedAvg,
)
from flowerbed.strategies.round_metrics import ROUND_CLOCK_S
from flwr.app import ArrayRecord, MetricRecord
from flwr.serverapp.strategy import Strategy
from test_strategies_fakes import FakeGrid, node, weights

STRATEGIES = {
    "ClusterSelection": lambda: ClusterSelection(strategy=RuntimeWeightedFedAvg()),
    "RuntimeWeightedFedAvg": lambda: RuntimeWeightedFedAvg(),
    "DeadlineFedAvg": lambda: DeadlineFedAvg(deadline_s=5.0, adaptive_deadline=True),
    "FedBuff": lambda: FedBuff(buffer_size=2),
}

FLOWER_LINES = [
    "Starting {name} strategy:",
    "\t├── Number of rounds: 2",
    "\t├── ArrayRecord (0.00 MB)",
    "\t├── ConfigRecord (train): (empty!)",
    "\t├── ConfigRecord (evaluate): (empty!)",
    "Initial global evaluation results: {'accuracy': 0.25}",
    "[ROUND 1/2]",
    "configure_train: Sampled 2 nodes (out of 2)",
    "aggregate_train: Received 2 results and 0 failures",
    "\t└──> Aggregated MetricRecord: ",
    "configure_evaluate: Sampled 2 nodes (out of 2)",
    "aggregate_evaluate: Received 2 results and 0 failures",
    "Global evaluation",
    "\t└──> MetricRecord: {'accuracy': 0.25}",
    "[ROUND 2/2]",
    "Strategy execution finished in ",
    "Final results:",
    "\tAggregated ClientApp-side Train Metrics:",
    "\tAggregated ClientApp-side Evaluate Metrics:",
    "\tServerApp-side Evaluate Metrics:",
]
"""Flower 1.41's lines (``Strategy.start``, ``FedAvg``), in the order it logs them."""


def run(
    name: str, caplog: pytest.LogCaptureFixture, start_at: float = 0.0
) -> list[str]:
    caplog.set_level(logging.INFO, logger="flwr")
    grid = FakeGrid({1: node(1.0, seconds=1.0), 2: node(1.0, seconds=2.0)})
    grid.clock.t = start_at

    def central(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        return MetricRecord({"accuracy": 0.25})

    strategy: Strategy = STRATEGIES[name]()
    strategy.start(grid, weights(), num_rounds=2, evaluate_fn=central)
    return [r.getMessage() for r in caplog.records if r.name == "flwr"]


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_flowers_lines_appear_in_flowers_order(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    lines = run(name, caplog)
    expected_lines = FLOWER_LINES
    if name == "FedBuff":
        # Asynchronous: a version's federated evaluation is aggregated while the
        # next version trains, so that line comes later than in Flower's loop.
        late = "aggregate_evaluate: Received 2 results and 0 failures"
        assert late in lines
        expected_lines = [line for line in FLOWER_LINES if line != late]
    position = 0
    for expected in expected_lines:
        wanted = expected.replace("{name}", name)
        found = next(
            (i for i in range(position, len(lines)) if lines[i].startswith(wanted)),
            None,
        )
        assert found is not None, f"missing, or out of order: {wanted!r}"
        position = found + 1


def tree(lines: list[str]) -> list[str]:
    """The summary tree: lines from 'Starting' up to the first blank line."""
    start = next(i for i, line in enumerate(lines) if line.startswith("Starting"))
    end = lines.index("", start)
    return lines[start + 1 : end]


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_summary_tree_is_well_formed(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    # One top level ("\t├──"/"\t└──"): only its last entry uses └──; children of
    # a ├── branch hang on "\t│\t", children of the └── branch on "\t\t"; among
    # siblings only the last uses └──.
    lines = tree(run(name, caplog))
    top = [i for i, line in enumerate(lines) if re.match(r"\t[├└]──", line)]
    assert lines[top[-1]].startswith("\t└──")
    assert all(lines[i].startswith("\t├──") for i in top[:-1])
    for k, i in enumerate(top):
        end = top[k + 1] if k + 1 < len(top) else len(lines)
        children = lines[i + 1 : end]
        indent = "\t\t" if lines[i].startswith("\t└──") else "\t│\t"
        assert all(c.startswith(indent) for c in children), children
        glyphs = [c[len(indent)] for c in children]
        assert glyphs == ["├"] * (len(glyphs) - 1) + ["└"] * bool(glyphs), children


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_clock_times_count_from_the_start_of_the_run(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The clock reads 1e6 s when the run starts (a wall clock reads seconds since
    # boot): the log and clock-s say seconds since the start.
    caplog.set_level(logging.INFO, logger="flwr")
    lines = run(name, caplog, start_at=1e6)
    times = [float(t) for line in lines for t in re.findall(r"t=([\d.]+)s", line)]
    assert times and all(0 < t < 100 for t in times)
    assert not any("1000000" in line for line in lines)


def test_clock_s_metric_is_relative_to_the_run_start() -> None:
    grid = FakeGrid({1: node(1.0, seconds=1.0), 2: node(1.0, seconds=2.0)})
    grid.clock.t = 1e6
    result = RuntimeWeightedFedAvg(fraction_evaluate=0.0).start(
        grid, weights(), num_rounds=2
    )
    assert [m[ROUND_CLOCK_S] for m in result.train_metrics_clientapp.values()] == [
        2.0,
        4.0,
    ]
