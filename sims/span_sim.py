"""LargeBatchSync on the in-process engine: all-reduce segments on the virtual clock.

:class:`~flowerbed.strategies.LargeBatchSync` runs unchanged over a
:class:`~flowerbed.sims.engine.FleetGrid` whose nodes are simulated boards or
phones (:func:`span_grid`). A segment's train messages all arrive in one push;
:class:`SegmentRunner` (the grid's ``batch_train``) trains the whole group in this
process with :func:`flowerbed.parallel.large_batch.allreduce.run_group` -- the
same :class:`~flowerbed.parallel.large_batch.allreduce.Segment` code a DDP member
runs: data, batch shares, loss scale, optimiser, schedule -- and answers each
member as the span
ClientApp would (:func:`flowerbed.clients.span_app.member_reply`), with virtual
times in place of measured ones.

**Virtual time of a segment.** Member ``i`` (a catalogue device, effective rate
``r_i`` FLOP/s from :func:`~flowerbed.sims.pipeline_local.device_gflops`) spends
``t_i = 6 M / r_i`` seconds per sample on a model of ``M`` forward
multiply-accumulates per sample (:class:`~flowerbed.parallel.emulation.DeviceSpeed`:
forward 2 FLOPs per MAC, backward twice the forward; Kaplan et al. 2020, Sec. 2.1),
so its share of ``B_i`` samples costs ``B_i t_i``. Then the gradients
(``G`` bytes: 4 per parameter, half with ``fp16`` compression) are all-reduced
over the network's ring (:meth:`flowerbed.sims.links.Network.allreduce_seconds`,
``2 (N - 1) / N G / bandwidth + 2 (N - 1) latency``; Patarasuk and Yuan 2009,
:func:`flowerbed.parallel.collectives.ring_allreduce_seconds`). A step is
:func:`~flowerbed.sims.links.sync_step_seconds`::

    step(t) = max_i B_i t_i(t) + allreduce(N, G)

and a segment of ``K`` steps ``sum_t step(t)``: each member reports
``span-step-compute-s = B_i t_i`` and ``span-step-comm-s = step - B_i t_i`` (the
rest of the step: waiting for slower members and the all-reduce, what a DDP
member measures as wall minus compute), and ``train-time-s`` the segment's
seconds, so every reply arrives when the segment ends. The round's weight
downloads and uploads are charged to the same network
(:func:`~flowerbed.sims.links.charge_round`). Not charged: the rendezvous, DDP's
initial broadcast of the weights and evaluation. ``charge_as`` charges ``M`` and
``G`` of a published architecture (``flowerbed.models.CHARGED_MODELS``) while a
small model trains.

**Profiling** answers ``samples-per-s = 1 / t_i`` (what the boards' profile
measures, without noise) and costs ``repeats x batch x t_i`` virtual seconds.

**Failures.** node_config ``crash-at-step`` (as on real boards) makes a member
vanish when its segment reaches that global step: it never answers (the message's
TTL expires) and stays silent; the others answer ``span-ok = 0`` with the step
they stopped at, ``timeout_s`` (gloo's operation timeout) after the last complete
step, as DDP members do. The strategy then re-forms the group without it.
``slow-from-step`` / ``slow-factor`` slow a device from a step on.

Not simulated: PowerSGD compression (refused with a clear error), datasets local
to each board (``"local"``).
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flowerbed import keys
from flowerbed.clients import span_app
from flowerbed.clients.span_app import (
    ADDRESS,
    CRASH_AT_STEP,
    DEVICE,
    EMULATE_GFLOPS,
    HANDLED,
    SLOW_FACTOR,
    SLOW_FROM_STEP,
    error_reply,
    member_context,
    member_reply,
    message_arrays,
    message_config,
    span_query,
)
from flowerbed.parallel.large_batch import allreduce
from flowerbed.parallel.member import MemberContext, MemberResult
from flowerbed.parallel.plan import MemberPlan, PlanError
from flwr.app import ArrayRecord, Context, Message, MetricRecord
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import Result

from .engine import FleetGrid, SimNode
from .links import Network, SwitchedEthernet, sync_step_seconds
from .node import single_threaded
from .pipeline_local import device_gflops
from .vclock import NodeDropout

FIRST_NODE_ID = 1000


def board_network() -> Network:
    """Boards on one gigabit switch with built-in ports (no USB adapter)."""
    return SwitchedEthernet(adapter=None)


def node_config(
    device: str | float,
    index: int,
    *,
    crash_at_step: int = -1,
    slow_from_step: int = -1,
    slow_factor: float = 1.0,
) -> dict[str, bool | float | int | str]:
    """A simulated member's node_config: the span ClientApp's keys (its module
    doc) and a LAN address by index. ``device``: a catalogue name, ``name@factor``
    for a slowed one, or a number, the effective training GFLOP/s itself."""
    if isinstance(device, str):
        gflops = device_gflops(device)
    elif isinstance(device, int | float) and math.isfinite(device) and device > 0:
        gflops = float(device)
    else:
        raise ValueError(
            f"device {device!r}: give a catalogue name (flowerbed.sims.devices), "
            "'name@factor', or GFLOP/s > 0"
        )
    config: dict[str, bool | float | int | str] = {
        ADDRESS: f"10.0.{index // 250}.{index % 250 + 1}",
        DEVICE: str(device),
        EMULATE_GFLOPS: gflops,
        CRASH_AT_STEP: crash_at_step,
    }
    if slow_from_step >= 0:
        config[SLOW_FROM_STEP] = slow_from_step
        config[SLOW_FACTOR] = slow_factor
    return config


@functools.lru_cache(maxsize=32)
def _macs(model: str, model_args: str, dataset: str) -> int:
    from flowerbed.models import count_macs
    from flowerbed.parallel.job_data import load_job_dataset
    from flowerbed.parallel.user_code import build_module

    built = build_module(model, json.loads(model_args), seed=0)
    x = load_job_dataset(dataset).x_train[:1]
    return count_macs(built, torch.from_numpy(np.ascontiguousarray(x, np.float32)))


def macs_per_sample(model: str, model_args: Mapping[str, Any], dataset: str) -> int:
    """Forward multiply-accumulates of one sample of ``dataset`` through ``model``."""
    if dataset == allreduce.LOCAL_DATASET:
        raise PlanError(
            "the simulator trains on a job dataset; 'local' (each board's own "
            "data) needs real boards"
        )
    try:
        return _macs(model, json.dumps(dict(model_args), sort_keys=True), dataset)
    except ValueError as err:
        raise PlanError(f"model {model!r} on {dataset!r}: {err}") from None


def seconds_per_sample(member: MemberContext, macs: float, step: int) -> float:
    """``t_i``: the member's training seconds per sample at global step ``step``."""
    if member.speed is None:
        raise PlanError(
            f"simulated node {member.node_id} has no speed: give it node_config "
            f"'{EMULATE_GFLOPS}' (node_config() sets it from the device catalogue)"
        )
    return member.speed.train_s(macs, step)


@dataclass
class SegmentRunner:
    """The grid's ``batch_train``: runs each segment's group in process (module doc).

    ``network`` carries the all-reduce. ``crashed`` collects the nodes that
    vanished (they never answer again).
    """

    network: Network = field(default_factory=board_network)
    charge_as: str = ""
    crashed: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.charge_as:
            from flowerbed.models import CHARGED_MODELS

            if self.charge_as not in CHARGED_MODELS:
                raise ValueError(
                    f"unknown charged model {self.charge_as!r}; valid choices: "
                    f"{', '.join(CHARGED_MODELS)}"
                )

    def costs(
        self, model: str, model_args: Mapping[str, Any], dataset: str
    ) -> tuple[float, int | None]:
        """``(M, G)``: forward MACs per sample and gradient bytes charged, those of
        ``charge_as`` when set (``G`` None: the trained model's own)."""
        if not self.charge_as:
            return float(macs_per_sample(model, model_args, dataset)), None
        from flowerbed.models import charged_costs

        from .pipeline_local import reference_flops_per_sample

        factor, num_bytes = charged_costs(self.charge_as)
        return factor * reference_flops_per_sample() / 6.0, num_bytes

    def __call__(
        self, tasks: Sequence[tuple[Message, Context]]
    ) -> list[Message | Exception]:
        single_threaded()  # tiny per-member shares: threads only spin (node.py)
        out: list[Message | Exception | None] = [None] * len(tasks)
        groups: dict[tuple[str, int], list[tuple[int, MemberPlan, MemberContext]]] = {}
        for index, (message, context) in enumerate(tasks):
            if context.node_id in self.crashed:
                out[index] = _vanished(context.node_id)
                continue
            try:
                member = member_context(context)
                plan = MemberPlan.from_config(message_config(message))
                if plan.mode != allreduce.MODE:
                    raise PlanError(
                        f"mode {plan.mode!r} is not simulated in process; valid "
                        f"choices: {allreduce.MODE}"
                    )
            except HANDLED as err:
                out[index] = error_reply(message, err)
                continue
            groups.setdefault((plan.job, plan.segment), []).append(
                (index, plan, member)
            )
        for group in groups.values():
            # the weights rank 0 was sent: DDP broadcasts them when it wraps the model
            lead = min(group, key=lambda entry: entry[1].rank)[0]
            try:
                answers = self.run_segment(
                    [p for _, p, _ in group],
                    [m for _, _, m in group],
                    message_arrays(tasks[lead][0]),
                )
            except HANDLED as err:
                for i, _, _ in group:
                    out[i] = error_reply(tasks[i][0], err)
                continue
            for (i, _, member), answer in zip(group, answers, strict=True):
                out[i] = (
                    answer
                    if isinstance(answer, Exception)
                    else member_reply(tasks[i][0], member, answer)
                )
        return [o if o is not None else RuntimeError("unanswered") for o in out]

    def run_segment(
        self,
        plans: Sequence[MemberPlan],
        members: Sequence[MemberContext],
        arrays: Mapping[str, np.ndarray],
    ) -> list[MemberResult | Exception]:
        """One segment of one group: each member's result (or the dropout of a
        member that vanished), in the order of ``plans``."""
        ordered = allreduce.check_group(plans)
        lead = ordered[0]
        by_rank = {p.rank: m for p, m in zip(plans, members, strict=True)}
        macs, charged_bytes = self.costs(lead.model, lead.model_args, lead.dataset)
        crashes = [
            m.crash_at_step
            for m in members
            if lead.start_step <= m.crash_at_step < lead.end_step
        ]
        stop = min(crashes) if crashes else None
        run = allreduce.run_group(ordered, members[0], arrays, stop_step=stop)
        shares = [p.batch_share[1] - p.batch_share[0] for p in ordered]
        grad_bytes = run.grad_bytes
        if charged_bytes is not None:
            fp16 = lead.options.get(allreduce.COMPRESSION) == "fp16"
            grad_bytes = charged_bytes // (2 if fp16 else 1)
        world = len(ordered)
        compute: list[list[float]] = [[] for _ in ordered]
        comm: list[list[float]] = [[] for _ in ordered]
        for step in range(lead.start_step, lead.start_step + run.steps):
            per_sample = [
                seconds_per_sample(by_rank[r], macs, step) for r in range(world)
            ]
            step_s = sync_step_seconds(self.network, shares, per_sample, grad_bytes)
            for r in range(world):
                compute[r].append(shares[r] * per_sample[r])
                comm[r].append(step_s - compute[r][-1])
        segment_s = sum(compute[0][t] + comm[0][t] for t in range(run.steps))
        results: list[MemberResult | Exception] = []
        for plan, member in zip(plans, members, strict=True):
            r = plan.rank
            if stop is not None:
                if member.crash_at_step == stop:
                    self.crashed.add(member.node_id)
                    results.append(_vanished(member.node_id))
                    continue
                results.append(
                    MemberResult(
                        ok=False,
                        metrics={
                            keys.SPAN_OK: 0,
                            keys.SPAN_FAILED_STEP: stop,
                            keys.TRAIN_TIME_S: segment_s + plan.timeout_s,
                        },
                        failure=f"step: a peer was lost at step {stop} (simulated)",
                    )
                )
                continue
            metrics = allreduce.segment_metrics(
                shares[r],
                compute[r],
                comm[r],
                run.losses[r],
                run.lr,
                train_s=segment_s,
                setup_s=0.0,
            )
            results.append(
                MemberResult(
                    ok=True, metrics=metrics, arrays=run.arrays, optimizer=run.optimizer
                )
            )
        return results

    def profile_reply(self, message: Message, context: Context) -> Message:
        """A query's answer: the member's speed from its device, no measurement."""
        try:
            member = member_context(context)
            request = span_query(message)
            if request.get("mode") != allreduce.MODE:
                raise PlanError(
                    f"mode {request.get('mode')!r} is not simulated in process; valid "
                    f"choices: {allreduce.MODE}"
                )
            macs, _ = self.costs(
                str(request.get("model", "")),
                dict(request.get("model_args") or {}),
                str(request.get("dataset", "")),
            )
            t = seconds_per_sample(member, macs, 0)
            batch = max(1, int(request.get("batch", 8)))
            repeats = max(1, int(request.get("repeats", 3)))
        except HANDLED as err:
            return error_reply(message, err)
        result = MemberResult(
            ok=True,
            metrics={
                keys.SPAN_OK: 1,
                keys.SAMPLES_PER_S: 1.0 / t,
                keys.TRAIN_TIME_S: repeats * batch * t,
            },
            info={"address": member.address},
        )
        return member_reply(message, member, result)


def _vanished(node_id: int) -> NodeDropout:
    return NodeDropout(
        f"node {node_id} vanished mid-segment (crash-at-step)",
        silent=True,
        after_s=0.0,
    )


def make_span_app(runner: SegmentRunner) -> ClientApp:
    """The simulated members' ClientApp: ``query`` answers the device's speed,
    ``evaluate`` is the boards' (:func:`flowerbed.clients.span_app.evaluate`),
    ``train`` runs a lone message through ``runner`` (a group of one)."""
    app = ClientApp()
    app.query()(runner.profile_reply)
    app.evaluate()(span_app.evaluate)

    @app.train()
    def train(message: Message, context: Context) -> Message:
        (answer,) = runner([(message, context)])
        if isinstance(answer, Exception):
            raise answer
        return answer

    return app


def span_grid(
    devices: Sequence[str | float],
    *,
    network: Network | None = None,
    crash_at_step: Mapping[int, int] | None = None,
    slow_from_step: Mapping[int, tuple[int, float]] | None = None,
    charge_as: str = "",
) -> FleetGrid:
    """An in-process fleet of span members, one per entry of ``devices``.

    ``devices``: catalogue names (``flowerbed.sims.devices``), ``name@factor`` for
    a slowed one. ``network`` carries both the all-reduce and the rounds' weight
    transfers (default :func:`board_network`). ``crash_at_step``: node index ->
    global step at which that member vanishes. ``slow_from_step``: node index ->
    ``(step, factor)``, that member trains ``factor`` times slower from that
    global step on (a board that heats up). ``charge_as``: charge compute and
    gradient bytes of a published architecture (``flowerbed.models.CHARGED_MODELS``)
    in place of the trained model's. Node ids are ``FIRST_NODE_ID + index``.
    """
    if not devices:
        raise ValueError("a span fleet needs at least one device")
    net = network if network is not None else board_network()
    crashes = dict(crash_at_step or {})
    slows = dict(slow_from_step or {})
    for label, indexed in (("crash_at_step", crashes), ("slow_from_step", slows)):
        unknown = sorted(set(indexed) - set(range(len(devices))))
        if unknown:
            raise ValueError(
                f"{label} names node indices {unknown}; valid: 0..{len(devices) - 1}"
            )
    nodes = [
        SimNode(
            FIRST_NODE_ID + i,
            node_config(
                d,
                i,
                crash_at_step=crashes.get(i, -1),
                slow_from_step=slows.get(i, (-1, 1.0))[0],
                slow_factor=slows.get(i, (-1, 1.0))[1],
            ),
        )
        for i, d in enumerate(devices)
    ]
    runner = SegmentRunner(net, charge_as)
    return FleetGrid(make_span_app(runner), nodes, {}, batch_train=runner, network=net)


@dataclass
class SimRun:
    """A simulated LargeBatchSync run: Flower's Result, the virtual time at the
    end of each round (index 0: the start, 0 s) and the wall seconds it took."""

    result: Result
    round_end_s: list[float]
    wall_s: float


def simulate(
    strategy: Any,
    devices: Sequence[str | float],
    num_rounds: int,
    *,
    network: Network | None = None,
    crash_at_step: Mapping[int, int] | None = None,
    slow_from_step: Mapping[int, tuple[int, float]] | None = None,
    initial_arrays: ArrayRecord | None = None,
    evaluate: bool = False,
    charge_as: str = "",
) -> SimRun:
    """Run ``strategy`` (a :class:`~flowerbed.strategies.LargeBatchSync`) for
    ``num_rounds`` on :func:`span_grid` ``(devices, ...)``.

    The initial weights are the strategy's model built with seed 0 unless given.
    ``evaluate``: score the model on the job dataset's test split after each
    round (server side, ``Result.evaluate_metrics_serverapp``; no virtual time).
    """
    from flowerbed.parallel.user_code import build_module

    grid = span_grid(
        devices,
        network=network,
        crash_at_step=crash_at_step,
        slow_from_step=slow_from_step,
        charge_as=charge_as,
    )
    if initial_arrays is None:
        model = build_module(strategy.model, strategy.model_args, seed=0)
        initial_arrays = ArrayRecord(model.state_dict())
    ends: list[float] = []
    query = {
        "model": strategy.model,
        "model_args": strategy.model_args,
        "dataset": strategy.dataset,
    }
    context = MemberContext(address="127.0.0.1", store_root=Path("/nonexistent"))

    def on_round(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        ends.append(grid.clock.now())
        if not evaluate:
            return None
        scored = allreduce.evaluate(
            query, context, {k: v.numpy() for k, v in arrays.items()}
        )
        return MetricRecord(
            {k: v for k, v in scored.metrics.items() if k != keys.SPAN_OK}
        )

    began = time.perf_counter()
    try:
        result = strategy.start(
            grid, initial_arrays, num_rounds=num_rounds, evaluate_fn=on_round
        )
    finally:
        grid.close()
    return SimRun(result, ends, time.perf_counter() - began)
