"""Measuring fused-tile training on emulated boards (the "tiles" bench section).

Every configuration runs the real members (:func:`flowerbed.parallel.tiles.runner.run`)
in fresh local processes (one per board, one torch thread each) joined by gloo
on 127.0.0.1, each emulating a Raspberry Pi 3's training rate
(:class:`~flowerbed.parallel.emulation.DeviceSpeed`) and, with more than one
board, a 100 Mb/s link (``tiles-emulate-link``: every exchange lasts its busiest
port's bytes over the link plus 1 ms). One board is the same code on one rank:
no tiles, no exchanges.

The Pi 3B's rate comes from the device catalogue (:mod:`flowerbed.sims.devices`,
sources there): a Pi 4B trains at an effective 1.35 GFLOP/s, a Pi 3B at 360/900
of it (Geekbench 5 multi-core), 0.54 GFLOP/s for its four cores. One core is a
quarter of that (assumption: convolution training scales over the Cortex-A53's
four cores; the paper's baseline is one core).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
PI4_FLOPS = 1.35e9
CORES = 4
TIMEOUT_S = 1800.0


def pi3_flops() -> float:
    """A Raspberry Pi 3B's effective training FLOP/s (all four cores)."""
    from flowerbed.sims.devices import DEVICES

    return PI4_FLOPS * DEVICES["rpi3b"].relative_speed


@dataclass(frozen=True)
class Setup:
    """One measured configuration."""

    name: str
    boards: int
    flops: float
    """Each board's emulated FLOP/s."""
    bounds: tuple[int, ...] | None = None
    """Fixed grouping (None: the planner's)."""


def _member(
    rank: int, plan_json: str, arrays_path: str, flops: float, queue: Any
) -> None:  # pragma: no cover - runs in a child process
    import resource

    import numpy as np
    import torch

    torch.set_num_threads(1)
    from flowerbed.parallel.emulation import DeviceSpeed
    from flowerbed.parallel.member import MemberContext
    from flowerbed.parallel.plan import MemberPlan
    from flowerbed.parallel.tiles.exact_step import front_names
    from flowerbed.parallel.tiles.runner import run

    try:
        plan = MemberPlan.from_json(plan_json)
        with np.load(arrays_path) as f:
            arrays = {k: f[k] for k in f.files}
        if rank:
            front = plan.options["tiles-bounds"][-1]
            arrays = {k: arrays[k] for k in front_names(list(arrays), front)}
        baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        context = MemberContext(
            address=HOST,
            store_root=Path(tempfile.gettempdir()) / f"flowerbed-tiles-bench-{rank}",
            speed=DeviceSpeed(flops),
        )
        result = run(plan, context, arrays)
        queue.put((rank, result.ok, result.failure, dict(result.metrics), baseline))
    except BaseException as err:  # report, never hang the parent
        queue.put((rank, False, f"{type(err).__name__}: {err}", {}, 0))


def _context() -> Any:
    """Processes forked from a server that imported torch once (``forkserver``
    with torch preloaded): a board starts in a fraction of a second instead of
    importing torch anew, yet from a parent that never ran torch's thread pools
    (forking one that had is unsafe). ``spawn`` where fork is unavailable."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "flowerbed.parallel.tiles.runner"])
    return ctx


def run_members(
    plans: Sequence[str], arrays: Mapping[str, Any], flops: float
) -> list[dict[str, Any]]:
    """Run the members' plans in fresh processes; every member's metrics by rank.

    Raises RuntimeError naming a member that failed or did not finish in time
    (its process is killed by pid).
    """
    import numpy as np

    ctx = _context()
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "arrays.npz")
        np.savez(path, **dict(arrays))
        procs = [
            ctx.Process(target=_member, args=(r, plan, path, flops, queue))
            for r, plan in enumerate(plans)
        ]
        for proc in procs:
            proc.start()
        found: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while len(found) < len(procs) and time.monotonic() < deadline:
                try:
                    rank, ok, failure, metrics, baseline = queue.get(timeout=1.0)
                except Exception:
                    if all(not p.is_alive() for p in procs) and queue.empty():
                        break
                    continue
                if not ok:
                    raise RuntimeError(f"board {rank} failed: {failure}")
                found[rank] = {**metrics, "baseline-rss-bytes": baseline}
        finally:
            for proc in procs:
                proc.join(max(0.0, min(10.0, deadline - time.monotonic())))
                if proc.is_alive() and proc.pid is not None:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.join()
    missing = [r for r in range(len(procs)) if r not in found]
    if missing:
        raise RuntimeError(f"boards {missing} did not report within {TIMEOUT_S:g} s")
    return [found[r] for r in range(len(procs))]


def measure(
    setup: Setup,
    *,
    model_args: Mapping[str, Any],
    image: int,
    batch: int,
    steps: int,
    link_mbps: float,
    memory_mb: float,
    port: int,
) -> dict[str, Any]:
    """Plan ``setup`` with the cost model and run it; the plan and what was measured."""
    from flowerbed.models import build_sequential
    from flowerbed.parallel.emulation import (
        BACKWARD_FLOPS_PER_MAC,
        FORWARD_FLOPS_PER_MAC,
    )
    from flowerbed.parallel.plan import MemberPlan
    from flowerbed.parallel.tiles.exact_step import TileSettings
    from flowerbed.parallel.tiles.grouping import Cluster, plan_tiles
    from flowerbed.parallel.tiles.region_ops import front_geometry

    model = build_sequential("yolo-tiny", dict(model_args), seed=0)
    shape = (3, image, image)
    geometry = front_geometry(model, shape)
    speed = setup.flops / (FORWARD_FLOPS_PER_MAC + BACKWARD_FLOPS_PER_MAC)
    link = link_mbps * 1e6 / 8
    cluster = Cluster(
        speeds=(speed,) * setup.boards,
        memory=(memory_mb * 2**20,) * setup.boards,
        link_bytes_per_s=link,
        latency_s=1e-3,
    )
    bounds = setup.bounds
    if setup.boards == 1 and bounds is None:
        bounds = (0, geometry.tileable)  # one device: one region, the whole map
    plan = plan_tiles(geometry, cluster, batch, bounds=bounds)
    settings = TileSettings(
        input_shape=shape,
        bounds=plan.bounds,
        weights=plan.weights,
        bands=plan.bands,
        emulate_link=setup.boards > 1,
        link_bytes_per_s=link,
        latency_s=1e-3,
        num_classes=int(model_args.get("num_classes", 20)),
    )
    plans = [
        MemberPlan(
            mode="tiles",
            job="bench-" + "".join(c if c.isalnum() else "-" for c in setup.name),
            segment=1,
            rank=rank,
            world_size=setup.boards,
            host=HOST,
            port=port,
            start_step=0,
            steps=steps,
            batch_size=batch,
            join_timeout_s=300,
            timeout_s=600,
            model="yolo-tiny",
            model_args=dict(model_args),
            dataset="synthetic",
            lr=0.01,
            momentum=0.9,
            options=settings.options(),
        ).to_json()
        for rank in range(setup.boards)
    ]
    arrays = {k: v.numpy() for k, v in model.state_dict().items()}
    began = time.perf_counter()
    members = run_members(plans, arrays, setup.flops)
    cost = plan.cost
    q = 4
    single_act = (
        q
        * batch
        * (geometry.full_elements(0, plan.front) + geometry.head_elements[plan.front])
    )
    return {
        "name": setup.name,
        "boards": setup.boards,
        "gflops": setup.flops / 1e9,
        "front": plan.front,
        "bounds": list(plan.bounds),
        "bands": plan.bands,
        "predicted-step-s": cost.total_s,
        "predicted-link-s": cost.link_s,
        "predicted-activation-bytes": list(cost.activation_bytes),
        "single-activation-bytes": single_act,
        "halo-macs": sum(cost.front_macs) - geometry.full_macs(0, plan.front),
        "front-macs": geometry.full_macs(0, plan.front),
        "step-s": max(float(m["span-step-s"]) for m in members),
        "compute-s": [float(m["tiles-compute-s"]) for m in members],
        "link-s": [float(m["tiles-link-s"]) for m in members],
        "link-bytes": [float(m["tiles-link-bytes"]) for m in members],
        "activation-bytes": [int(m["tiles-activation-bytes"]) for m in members],
        "peak-rss-bytes": [int(m["tiles-peak-rss-bytes"]) for m in members],
        "baseline-rss-bytes": [int(m["baseline-rss-bytes"]) for m in members],
        "overrun-s": [float(m["span-overrun-s"]) for m in members],
        "wall-s": time.perf_counter() - began,
    }
