"""The throughput part's modes: which kernels each runs on, and the ratios it
reports between them."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from flowerbed.bench import machinery, throughput
from flowerbed.sims.conv_kernels import ENABLE_ENV
from flowerbed.sims.numba_kernels import ENABLE_ENV as NUMBA_ENV


@pytest.mark.parametrize(
    ("mode", "opted_in"),
    [
        ("batched", (None, None)),
        ("batched-onednn", (None, "0")),
        ("batched-c", ("1", None)),
        ("per-node", (None, None)),
        ("legacy", (None, None)),
    ],
)
def test_only_batched_c_runs_opted_in_to_the_c_kernels(
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    opted_in: tuple[str | None, str | None],
) -> None:
    """Which kernels each mode runs on: (``FLOWERBED_C_KERNELS``,
    ``FLOWERBED_NUMBA_KERNELS``) as its runs see them."""
    monkeypatch.setenv(ENABLE_ENV, "1")  # a user's settings do not leak in
    monkeypatch.setenv(NUMBA_ENV, "0")
    seen: list[tuple[str | None, str | None]] = []

    def run(mode: str, run_config: dict[str, Any]) -> SimpleNamespace:
        seen.append((os.environ.get(ENABLE_ENV), os.environ.get(NUMBA_ENV)))
        rounds = [{"wall_time_s": 0.5}]
        return SimpleNamespace(
            results={"trained_tasks": 4, "rounds": rounds, "final_accuracy": 0.5}
        )

    monkeypatch.setattr(throughput, "_run", run)
    out = throughput.measure(mode, 2, 2, 1)
    assert seen == [opted_in, opted_in]  # the warm-up and the measured run
    assert out["tasks"] == 4


def test_ratios_between_the_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    rates = {"legacy": 50.0, "per-node": 100.0, "batched": 400.0, "batched-c": 500.0}

    def run_json(args: list[str], timeout: float) -> dict[str, Any]:
        mode, n = args[1], int(args[2])
        return {"mode": mode, "cohort": n, "tasks_per_cpu_s": rates[mode] * n}

    monkeypatch.setattr(machinery, "_run_json", run_json)
    out = machinery.node_throughput((10, 100), 2, Path("."), repeats=1, modes=rates)
    assert out["speedup"] == {"10": 4.0, "100": 4.0}
    assert out["speedup_vs_legacy"] == {"10": 8.0, "100": 8.0}
    assert out["c_speedup"] == {"10": 5.0, "100": 5.0}
    assert out["c_speedup_vs_legacy"] == {"10": 10.0, "100": 10.0}
    assert out["default_of_c"] == {"10": 0.8, "100": 0.8}
    del rates["batched-c"]
    out = machinery.node_throughput((10,), 2, Path("."), repeats=1, modes=rates)
    assert "c_speedup" not in out and "default_of_c" not in out
