"""The benchmark suite: fleets, strategies, one run per cell, and the statistics.

Every cell is one (fleet, strategy, seed) on the in-process engine
(:mod:`flowerbed.sims.engine`); time is virtual, so the figures do not depend on how
busy this machine is. A run is observed through :class:`CountingGrid`, a transparent
``Grid`` wrapper that counts train tasks dispatched and samples trained, and through
the strategy's returned ``Result``. Metrics of one run:

- ``time_to_target_s``: virtual time of the first round whose central test accuracy
  reaches the target (None if never).
- ``final_accuracy``: central test accuracy after the last round.
- ``energy_j``: energy the nodes reported for every train task they finished,
  used or not (busy power x compute time + idle power x transfer time,
  :func:`flowerbed.sims.vclock.energy_joules`); tasks that failed report none.
  ``energy_used_updates_j``: the part in replies the strategy received in time.
- ``edp_js``: energy-delay product ``E x T`` of the whole run, ``T`` its virtual
  duration (Gonzalez and Horowitz, "Energy dissipation in general purpose
  microprocessors", IEEE JSSC 31(9), 1996, Sec. III).
- ``rounds``: rounds (model versions for FedBuff) run; ``rounds_to_target``.
- ``updates_discarded``: train tasks dispatched minus updates folded into a global
  model: failed and vanished nodes, replies that missed their round or were too
  stale, and work still in flight when the run ended.

The ideal time-to-target (issue 4) charges the samples the reference run needed
to the fleet's summed throughput, as if every node computed all the time and
nothing else cost time::

    ideal_s = samples_to_target(reference) / sum_i throughput_i,
    throughput_i = 1 / (seconds_per_sample(device_i) x cost_factor(model))
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from flowerbed import keys
from flowerbed.grid import GridWrapper
from flowerbed.models import build_model, cost_factor, model_num_bytes
from flowerbed.sims import vclock
from flowerbed.sims.config import Scenario
from flowerbed.sims.fleet import assign_devices
from flowerbed.sims.node import cached_dataset
from flowerbed.sims.recorder import RoundRecord
from flowerbed.sims.scenario import (
    build_fleet_grid,
    flower_args,
    flowerbed_strategy,
    run_server,
)
from flwr.app import Message
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, FedProx, Result, Strategy

REFERENCE = "flwr-fedavg"
"""The baseline every speed-up is measured against: Flower's FedAvg, waiting for all."""
HEADLINE_FLEET = "phones-10x"
HEADLINE_SPEEDUP = 3.0
"""Issue 4's target: at least this median speed-up in time-to-target ..."""
HEADLINE_MAX_ACC_DROP = 0.005
"""... with final accuracy at most this much (0.5 point) below the reference."""
TIMEOUT_FACTOR = 1.25
"""``flwr-fedavg-timeout``'s round timeout: this x the median node's task time."""


@dataclass(frozen=True)
class BenchFleet:
    """A fleet as the bench runs it: a mix from ``flowerbed.sims.fleet`` + dropout."""

    name: str
    fleet: str
    dropout: float
    description: str


FLEETS: dict[str, BenchFleet] = {
    f.name: f
    for f in (
        BenchFleet("uniform", "uniform", 0.0, "every node a Raspberry Pi 4B"),
        BenchFleet(
            "phones-10x",
            "phones-10x",
            0.0,
            "40% low-end, 30% Galaxy S10, 30% Pixel 7 phones (10x compute spread)",
        ),
        BenchFleet(
            "phones-10x-drop10",
            "phones-10x",
            0.1,
            "phones-10x, each task failing with probability 0.1 (half of them "
            "silently)",
        ),
        BenchFleet(
            "mixed", "mixed", 0.0, "phones, Raspberry Pis 3B/4B/5 and Jetson Nanos"
        ),
    )
}


@dataclass(frozen=True)
class BenchStrategy:
    """A strategy as the bench runs it."""

    name: str
    description: str
    factory: Callable[[Scenario], Strategy]
    versions_per_round: int = 1
    """Model versions this strategy runs per round of the others (FedBuff: 2,
    so that it folds as many updates as a synchronous run of all nodes)."""
    timeout: Callable[[Scenario], float] | None = None
    """``start(timeout=...)`` in virtual seconds; None keeps the scenario's."""


def task_seconds(scenario: Scenario, num_nodes: int) -> list[float]:
    """Virtual seconds of one full training task (download, local steps, upload)
    for every node of the scenario's fleet, by the virtual clock's formulas."""
    data = cached_dataset(scenario.dataset, scenario.data_dir)
    shape = (data.in_channels, data.image_size, data.num_classes)
    factor = cost_factor(scenario.model, *shape)
    nbytes = model_num_bytes(build_model(scenario.model, *shape))
    batch = min(scenario.batch_size, len(data.x_train) // num_nodes)
    out = []
    for dev in assign_devices(scenario.fleet, num_nodes, scenario.seed):
        comm = vclock.transfer_seconds(nbytes, dev.downlink_mbps)
        comm += vclock.transfer_seconds(nbytes, dev.uplink_mbps)
        out.append(
            comm + scenario.local_steps * vclock.step_seconds(dev, batch, factor)
        )
    return out


def fleet_throughput(scenario: Scenario) -> float:
    """Samples per second of the whole fleet computing at once (see module doc)."""
    data = cached_dataset(scenario.dataset, scenario.data_dir)
    factor = cost_factor(
        scenario.model, data.in_channels, data.image_size, data.num_classes
    )
    devices = assign_devices(scenario.fleet, scenario.num_nodes, scenario.seed)
    return sum(1.0 / (d.seconds_per_sample * factor) for d in devices)


def _median_task_timeout(s: Scenario) -> float:
    return TIMEOUT_FACTOR * statistics.median(task_seconds(s, s.num_nodes))


STRATEGIES: dict[str, BenchStrategy] = {
    b.name: b
    for b in (
        BenchStrategy(
            REFERENCE,
            "Flower FedAvg, waits for every sampled node (start timeout 3600 s)",
            lambda s: FedAvg(**flower_args(s)),
        ),
        BenchStrategy(
            "flwr-fedavg-timeout",
            f"Flower FedAvg, start(timeout={TIMEOUT_FACTOR} x median node's task "
            "time); later replies are dropped",
            lambda s: FedAvg(**flower_args(s)),
            timeout=_median_task_timeout,
        ),
        BenchStrategy(
            "flwr-fedprox",
            "Flower FedProx (proximal-mu 0.01; nodes add the proximal term)",
            lambda s: FedProx(proximal_mu=s.proximal_mu, **flower_args(s)),
        ),
        *(
            BenchStrategy(
                f"rw-{w}",
                f"RuntimeWeightedFedAvg, weighting={w!r}",
                flowerbed_strategy("RuntimeWeightedFedAvg", weighting=w),
            )
            for w in ("runtime", "throughput", "fednova", "examples")
        ),
        BenchStrategy(
            "rw-fednova-balanced",
            "RuntimeWeightedFedAvg, weighting='fednova', balance_work=True "
            "(local steps proportional to speed)",
            flowerbed_strategy(
                "RuntimeWeightedFedAvg", weighting="fednova", balance_work=True
            ),
        ),
        BenchStrategy(
            "deadline",
            "DeadlineFedAvg, adaptive deadline at the 60th percentile of recent "
            "durations (Oort pacer); replies that miss their round are folded into "
            "the next two with a 1/sqrt(1+s) discount",
            flowerbed_strategy(
                "DeadlineFedAvg",
                adaptive_deadline=True,
                deadline_percentile=60.0,
            ),
        ),
        BenchStrategy(
            "fedbuff",
            "FedBuff, concurrency = all nodes, K = half of them, 2 versions per round",
            flowerbed_strategy("FedBuff"),
            versions_per_round=2,
        ),
    )
}


def resolve(
    names: Iterable[str], catalogue: Mapping[str, object], what: str
) -> list[str]:
    """Check names against a catalogue; unknown ones raise naming the valid choices."""
    out = list(names)
    for name in out:
        if name not in catalogue:
            raise ValueError(
                f"unknown {what} {name!r}; valid choices: {', '.join(catalogue)}"
            )
    return out


class CountingGrid(GridWrapper):
    """Transparent ``Grid`` wrapper: counts train tasks, samples and energy.

    :meth:`drain`, called once the run is over, lets the virtual clock run on and
    pulls every train reply still in flight, so the energy of work that was
    never used (stragglers, replies after the round closed) is counted too: the
    devices spent it.
    """

    def __init__(self, inner: Grid) -> None:
        super().__init__(inner)
        self.dispatched = 0
        """Train messages pushed."""
        self.samples = 0
        """``num-examples`` summed over successful train replies pulled."""
        self.energy_j = 0.0
        """``energy-j`` summed over successful train replies pulled."""
        self._open: set[str] = set()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        ids = list(self.inner.push_messages(messages))
        for message, message_id in zip(messages, ids, strict=True):
            if message.metadata.message_type.startswith("train"):
                self.dispatched += 1
                self._open.add(message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = list(self.inner.pull_messages(message_ids))
        for reply in replies:
            if reply.metadata.reply_to_message_id not in self._open:
                continue
            self._open.discard(reply.metadata.reply_to_message_id)
            if reply.has_error():
                continue
            for record in reply.content.metric_records.values():
                examples = record.get(keys.NUM_EXAMPLES)
                if isinstance(examples, int | float):
                    self.samples += int(examples)
                energy = record.get(keys.ENERGY_J)
                if isinstance(energy, int | float):
                    self.energy_j += float(energy)
        return replies

    def drain(self) -> None:
        """Advance the virtual clock until nothing is in flight; pull it all."""
        clock = getattr(self, "clock", None)
        upcoming = getattr(self.inner, "next_arrival_after", None)
        if clock is None or upcoming is None:
            return
        while (t := upcoming(clock.now())) is not None and math.isfinite(t):
            clock.wait(t - clock.now())
        self.pull_messages(list(self._open))


def _folded(result: Result | None, records: Sequence[RoundRecord]) -> int:
    """Updates folded into a global model over the run.

    flowerbed strategies report ``participants`` (+ ``late-updates``) per round in
    their train metrics; Flower's FedAvg/FedProx fold every successful reply they
    received in time, which is what the recorder calls participants.
    """
    from flowerbed.strategies.utils import ROUND_LATE_UPDATES, ROUND_PARTICIPANTS

    history = result.train_metrics_clientapp if result is not None else {}
    if history and all(ROUND_PARTICIPANTS in m for m in history.values()):
        total = 0.0
        for m in history.values():
            for key in (ROUND_PARTICIPANTS, ROUND_LATE_UPDATES):
                value = m.get(key, 0.0)
                total += float(value) if isinstance(value, int | float) else 0.0
        return int(total)
    return sum(len(r.participants) for r in records)


def run_cell(
    fleet: str,
    strategy: str,
    seed: int,
    *,
    num_nodes: int,
    num_rounds: int,
    local_steps: int,
    learning_rate: float,
    target: float,
) -> dict[str, Any]:
    """One (fleet, strategy, seed) run; returns JSON-able metrics and its curve."""
    bf, bs = FLEETS[fleet], STRATEGIES[strategy]
    scenario = Scenario(
        fleet=bf.fleet,
        dropout=bf.dropout,
        num_nodes=num_nodes,
        num_rounds=num_rounds * bs.versions_per_round,
        local_steps=local_steps,
        learning_rate=learning_rate,
        target_accuracy=target,
        seed=seed,
        strategy="fedavg",
    )
    if bs.timeout is not None:
        scenario = replace(scenario, round_timeout_s=bs.timeout(scenario))
    scenario.check()
    grid = CountingGrid(build_fleet_grid(scenario.to_run_config()))
    samples_at: list[int] = []
    kept: dict[str, Result] = {}
    impl = bs.factory(scenario)
    start = impl.start  # run_server drops the Result; keep it for the counts

    def start_and_keep(**kwargs: Any) -> Result:
        kept["result"] = start(**kwargs)
        return kept["result"]

    impl.start = start_and_keep  # type: ignore[method-assign,assignment]
    outcome = run_server(
        grid,
        scenario,
        strategy=impl,
        on_round=lambda _r: samples_at.append(grid.samples),
        engine="in-process",
        write=False,
    )
    records = outcome.records
    res = outcome.results
    grid.drain()
    folded = _folded(kept.get("result"), records)
    ttt = res["time_to_target_s"]
    rounds_to_target = next((r.round for r in records if r.accuracy >= target), None)
    samples_to_target = (
        samples_at[rounds_to_target - 1] if rounds_to_target is not None else None
    )
    total_t = float(res["total_virtual_time_s"])
    energy = grid.energy_j
    return {
        "fleet": fleet,
        "strategy": strategy,
        "seed": seed,
        "num_nodes": num_nodes,
        "time_to_target_s": ttt,
        "final_accuracy": res["final_accuracy"],
        "energy_j": energy,
        "energy_used_updates_j": float(res["total_energy_j"]),
        "edp_js": energy * total_t,
        "virtual_time_s": total_t,
        "rounds": len(records),
        "rounds_to_target": rounds_to_target,
        "samples_to_target": samples_to_target,
        "updates_dispatched": grid.dispatched,
        "updates_folded": folded,
        "updates_discarded": grid.dispatched - folded,
        "timeout_s": scenario.round_timeout_s,
        "fleet_throughput_sps": fleet_throughput(scenario),
        "curve": [[r.virtual_time_s, r.accuracy] for r in records],
        "wall_s": records[-1].wall_time_s if records else 0.0,
    }


def spread(values: Sequence[float | None]) -> dict[str, Any]:
    """Median, min and max of the values that exist; ``n`` counts them.

    A run that never reached the target has no time-to-target: it is counted in
    ``missing`` and the median is taken over the others only when they are a
    majority (else None: the median run did not reach the target).
    """
    present = sorted(float(v) for v in values if v is not None and math.isfinite(v))
    missing = len(values) - len(present)
    if not present or (missing and missing * 2 >= len(values)):
        return {
            "median": None,
            "min": None,
            "max": None,
            "n": len(present),
            "missing": missing,
        }
    return {
        "median": statistics.median(present),
        "min": present[0],
        "max": present[-1],
        "n": len(present),
        "missing": missing,
    }


METRICS = (
    "time_to_target_s",
    "final_accuracy",
    "energy_j",
    "edp_js",
    "rounds",
    "rounds_to_target",
    "updates_discarded",
)


def summarise_cells(cells: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{fleet: {strategy: {metric: spread, "speedup": spread}}}`` over seeds.

    ``speedup`` pairs each seed's run with the reference's run on the same seed:
    ``ttt(reference) / ttt(strategy)``.
    """
    by: dict[tuple[str, str], dict[int, Mapping[str, Any]]] = {}
    for c in cells:
        by.setdefault((c["fleet"], c["strategy"]), {})[c["seed"]] = c
    out: dict[str, dict[str, Any]] = {}
    for (fleet, strategy), runs in by.items():
        ref = by.get((fleet, REFERENCE), {})
        entry: dict[str, Any] = {
            m: spread([r[m] for r in runs.values()]) for m in METRICS
        }
        speedups: list[float | None] = []
        acc_diffs: list[float | None] = []
        for seed, run in runs.items():
            base = ref.get(seed)
            if base is None:
                continue
            a, b = base["time_to_target_s"], run["time_to_target_s"]
            speedups.append(
                a / b if a is not None and b is not None and b > 0 else None
            )
            acc_diffs.append(run["final_accuracy"] - base["final_accuracy"])
        entry["speedup"] = spread(speedups)
        entry["final_accuracy_diff"] = spread(acc_diffs)
        out.setdefault(fleet, {})[strategy] = entry
    return out


def headline(
    cells: Sequence[Mapping[str, Any]], summary: Mapping[str, Mapping[str, Any]]
) -> dict[str, Any]:
    """Issue 4's headline on ``phones-10x``: the best flowerbed strategy's median
    speed-up over Flower FedAvg waiting for all, its final-accuracy difference, and
    both against the ideal time-to-target."""
    table = summary.get(HEADLINE_FLEET, {})
    ours = {
        name: entry
        for name, entry in table.items()
        if not name.startswith("flwr-") and entry["speedup"]["median"] is not None
    }
    if REFERENCE not in table or not ours:
        return {
            "fleet": HEADLINE_FLEET,
            "available": False,
            "reason": "the headline fleet, the reference or a flowerbed "
            "strategy reaching the target is missing from this run",
        }
    best = max(ours, key=lambda n: ours[n]["speedup"]["median"])
    ref_runs = [
        c for c in cells if c["fleet"] == HEADLINE_FLEET and c["strategy"] == REFERENCE
    ]
    ideal = [
        c["samples_to_target"] / c["fleet_throughput_sps"]
        for c in ref_runs
        if c["samples_to_target"] is not None
    ]
    ideal_s = statistics.median(ideal) if ideal else None
    best_ttt = ours[best]["time_to_target_s"]["median"]
    ref_ttt = table[REFERENCE]["time_to_target_s"]["median"]
    speedup = ours[best]["speedup"]["median"]
    acc_diff = ours[best]["final_accuracy_diff"]["median"]
    return {
        "fleet": HEADLINE_FLEET,
        "available": True,
        "reference": REFERENCE,
        "best_strategy": best,
        "median_speedup": speedup,
        "speedup_spread": ours[best]["speedup"],
        "final_accuracy_diff_points": 100 * acc_diff,
        "target_speedup": HEADLINE_SPEEDUP,
        "target_max_accuracy_drop_points": 100 * HEADLINE_MAX_ACC_DROP,
        "target_met": bool(
            speedup >= HEADLINE_SPEEDUP and acc_diff >= -HEADLINE_MAX_ACC_DROP
        ),
        "reference_time_to_target_s": ref_ttt,
        "best_time_to_target_s": best_ttt,
        "ideal_time_to_target_s": ideal_s,
        "best_over_ideal": None
        if ideal_s is None or best_ttt is None
        else best_ttt / ideal_s,
        "reference_over_ideal": None
        if ideal_s is None or ref_ttt is None
        else ref_ttt / ideal_s,
    }
