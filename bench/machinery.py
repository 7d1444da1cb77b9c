"""What the machinery costs: aggregation, engines, client-side metering, gateway.

Wall-clock measurements, so they depend on this machine and on its load at the
time; the report prints both beside them. Each part returns plain JSON-able data.

- :func:`aggregation_cost`: streaming vs Flower's list-based
  aggregation for a ResNet-50-sized update, one fresh process per point
  (:mod:`flowerbed.bench.aggregation`), with the memory bandwidth as the limit.
- :func:`node_throughput`: node-tasks per CPU-second and wall
  seconds per round of the in-process engine (per node, batched, over workers)
  and of ``flwr run`` on Flower's simulation runtime (Ray), same scenarios.
- :func:`startup_seconds`: wall and CPU seconds of imports, ``--help``
  and a short ``flowerbed sim``.
- :func:`client_overhead` (3c): what :func:`flowerbed.clients.timed.timed_train`
  and :func:`flowerbed.clients.telemetry.read_telemetry` add to training.
- :func:`gateway_memory`: gateway RSS per connected phone.
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

    Streaming holds the base, one reply (its array and serialised bytes), the
    float32 sum (the result is made in it) and the two bandwidth arrays (6 x 4
    bytes per float; planned as 7, from when the result was an array more);
    grouped holds :data:`flowerbed.bench.aggregation.GROUP` replies instead of
    one; the strategy also holds the sum's other memory (a pass is written
    beside the sum), the encoded result and the one held for the next round
    (3 x 4 more); Flower's list holds every reply plus the float32 result, a
    temporary and the bandwidth arrays (4 x (nodes + 4)).
    """
    from flowerbed.bench.aggregation import GROUP

    per_float = {
        "streaming": 28,
        "grouped": 20 + 8 * GROUP,
        "strategy": 32 + 8 * GROUP,
    }.get(method, 4 * (nodes + 4))
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


AGGREGATION_METHODS = ("streaming", "grouped", "strategy", "flower")
"""Aggregation paths measured (:mod:`flowerbed.bench.aggregation`)."""


def aggregation_cost(
    node_counts: Sequence[int], floats: int, timeout: float = 900.0
) -> dict[str, Any]:
    """Throughput and peak RSS of each aggregation path at each node count.

    Every point has ``of_limit``: its throughput over the bandwidth limit of a
    fold (``limit_gbps``, a third of the ``a += b`` bandwidth, measured by the
    same process around its aggregation); flowerbed's points also ``vs_flower``
    (over Flower's throughput at the same node count).

    A point whose :func:`planned_bytes` exceeds ``MEMORY_HEADROOM`` of the memory
    available when the part starts is not run; it is listed with the reason.
    """
    module = "flowerbed.bench.aggregation"
    available = available_memory_bytes()
    budget = int(MEMORY_HEADROOM * available)
    bandwidth = _run_json([module, "bandwidth", "1", str(floats)], timeout)
    points: list[dict[str, Any]] = []
    for nodes in node_counts:
        for method in AGGREGATION_METHODS:
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
    flower = {p["nodes"]: p["gbps"] for p in points if p["method"] == "flower"}
    for p in points:
        if p["method"] != "flower" and "gbps" in p and p["nodes"] in flower:
            p["vs_flower"] = p["gbps"] / flower[p["nodes"]]
    return {
        "floats": floats,
        "update_bytes": 4 * floats,
        "memory_available_bytes": available,
        "memory_budget_bytes": budget,
        "bandwidth_gbps": bandwidth["bandwidth_gbps"],
        "limit_gbps": bandwidth["limit_gbps"],
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


def _process_table() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds incl. reaped children) from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    table: dict[int, tuple[int, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        # fields[1] is ppid (field 4 of proc(5)); utime, stime, cutime, cstime
        # are fields 14-17
        cpu = sum(int(f) for f in fields[11:15]) / tick
        table[int(entry.name)] = (int(fields[1]), cpu)
    return table


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds of ``root`` and every live descendant (and what they reaped)."""
    table = _process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        if pid in table:
            total += table[pid][1]
        todo.extend(children.get(pid, []))
    return total


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
    ``workdir``) is stopped by its pid and group whatever happens. ``cpu_s`` is the
    CPU time of the SuperLink and everything it started (Ray, the ServerApp), read
    from /proc when the run has finished, start-up included (one ClientApp runs
    per CPU, each with its own copy of the data and model).
    """
    home = workdir / "flwr-home"
    home.mkdir(parents=True, exist_ok=True)
    out_dir = (workdir / "runs").resolve()
    port = _free_port()
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "bench"\n\n[superlink.bench]\n'
        f'address = "127.0.0.1:{port}"\ninsecure = true\n'
        f"options.num-supernodes = {int(run_config['num-nodes'])}\n"
        # one CPU per ClientApp (Flower's default asks for 2): these models are tiny
        "options.backend.client-resources.num-cpus = 1\n"
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
        cpu_s = tree_cpu_seconds(link.pid)
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
        "cpu_s": cpu_s,
        "tasks": results.get("trained_tasks"),
        "per_round_s": _per_round_s(results["rounds"]),
        "wall_s_per_round": total_s / max(1, len(results["rounds"])),
        "final_accuracy": results["final_accuracy"],
    }


MIN_THROUGHPUT_TASKS = 200
"""Node-tasks a throughput point runs at least (more rounds for small fleets):
fewer make a CPU-time figure of a fraction of a second, too coarse to compare."""


def node_throughput(
    node_counts: Sequence[int],
    rounds: int,
    app_dir: Path,
    ray_counts: Sequence[int] = (),
    timeout: float = 1800.0,
    repeats: int = 3,
    min_tasks: int = MIN_THROUGHPUT_TASKS,
    modes: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Node-tasks per CPU-second and wall seconds per round, per way of running.

    For each fleet size (all nodes sampled every round, ``rounds`` rounds or
    enough for ``min_tasks`` node-tasks; the default scenario
    otherwise, see :mod:`flowerbed.bench.throughput`): the in-process engine per
    node as before batching, per node, batched and batched over workers, each
    in a fresh process, ``repeats`` times with the modes interleaved (the run
    with the median rate is kept, the others' rates beside it; ``modes``: a
    subset of :data:`flowerbed.bench.throughput.MODES`); with the
    sizes in ``ray_counts``, ``flwr run`` on Flower's simulation engine too.
    ``speedup_vs_legacy`` is batched over the original per-node path's
    node-tasks per CPU-second (``legacy``: the per-node baseline),
    ``speedup`` batched over today's per-node path (both on the default path;
    ``c_speedup_vs_legacy`` and ``c_speedup`` the same for ``batched-c``, opted
    in to the compiled C kernels), ``default_of_c`` the default path's
    node-tasks per CPU-second over ``batched-c``'s.
    """
    from flowerbed.bench.throughput import MODES, scenario

    points: list[dict[str, Any]] = []
    for n in node_counts:
        n_rounds = max(rounds, -(-min_tasks // n))
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes or MODES}
        for _ in range(repeats):  # modes interleaved: the load drifts
            for mode in runs:
                args = [
                    "flowerbed.bench.throughput",
                    mode,
                    str(n),
                    str(n),
                    str(n_rounds),
                ]
                try:
                    runs[mode].append(_run_json(args, timeout))
                except (RuntimeError, subprocess.TimeoutExpired) as err:
                    runs[mode].append(
                        {"mode": mode, "cohort": n, "error": str(err)[-500:]}
                    )
        points += [_median_run(mode_runs) for mode_runs in runs.values()]
        if n not in ray_counts:
            continue
        config = {**scenario(n, n, rounds), "strategy": "fedavg"}
        with tempfile.TemporaryDirectory(prefix="flowerbed-bench-ray-") as tmp:
            try:
                ray = flwr_run_rounds(config, app_dir, Path(tmp), timeout)
            except (RuntimeError, TimeoutError, subprocess.TimeoutExpired) as err:
                points.append({"mode": "ray", "cohort": n, "error": str(err)[-500:]})
                continue
        points.append(
            {
                "mode": "ray",
                "cohort": n,
                "population": n,
                "rounds": rounds,
                "tasks": ray["tasks"],
                "cpu_s": ray["cpu_s"],
                "wall_s": ray["total_s"],
                "tasks_per_cpu_s": (ray["tasks"] or 0) / ray["cpu_s"],
                "wall_s_per_round": ray["wall_s_per_round"],
                "final_accuracy": ray["final_accuracy"],
            }
        )
    rate = {
        (p["mode"], p["cohort"]): p["tasks_per_cpu_s"]
        for p in points
        if "tasks_per_cpu_s" in p
    }

    def ratio(mode: str, baseline: str) -> dict[str, float]:
        return {
            str(n): rate[(mode, n)] / rate[(baseline, n)]
            for n in node_counts
            if (mode, n) in rate and (baseline, n) in rate
        }

    out = {
        "rounds": rounds,
        "points": points,
        "speedup": ratio("batched", "per-node"),
        "speedup_vs_legacy": ratio("batched", "legacy"),
    }
    if any(mode == "batched-c" for mode, _ in rate):
        out["c_speedup"] = ratio("batched-c", "per-node")
        out["c_speedup_vs_legacy"] = ratio("batched-c", "legacy")
        out["default_of_c"] = ratio("batched", "batched-c")
    return out


def _median_run(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median node-task rate, with every run's rate beside it."""
    good = sorted(
        (r for r in runs if "tasks_per_cpu_s" in r), key=lambda r: r["tasks_per_cpu_s"]
    )
    if not good:
        return dict(runs[-1])
    return {
        **good[(len(good) - 1) // 2],
        "rates": [r["tasks_per_cpu_s"] for r in good],
    }


STARTUP_COMMANDS = {
    "import flwr.serverapp.strategy": ["-c", "import flwr.serverapp.strategy"],
    "import flowerbed.strategies": ["-c", "import flowerbed.strategies"],
    "flwr --help": ["flwr", "--help"],
    "flowerbed --help": ["flowerbed", "--help"],
    "flowerbed sim --help": ["flowerbed", "sim", "--help"],
    "flowerbed sim (default scenario, 3 rounds)": ["flowerbed", "sim", "--rounds", "3"],
}
"""What the start-up part times; ``-c`` entries run this Python, the others the
console scripts installed beside it."""


def startup_seconds(repeats: int = 3) -> dict[str, Any]:
    """Best-of-``repeats`` wall and CPU seconds of each start-up command.

    Each run is a fresh process (imports not cached in memory by this one; the
    OS file cache is warm after the first). CPU seconds are the child's user +
    system time.
    """
    import resource

    bindir = Path(sys.executable).parent
    out: dict[str, Any] = {"repeats": repeats, "commands": {}}
    with tempfile.TemporaryDirectory(prefix="flowerbed-bench-startup-") as tmp:
        for name, args in STARTUP_COMMANDS.items():
            argv = (
                [sys.executable, *args]
                if args[0] == "-c"
                else [str(bindir / args[0]), *args[1:]]
            )
            if args[:2] == ["flowerbed", "sim"] and "--help" not in args:
                argv += ["--out", tmp]
            walls, cpus = [], []
            for _ in range(repeats):
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                started = time.monotonic()
                proc = subprocess.run(
                    argv, capture_output=True, timeout=600, check=False
                )
                walls.append(time.monotonic() - started)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpus.append(
                    after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
                )
                if proc.returncode != 0:
                    raise RuntimeError(
                        f"{name} exited {proc.returncode}: {proc.stderr[-500:]!r}"
                    )
            out["commands"][name] = {"wall_s": min(walls), "cpu_s": min(cpus)}
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


# --- cluster selection ----------------------------------------------------------------


SENSITIVITY_GAIN_ERROR = 0.01
"""Power-meter calibration error of the sensitivity run: an INA219-class shunt
monitor's specified accuracy (the default run assumes 0.03)."""


def selection(
    num_fleets: int,
    seed: int,
    truth_rounds: int,
    num_rounds: int = 100,
    confidence_draws: int | None = None,
    jobs: int = 1,
) -> dict[str, Any]:
    """Cluster-selection accuracy over random fleets
    (:func:`flowerbed.bench.selection_eval.evaluate_selection`).

    Also the energy and EDP objectives again with power sensors calibrated to
    :data:`SENSITIVITY_GAIN_ERROR` (``sensitivity``), on the same fleets and
    truth: the calibration error is the one no profiling can shrink.
    ``confidence_draws`` (default: the strategy's) sets the draws of each
    confidence estimate; ``jobs`` worker processes share the fleets.
    """
    from flowerbed.bench.selection_eval import evaluate_selection
    from flowerbed.strategies.cluster_selection.search import CONFIDENCE_DRAWS

    draws = CONFIDENCE_DRAWS if confidence_draws is None else confidence_draws
    result = evaluate_selection(
        num_fleets=num_fleets,
        seed=seed,
        truth_rounds=truth_rounds,
        num_rounds=num_rounds,
        confidence_draws=draws,
        also=[(SENSITIVITY_GAIN_ERROR, ("energy", "edp"))],
        jobs=jobs,
    )
    (meter,) = result.pop("also")
    out = {"source": "flowerbed.bench.selection_eval.evaluate_selection", **result}
    out["sensitivity"] = {
        "power_gain_error": SENSITIVITY_GAIN_ERROR,
        "objectives": meter["objectives"],
    }
    return out
