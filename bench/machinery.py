"""What the machinery costs: aggregation, engines, client-side metering, gateway.

Wall-clock measurements, so they depend on this machine and on its load at the
time; the report prints both beside them. Each part returns plain JSON-able data.

- :func:`aggregation_cost` (issue 4, 3a): streaming vs Flower's list-based
  aggregation for a ResNet-50-sized update, one fresh process per point
  (:mod:`flowerbed.bench.aggregation`), with the memory bandwidth as the limit.
- :func:`engine_wallclock` (3b): wall seconds per round of the in-process engine
  and of ``flwr run`` on Flower's simulation runtime (Ray), same scenario.
- :func:`client_overhead` (3c): what :func:`flowerbed.clients.timed.timed_train`
  and :func:`flowerbed.clients.telemetry.read_telemetry` add to training.
- :func:`gateway_memory` (issue 6, 3): gateway RSS per connected phone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MEMORY_HEADROOM = 0.75
"""Share of the memory available at the start a measurement may plan to use."""
PROCESS_OVERHEAD_BYTES = 600 * 2**20
"""Interpreter, numpy, flwr and torch imports of one measuring process (measured
~0.4-0.5 GB; rounded up)."""


def available_memory_bytes() -> int:
    """``MemAvailable`` from /proc/meminfo."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def planned_bytes(method: str, nodes: int, floats: int) -> int:
    """Memory a measurement is expected to need, from its algorithm.

    Streaming holds the base, one reply, its float64 delta and the float64 sum
    (4 + 4 + 8 + 8 bytes per float); Flower's list holds every reply plus the
    float32 result and a temporary (4 x (nodes + 3)).
    """
    per_float = 24 if method == "streaming" else 4 * (nodes + 3)
    return PROCESS_OVERHEAD_BYTES + per_float * floats


def _run_json(args: Sequence[str], timeout: float) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {proc.stderr.strip()[-2000:]}")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def aggregation_cost(
    node_counts: Sequence[int], floats: int, timeout: float = 900.0
) -> dict[str, Any]:
    """Throughput and peak RSS of both aggregation paths at each node count.

    A point whose :func:`planned_bytes` exceeds ``MEMORY_HEADROOM`` of the memory
    available when the part starts is not run; it is listed with the reason.
    """
    module = "flowerbed.bench.aggregation"
    available = available_memory_bytes()
    budget = int(MEMORY_HEADROOM * available)
    copy = _run_json([module, "copy", "1", str(floats)], timeout)
    points: list[dict[str, Any]] = []
    for nodes in node_counts:
        for method in ("streaming", "flower"):
            need = planned_bytes(method, nodes, floats)
            if need > budget:
                points.append(
                    {
                        "method": method,
                        "nodes": nodes,
                        "floats": floats,
                        "skipped": f"needs ~{need / 1e9:.1f} GB, more than "
                        f"{MEMORY_HEADROOM:.0%} of the {available / 1e9:.1f} GB "
                        "available at the start",
                    }
                )
                continue
            points.append(_run_json([module, method, str(nodes), str(floats)], timeout))
    return {
        "floats": floats,
        "update_bytes": 4 * floats,
        "memory_available_bytes": available,
        "memory_budget_bytes": budget,
        "copy_gbps": copy["copy_gbps"],
        "points": points,
    }


# --- (b) in-process engine vs flwr run (Ray) ------------------------------------------


def _free_port() -> int:
    from flowerbed.clients.bridge.procs import free_port

    return free_port()


def _per_round_s(rounds: Sequence[dict[str, Any]]) -> float | None:
    """Mean wall seconds between consecutive rounds' ends (startup left out)."""
    walls = [float(r["wall_time_s"]) for r in rounds]
    if len(walls) < 2:
        return None
    return (walls[-1] - walls[0]) / (len(walls) - 1)


def _wait_healthy(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"flower-superlink exited with {proc.returncode}")
        url = f"http://127.0.0.1:{port}/health"
        with (
            contextlib.suppress(urllib.error.URLError, OSError),
            urllib.request.urlopen(url, timeout=1.0) as answer,
        ):
            if answer.status == 200:
                return
        time.sleep(0.3)
    raise TimeoutError(f"SuperLink on 127.0.0.1:{port} not healthy after {timeout} s")


def _stop_group(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM the process's group (it leads its own session), then SIGKILL."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def _config_arg(run_config: dict[str, Any]) -> str:
    parts = []
    for key, value in run_config.items():
        text = f'"{value}"' if isinstance(value, str) else repr(value)
        parts.append(f"{key}={text}")
    return " ".join(parts)


def flwr_run_rounds(
    run_config: dict[str, Any], app_dir: Path, workdir: Path, timeout: float = 900.0
) -> dict[str, Any]:
    """Run ``run_config`` with ``flwr run`` on a private SuperLink in simulation mode.

    The SuperLink (own process group, 127.0.0.1, free port, ``FLWR_HOME`` in
    ``workdir``) is stopped by its pid and group whatever happens.
    """
    home = workdir / "flwr-home"
    home.mkdir(parents=True, exist_ok=True)
    out_dir = (workdir / "runs").resolve()
    port = _free_port()
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "bench"\n\n[superlink.bench]\n'
        f'address = "127.0.0.1:{port}"\ninsecure = true\n'
        f"options.num-supernodes = {int(run_config['num-nodes'])}\n"
    )
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    }
    log = workdir / "superlink.log"
    with open(log, "wb") as fh:
        link = subprocess.Popen(
            [
                "flower-superlink",
                "--insecure",
                "--simulation",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--disable-runtime-dependency-installation",
            ],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        _wait_healthy(port, link, 120.0)
        config = {**run_config, "output-dir": str(out_dir)}
        started = time.monotonic()
        run = subprocess.run(
            [
                "flwr",
                "run",
                str(app_dir),
                "bench",
                "--stream",
                "-c",
                _config_arg(config),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
            check=False,
        )
        total_s = time.monotonic() - started
        folders = sorted(out_dir.glob("*/results.json")) if out_dir.exists() else []
        if run.returncode != 0 or not folders:
            raise RuntimeError(
                f"flwr run failed ({run.returncode}): {run.stdout[-1500:]}"
                f"{run.stderr[-1500:]}"
            )
        results = json.loads(folders[-1].read_text())
    finally:
        _stop_group(link)
    return {
        "engine": results["engine"],
        "total_s": total_s,
        "per_round_s": _per_round_s(results["rounds"]),
        "final_accuracy": results["final_accuracy"],
    }


def engine_wallclock(run_config: dict[str, Any], app_dir: Path) -> dict[str, Any]:
    """Wall seconds per round on both engines for the same scenario."""
    from flowerbed.sims.scenario import run_scenario

    started = time.monotonic()
    local = run_scenario(run_config, write=False)
    local_total = time.monotonic() - started
    out: dict[str, Any] = {
        "scenario": run_config,
        "in_process": {
            "total_s": local_total,
            "per_round_s": _per_round_s(local.results["rounds"]),
            "final_accuracy": local.results["final_accuracy"],
        },
    }
    with tempfile.TemporaryDirectory(prefix="flowerbed-bench-ray-") as tmp:
        try:
            out["flwr_run"] = flwr_run_rounds(run_config, app_dir, Path(tmp))
        except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as err:
            out["flwr_run"] = {"error": str(err)[-2000:]}
    return out


# --- (c) client-side overhead ---------------------------------------------------------


def client_overhead(repeats: int = 30, steps: int = 10) -> dict[str, Any]:
    """Cost of timed training and telemetry, as fractions of one training step.

    For each repeat, the same task (LeNet-5 on ``digits``, ``steps`` SGD steps of
    16 samples, same seed) runs once through plain
    :func:`flowerbed.clients.training.train_steps` and once through
    :func:`flowerbed.clients.timed.timed_train` (deadline checks before every step,
    power sampler, temperature read at the end); medians are compared. A full
    :func:`flowerbed.clients.telemetry.read_telemetry` (what a board reads for a
    profiling query) is timed separately. Fractions are per training step.
    """
    import torch
    from flowerbed.clients.telemetry import read_telemetry
    from flowerbed.clients.timed import timed_train
    from flowerbed.clients.training import train_steps
    from flowerbed.data import load_dataset
    from flowerbed.models import build_model

    torch.set_num_threads(1)
    data = load_dataset("digits")
    x, y = data.x_train[:256], data.y_train[:256]
    shape = (data.in_channels, data.image_size, data.num_classes)
    model = build_model("lenet", *shape)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    plain, timed, telemetry = [], [], []
    for i in range(repeats):
        model.load_state_dict(state)
        t0 = time.perf_counter()
        train_steps(model, x, y, steps=steps, batch_size=16, lr=0.05, seed=i)
        plain.append(time.perf_counter() - t0)
        model.load_state_dict(state)
        t0 = time.perf_counter()
        timed_train(model, x, y, steps=steps, batch_size=16, lr=0.05, seed=i)
        timed.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        read_telemetry()
        telemetry.append(time.perf_counter() - t0)
    step_s = statistics.median(plain) / steps
    task_overhead = statistics.median(timed) - statistics.median(plain)
    return {
        "model": "lenet",
        "dataset": "digits",
        "batch_size": 16,
        "steps_per_task": steps,
        "repeats": repeats,
        "step_s": step_s,
        "timed_task_overhead_s": task_overhead,
        "timed_overhead_per_step_fraction": task_overhead / steps / step_s,
        "read_telemetry_s": statistics.median(telemetry),
        "read_telemetry_fraction_of_step": statistics.median(telemetry) / step_s,
    }


# --- (d) gateway memory ---------------------------------------------------------------


def gateway_memory(phones: int) -> dict[str, Any]:
    """Gateway RSS per connected phone
    (:func:`flowerbed.clients.bridge.scale.measure_memory_per_phone`)."""
    from flowerbed.clients.bridge.scale import measure_memory_per_phone

    report = measure_memory_per_phone(phones)
    return {
        "phones": report.phones,
        "baseline_bytes": report.baseline_bytes,
        "loaded_bytes": report.loaded_bytes,
        "per_phone_bytes": report.per_phone_bytes,
        "connect_s": report.connect_s,
    }


# --- issue 7: cluster selection -------------------------------------------------------


SENSITIVITY_GAIN_ERROR = 0.01
"""Power-meter calibration error of the sensitivity run: an INA219-class shunt
monitor's specified accuracy (the default run assumes 0.03)."""


def selection(
    num_fleets: int, seed: int, truth_rounds: int, num_rounds: int = 100
) -> dict[str, Any]:
    """Cluster-selection accuracy over random fleets
    (:func:`flowerbed.bench.selection_eval.evaluate_selection`).

    Also the energy and EDP objectives again with power sensors calibrated to
    :data:`SENSITIVITY_GAIN_ERROR` (``sensitivity``): the calibration error is
    the one no profiling can shrink.
    """
    from flowerbed.bench.selection_eval import evaluate_selection

    result = evaluate_selection(
        num_fleets=num_fleets,
        seed=seed,
        truth_rounds=truth_rounds,
        num_rounds=num_rounds,
    )
    out = {"source": "flowerbed.bench.selection_eval.evaluate_selection", **result}
    meter = evaluate_selection(
        num_fleets=num_fleets,
        seed=seed,
        truth_rounds=truth_rounds,
        num_rounds=num_rounds,
        power_gain_error=SENSITIVITY_GAIN_ERROR,
        objectives=("energy", "edp"),
    )
    out["sensitivity"] = {
        "power_gain_error": SENSITIVITY_GAIN_ERROR,
        "objectives": meter["objectives"],
    }
    return out
