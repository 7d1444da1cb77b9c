"""Fixtures shared by the test modules, and the two test lanes.

The integration lane is every test marked ``slow``: real Flower processes
(SuperLink, SuperNodes, Ray), gloo process groups, javac, wheel builds, ExecuTorch
programs and long simulations. Files mark their own tests (``pytestmark`` or
``@pytest.mark.slow``); :data:`INTEGRATION_MODULES` and
:data:`INTEGRATION_TESTS` mark the rest here, so that a test file needs no edit to
change lanes. Everything else is the fast lane (``-m "not slow"``): a new test
lands there unless it is marked or listed. Both lanes run on two pytest-xdist
workers (``-n 2 --dist loadgroup``): tests take their ports from the OS and write
under ``tmp_path``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest
import torch

INTEGRATION_MODULES = frozenset(
    {
        "test_phone_core_java.py",  # javac and JUnit
    }
)
"""Test files whose every test belongs to the integration lane."""

INTEGRATION_TESTS = frozenset(
    {
        # the quick bench: every workload simulated, a page and plots written
        "test_bench.py::test_quick_bench_writes_page_results_and_one_plot_per_workload",
        # worker processes, three fleets evaluated three times
        "test_cluster_selection.py::"
        "test_evaluation_shares_fleets_between_settings_and_workers",
        "test_packaging.py::test_wheel_holds_only_the_flowerbed_namespace",  # pip
    }
)
"""Tests of the integration lane: ``file::function`` (every parametrization) or
``file::function[parameters]`` (one)."""

RAY_MODULES = frozenset(
    {"test_engines_agree.py", "test_run_config.py", "test_strategies_flwr_run.py"}
)
"""Test files that start Ray (Flower's simulation runtime): with ``-n 2 --dist
loadgroup`` they run one at a time, in one worker, never two Ray clusters at once."""


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by the markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the listed modules' and tests' items ``slow`` (the integration lane),
    and the Ray modules' items with one ``xdist_group``."""
    for item in items:
        name = item.path.name
        function = getattr(item, "originalname", item.name)
        if (
            name in INTEGRATION_MODULES
            or f"{name}::{function}" in INTEGRATION_TESTS
            or f"{name}::{item.name}" in INTEGRATION_TESTS
        ):
            item.add_marker(pytest.mark.slow)
        if name in RAY_MODULES:
            item.add_marker(pytest.mark.xdist_group("ray"))


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``-n 2``), one torch thread per worker process: two
    workers on two cores, and tiny models that extra threads only slow down."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


@pytest.fixture(scope="module")
def quiet_single_threaded() -> Iterator[None]:
    """One torch thread and Flower's log at WARNING for the module's tests.

    Tiny models on a shared 2-core machine: one torch thread is far faster,
    and the strategies' per-round INFO lines would drown the test output.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    yield
    torch.set_num_threads(threads)
