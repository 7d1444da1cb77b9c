"""Pipeline jobs on one machine: emulated devices as local processes.

Each device of the catalogue (:mod:`flowerbed.sims.devices`) becomes a local
worker process (:class:`~flowerbed.sims.process_grid.ProcessGrid`) running the
boards' span ClientApp with ``address=127.0.0.1`` and an emulated training rate
(real compute, then a sleep up to the device's time), and
:class:`~flowerbed.strategies.PipelineTraining` trains across them for real.

The device's rate follows the catalogue's per-sample time of the reference model
(LeNet-5 on 28x28, ``flowerbed.models.REFERENCE_MODEL``)::

    rate (FLOP/s) = 2 x 3 x forward MACs(reference) / seconds_per_sample(device)

(2 FLOPs per multiply-accumulate; training = 3 x the forward pass), divided by
``time_scale`` (> 1 emulates every device that many times slower, so that the
real compute of several processes on a small shared machine stays well below
the emulated times; ratios between configurations do not depend on it).

``device@factor`` in a device list slows that device by ``factor`` (e.g.
``rpi3b@2``: a Pi 3B throttled to half its clock when hot). Used by ``flowerbed
pipeline`` and by the benchmark's pipeline section.
"""

from __future__ import annotations

import functools
import logging
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .devices import get_device
from .notices import our_settings

SPAN_APP = "flowerbed.clients.span_app:app"


@functools.lru_cache(maxsize=1)
def reference_flops_per_sample() -> float:
    """Training FLOPs of one sample of the catalogue's reference model."""
    from flowerbed.models import REFERENCE_MODEL, build_model, forward_macs

    name, channels, size, classes = REFERENCE_MODEL
    return 6.0 * forward_macs(
        build_model(name, channels, size, classes), channels, size
    )


def device_gflops(spec: str, time_scale: float = 1.0) -> float:
    """Emulated training GFLOP/s of ``device`` or ``device@factor`` (module doc)."""
    name, _, factor = spec.partition("@")
    slow = float(factor) if factor else 1.0
    if not slow >= 1:
        raise ValueError(f"{spec!r}: the slow-down factor after '@' must be >= 1")
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    device = get_device(name)
    return (
        reference_flops_per_sample()
        / device.seconds_per_sample
        / slow
        / time_scale
        / 1e9
    )


@dataclass
class LocalNode:
    """One emulated device and its test aids."""

    device: str
    gflops: float
    slow_from_step: int = -1
    slow_factor: float = 1.0
    crash_at_step: int = -1

    def node_config(self, state_dir: Path) -> dict[str, Any]:
        config: dict[str, Any] = {
            "address": "127.0.0.1",
            "device": self.device,
            "emulate-gflops": self.gflops,
            "state-dir": str(state_dir),
        }
        if self.slow_from_step >= 0:
            config["slow-from-step"] = self.slow_from_step
            config["slow-factor"] = self.slow_factor
        if self.crash_at_step >= 0:
            config["crash-at-step"] = self.crash_at_step
        return config


def nodes_for(devices: Sequence[str], time_scale: float = 1.0) -> list[LocalNode]:
    """One :class:`LocalNode` per device spec."""
    return [LocalNode(spec, device_gflops(spec, time_scale)) for spec in devices]


@dataclass
class LocalRun:
    """What a local pipeline job produced."""

    result: Any
    """Flower's ``Result`` (whole model, per-round metrics)."""
    events: list[str]
    """The strategy's re-partitions and recoveries."""
    wall_s: float
    """Seconds of ``strategy.start`` (profiling included, process start-up not)."""
    members: dict[int, str] = field(default_factory=dict)
    """Node id -> device spec."""
    power: dict[int, float] = field(default_factory=dict)
    """Node id -> computing power at the end (time over the reference's)."""
    profiled_power: dict[int, float] = field(default_factory=dict)
    """Node id -> computing power measured when it joined."""
    reference_s: float = 0.0
    """Reference device's forward + backward seconds of the whole model, one
    micro-batch."""


def run_local(
    nodes: Sequence[LocalNode],
    strategy_kwargs: dict[str, Any],
    *,
    rounds: int,
    workdir: Path | None = None,
    during: Callable[[Any], None] | None = None,
    quiet: bool = True,
) -> LocalRun:
    """Train with :class:`PipelineTraining` across ``nodes`` as local processes.

    ``strategy_kwargs`` go to the strategy (model, input_shape, dataset, ...);
    the rendezvous uses free local ports. ``during(grid)`` runs in a thread while
    the job trains (e.g. to kill or add nodes). ``quiet`` hides the members'
    Flower INFO lines. Every process is stopped before returning.
    """
    import threading

    from flowerbed.parallel.group import free_port
    from flowerbed.parallel.user_code import build_layers
    from flowerbed.strategies import PipelineTraining
    from flowerbed.strategies.options import group_settings
    from flowerbed.strategies.span_options import SpanGroup
    from flwr.app import ArrayRecord

    from .process_grid import ProcessGrid

    settings = {
        "fraction_evaluate": 0.0,
        "min_train_nodes": 1,
        "min_available_nodes": len(nodes),
        "group": SpanGroup(
            rendezvous_port=free_port(),
            rendezvous_ports=1,
            join_timeout_s=60.0,
            timeout_s=20.0,
            reply_margin_s=3.0,
        ),
    }
    settings.update(strategy_kwargs)
    settings = group_settings(PipelineTraining, settings)  # pipelining=, planning=
    with our_settings():  # Flower's notice of the fraction_evaluate chosen above
        strategy = PipelineTraining(**settings)
    model = build_layers(strategy.model, strategy.model_args, seed=strategy.seed)
    initial = ArrayRecord(model.state_dict())
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        configs = [n.node_config(Path(tmp) / f"node-{i}") for i, n in enumerate(nodes)]
        level = logging.WARNING if quiet else None
        with ProcessGrid(
            SPAN_APP, configs, unavailable_after_s=1.0, log_level=level
        ) as grid:
            helper = None
            if during is not None:
                helper = threading.Thread(target=during, args=(grid,), daemon=True)
                helper.start()
            began = time.monotonic()
            result = strategy.start(grid, initial, num_rounds=rounds)
            wall = time.monotonic() - began
            if helper is not None:
                helper.join(30)
    members = {i + 1: n.device for i, n in enumerate(nodes)}
    planner = strategy.planner
    reference = (
        sum(planner.reference_forward) + sum(planner.reference_backward)
        if planner.reference_forward
        else 0.0
    )
    return LocalRun(
        result=result,
        events=list(strategy.events),
        wall_s=wall,
        members=members,
        power=dict(planner.power),
        profiled_power=dict(strategy.profiled_power),
        reference_s=reference,
    )
