"""Section "large-batch": where synchronous large-batch training scales (S1).

Three parts:

- ``scaling`` (a model, no training): samples per second of synchronous data
  parallelism on ``N`` = 8 ... 138 Galaxy S10+ phones, wired (switched gigabit
  Ethernet, USB 3.0 adapters) and Wi-Fi (one 802.11ac channel, Bianchi's DCF),
  for the reference LeNet-5 and ResNet-50- and MobileNet-v1-sized models:
  per-sample seconds from the device catalogue (``flowerbed.sims.devices``,
  sources there) times the model's cost factor, 32 samples per phone per step
  (Goyal et al.'s per-worker batch), a ring all-reduce of the gradients
  (``flowerbed.sims.links``). Beside it the physical limit: the all-reduce's
  bandwidth term alone (gradient bytes over the link), fully overlapped with
  compute (``N b / max(b t, bytes term)``).
- ``sync`` (the in-process engine): :class:`LargeBatchSync` itself on ``N`` =
  8 ... 138 simulated phones, wired and Wi-Fi (``flowerbed.sims.span_sim``): a
  small MLP trains for real on mnist1d with the DDP step code while the virtual
  clock charges MobileNet-v1's compute and gradient bytes; the engine's samples
  per virtual second beside the ``scaling`` model's figure for the same
  configuration (they must agree), virtual seconds per round (weights to and
  from the server included) and wall seconds. ``--quick`` leaves it out unless
  named (``--large-batch sync``), then with 8 and 16 phones.
- ``rounds`` (the in-process engine): :class:`LargeBatchRounds` with 138
  simulated phones on each network; virtual seconds per round, samples per
  virtual second, and the wall time of the run.
- ``accuracy``: time to accuracy of the large-batch recipe (LAMB, warm-up) and
  of Flower's FedAvg over the same samples (every phone its 4 samples per
  round: one SGD step on all 4, or four steps of one, the way a FedAvg user
  would take local steps), digits, 138 phones on the switch. FedAvg's rate is
  the best of a sweep on the first seed (chosen with hindsight); then every
  configuration runs on the same further seeds, and the spread is shown.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from .sections import PartsOption, SectionRun

TITLE = "Large-batch synchronous training"
PARTS = ("scaling", "sync", "rounds", "accuracy")
QUICK_SKIPS = ("sync",)
"""Parts ``--quick`` runs only when named in ``--large-batch``."""
SYNC_MODEL = "mobilenet-v1"
SYNC_ROUNDS = 2
SYNC_STEPS = 2
PHONES = (8, 16, 32, 64, 138)
PER_DEVICE_BATCH = 32
MODELS = ("lenet", "mobilenet-v1", "resnet-50")
DEVICE = "galaxy-s10plus"
ROUND_PHONES = 138
ROUND_BATCH_PER_PHONE = 4
ACCURACY_ROUNDS = 30
QUICK_ROUNDS = 3
TARGET_ACCURACY = 0.8
SEEDS = (1, 2, 3)
FEDAVG_LRS = {(1, 4): (0.03, 0.1, 0.3), (4, 1): (0.01, 0.03, 0.1)}
"""FedAvg's rates swept per (local steps, batch): the same 4 samples per phone."""
S1_REFERENCE = (
    "S1 (Na et al., arXiv 2110.12172) report 138 Galaxy S10+ on wired Ethernet at 90% "
    "of a P100's speed on ResNet-50 and ~43x a V100 on MobileNet-v1, both GPUs "
    "running Caffe (whose depthwise convolution on GPUs is slow)"
)


OPTION = PartsOption("large-batch", PARTS)
add_arguments = OPTION.add_arguments
check = OPTION.check
choices = OPTION.choices


def run(ctx: SectionRun) -> dict[str, Any]:
    parts = OPTION.chosen(ctx.args)
    if ctx.quick and not getattr(ctx.args, "large_batch", None):
        parts = [p for p in parts if p not in QUICK_SKIPS]
    data: dict[str, Any] = dict(ctx.previous or {})
    data.pop("error", None)
    step = ctx.tracker(len(parts))
    for part in parts:
        measured = datetime.now(timezone.utc).isoformat(timespec="seconds")
        load = list(os.getloadavg())  # wall-clock columns depend on it
        data[part] = {
            "measured": measured,
            "load_average": load,
            "quick": ctx.quick,  # toy sizes: the page judges no target on them
            **{
                "scaling": scaling,
                "sync": sync,
                "rounds": rounds,
                "accuracy": accuracy,
            }[part](ctx.quick),
        }
        step(part)
    return data


# ------------------------------------------------------------------ scaling
def scaling(quick: bool) -> dict[str, Any]:
    from flowerbed.models import REFERENCE_MODEL, charged_costs
    from flowerbed.sims.devices import get_device
    from flowerbed.sims.links import (
        SwitchedEthernet,
        WifiMedium,
        ring_allreduce_seconds,
        synchronous_throughput,
    )

    phone = get_device(DEVICE)
    networks = {"wired": SwitchedEthernet(), "wifi": WifiMedium()}
    rows = []
    for model in MODELS:
        if model == "lenet":
            from flowerbed.models import build_model, model_num_bytes

            factor, grad_bytes = 1.0, model_num_bytes(build_model(*REFERENCE_MODEL))
        else:
            factor, grad_bytes = charged_costs(model)
        per_sample = phone.seconds_per_sample * factor
        compute = PER_DEVICE_BATCH * per_sample
        alone = PER_DEVICE_BATCH / compute
        for name, net in networks.items():
            for n in PHONES:
                bandwidth = (
                    net.device_mbps  # type: ignore[attr-defined]
                    if name == "wired"
                    else net.saturation_mbps(n) / n  # type: ignore[attr-defined]
                )
                bound = ring_allreduce_seconds(n, grad_bytes, bandwidth, 0.0)
                rate = synchronous_throughput(
                    net, n, PER_DEVICE_BATCH, per_sample, grad_bytes
                )
                rows.append(
                    {
                        "model": model,
                        "network": name,
                        "phones": n,
                        "grad-mb": grad_bytes / 1e6,
                        "compute-s": compute,
                        "allreduce-s": net.allreduce_seconds(n, grad_bytes),
                        "bound-s": bound,
                        "samples-per-s": rate,
                        "efficiency": rate / (n * alone),
                        "limit-samples-per-s": n
                        * PER_DEVICE_BATCH
                        / max(compute, bound),
                    }
                )
    return {
        "device": DEVICE,
        "seconds-per-sample": phone.seconds_per_sample,
        "per-device-batch": PER_DEVICE_BATCH,
        "networks": {k: v.describe() for k, v in networks.items()},
        "rows": rows,
    }


# ------------------------------------------------------------------ sync
def sync(quick: bool) -> dict[str, Any]:
    """LargeBatchSync on the in-process engine (module doc, part ``sync``)."""
    from flowerbed.models import charged_costs
    from flowerbed.sims.devices import get_device
    from flowerbed.sims.links import (
        SwitchedEthernet,
        WifiMedium,
        synchronous_throughput,
    )
    from flowerbed.sims.span_sim import simulate
    from flowerbed.strategies import LargeBatchSync
    from flowerbed.strategies.large_batch_options import (
        AllReduceRecipe,
        MemberProfiling,
    )

    factor, grad_bytes = charged_costs(SYNC_MODEL)
    per_sample = get_device(DEVICE).seconds_per_sample * factor
    rows = []
    for name, net in (("wired", SwitchedEthernet()), ("wifi", WifiMedium())):
        for n in (8, 16) if quick else PHONES:
            batch = PER_DEVICE_BATCH * n
            strategy = LargeBatchSync(
                fraction_evaluate=0.0,
                min_train_nodes=n,
                min_available_nodes=n,
                model="deep-mlp",
                model_args={"in_features": 40, "hidden": 64, "depth": 2},
                dataset="mnist1d",
                batch_size=batch,
                steps_per_round=1 if quick else SYNC_STEPS,
                recipe=AllReduceRecipe(
                    optimizer="lamb",
                    base_lr=0.01,
                    base_batch=batch,
                ),
                profiling=MemberProfiling(profile_batch=1, profile_repeats=1),
            )
            run = simulate(
                strategy,
                [DEVICE] * n,
                1 if quick else SYNC_ROUNDS,
                network=net,
                charge_as=SYNC_MODEL,
            )
            metrics = run.result.train_metrics_clientapp
            last = metrics[max(metrics)]
            ends = run.round_end_s
            model = synchronous_throughput(
                net, n, PER_DEVICE_BATCH, per_sample, grad_bytes
            )
            rows.append(
                {
                    "network": name,
                    "phones": n,
                    "samples-per-s": float(last["samples-per-s"]),
                    "model-samples-per-s": model,
                    "efficiency": float(last["samples-per-s"]) * per_sample / n,
                    "step-s": float(last["step-s"]),
                    "comm-s": float(last["comm-s"]),
                    "virtual-s-per-round": ends[-1] - ends[-2],
                    "wall-s": run.wall_s,
                }
            )
    return {
        "device": DEVICE,
        "charged": SYNC_MODEL,
        "per-device-batch": PER_DEVICE_BATCH,
        "rows": rows,
    }


# ------------------------------------------------------------------ engine runs
def _phones_run(
    strategy: Any,
    network: Any,
    rounds_: int,
    phones: int,
    *,
    seed: int = SEEDS[0],
    steps: int = 1,
) -> tuple[list[Any], float]:
    """``rounds_`` rounds of ``phones`` phones, each taking ``steps`` local steps
    over its :data:`ROUND_BATCH_PER_PHONE` samples per round."""
    from flowerbed.sims.config import Scenario
    from flowerbed.sims.scenario import build_fleet_grid, run_server

    from .suite_section import quiet

    quiet()  # after the imports: importing flwr's logger resets its level
    config = {
        "dataset": "digits",
        "model": "lenet",
        "num-nodes": phones,
        "num-rounds": rounds_,
        "dropout": 0.0,
        "seed": seed,
        "local-steps": steps,
        "batch-size": ROUND_BATCH_PER_PHONE // steps,
    }
    grid = build_fleet_grid(config, [DEVICE] * phones)
    grid.network = network
    began = time.perf_counter()
    try:
        outcome = run_server(
            grid, Scenario.from_run_config(config), strategy=strategy, write=False
        )
    finally:
        grid.close()
    return outcome.records, time.perf_counter() - began


def _rounds_strategy(phones: int) -> Any:
    from flowerbed.strategies import LargeBatchRounds

    batch = phones * ROUND_BATCH_PER_PHONE
    return LargeBatchRounds.from_settings(
        fraction_evaluate=0.0,
        min_train_nodes=phones,
        min_available_nodes=phones,
        batch_size=batch,
        optimizer="lamb",
        base_lr=0.02,
        base_batch=batch,
        warmup_steps=3,
    )


def rounds(quick: bool) -> dict[str, Any]:
    from flowerbed.sims.links import SwitchedEthernet, WifiMedium

    phones = 16 if quick else ROUND_PHONES
    count = 2 if quick else 5
    out = []
    for name, net in (("wired", SwitchedEthernet()), ("wifi", WifiMedium())):
        records, wall = _phones_run(_rounds_strategy(phones), net, count, phones)
        times = [r.virtual_time_s for r in records]
        per_round = (times[-1] - 0.0) / len(times)
        out.append(
            {
                "network": name,
                "phones": phones,
                "rounds": count,
                "virtual-s-per-round": per_round,
                "samples-per-virtual-s": phones * ROUND_BATCH_PER_PHONE / per_round,
                "wall-s": wall,
            }
        )
    return {"rows": out}


def accuracy(quick: bool) -> dict[str, Any]:
    from flowerbed.sims.links import SwitchedEthernet

    phones = 16 if quick else ROUND_PHONES
    count = QUICK_ROUNDS if quick else ACCURACY_ROUNDS
    seeds = SEEDS[:1] if quick else SEEDS

    def one(name: str, make: Any, steps: int, seed: int) -> dict[str, Any]:
        records, wall = _phones_run(
            make(), SwitchedEthernet(), count, phones, seed=seed, steps=steps
        )
        return {**_summary(name, records, wall), "seed": seed}

    large = "LargeBatchRounds (LAMB, warm-up 3)"
    chosen: list[tuple[str, Any, int]] = [(large, lambda: _rounds_strategy(phones), 1)]
    sweep: list[dict[str, Any]] = []
    for (steps, batch), lrs in FEDAVG_LRS.items():
        family = []
        for lr in lrs[:1] if quick else lrs:
            config = (
                f"Flower FedAvg, {steps} step(s) of {batch}, lr {lr:g}",
                _fedavg_maker(lr, phones),
                steps,
            )
            family.append((one(*config, seeds[0]), config))
        sweep += [result for result, _ in family]
        chosen.append(max(family, key=lambda f: f[0]["final-accuracy"])[1])
    runs = [one(*chosen[0], seeds[0])]
    runs += [r for r in sweep if r["strategy"] in {c[0] for c in chosen}]
    for seed in seeds[1:]:
        runs += [one(*c, seed) for c in chosen]
    return {
        "phones": phones,
        "rounds": count,
        "target": TARGET_ACCURACY,
        "seeds": list(seeds),
        "runs": runs,
        "sweep": sweep,
    }


def _fedavg_maker(lr: float, phones: int) -> Any:
    return lambda: _fedavg_at(lr, phones)


def _fedavg_at(lr: float, phones: int) -> Any:
    """Flower's FedAvg with the clients' SGD rate set (the run sets the steps)."""
    from flowerbed import keys
    from flwr.app import ConfigRecord
    from flwr.serverapp.strategy import FedAvg

    class Tuned(FedAvg):  # type: ignore[misc]
        def configure_train(self, server_round, arrays, config, grid):  # type: ignore[no-untyped-def]
            config = ConfigRecord(dict(config))
            config[keys.LEARNING_RATE] = lr
            return super().configure_train(server_round, arrays, config, grid)

    return Tuned(
        fraction_evaluate=0.0, min_train_nodes=phones, min_available_nodes=phones
    )


def _summary(name: str, records: list[Any], wall: float) -> dict[str, Any]:
    reached = next(
        (r.virtual_time_s for r in records if r.accuracy >= TARGET_ACCURACY), None
    )
    return {
        "strategy": name,
        "final-accuracy": records[-1].accuracy if records else 0.0,
        "best-accuracy": max((r.accuracy for r in records), default=0.0),
        "time-to-target-s": reached,
        "virtual-s": records[-1].virtual_time_s if records else 0.0,
        "wall-s": wall,
    }


# ------------------------------------------------------------------ render
def render(data: Mapping[str, Any]) -> list[str]:
    lines = ["## Large-batch synchronous training (S1)", ""]
    if "error" in data:
        return [*lines, f"The section failed: {data['error']}", ""]
    renderers = {
        "scaling": _render_scaling,
        "sync": _render_sync,
        "rounds": _render_rounds,
        "accuracy": _render_accuracy,
    }
    for part, render_part in renderers.items():
        if part in data:
            lines += [_provenance(data[part]), "", *render_part(data[part])]
    lines += [f"GPU reference (not measured here): {S1_REFERENCE}.", ""]
    return lines


def _provenance(d: Mapping[str, Any]) -> str:
    """When a part was measured: the page's top line names the section's last
    run, which may have rerun other parts only (``--large-batch PART``)."""
    if "measured" not in d:
        return (
            "Measured by an earlier run than the one named at the top of the page "
            "(that run did not record when each part was measured)."
        )
    load = d.get("load_average") or []
    at_load = (
        ", load average at the start of the part "
        + " / ".join(f"{x:.2f}" for x in load)
        + " (1/5/15 min)"
        if load
        else ""
    )
    toy = " at toy size (`--quick`)" if d.get("quick") else ""
    return f"Part measured {d['measured']} (UTC){toy}{at_load}."


def _render_scaling(d: Mapping[str, Any]) -> list[str]:
    lines = [
        f"Samples per second of synchronous data parallelism on `{d['device']}` "
        f"phones ({d['per-device-batch']} samples per phone per step, compute then "
        "ring all-reduce, no overlap); efficiency = throughput / (N x one phone); "
        "limit = the all-reduce's bandwidth term fully overlapped with compute. "
        f"Networks: wired = {d['networks']['wired']}; Wi-Fi = {d['networks']['wifi']}.",
        "",
        "| model | grad MB | network | N | compute s/step | all-reduce s | bound s "
        "| samples/s | efficiency | limit samples/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        lines.append(
            f"| {r['model']} | {r['grad-mb']:.2f} | {r['network']} | {r['phones']} "
            f"| {r['compute-s']:.3g} | {r['allreduce-s']:.3g} | {r['bound-s']:.3g} "
            f"| {r['samples-per-s']:.3g} | {r['efficiency']:.0%} "
            f"| {r['limit-samples-per-s']:.3g} |"
        )
    return [*lines, ""]


def _render_sync(d: Mapping[str, Any]) -> list[str]:
    lines = [
        f"LargeBatchSync on the in-process engine: `{d['device']}` phones, "
        f"{d['per-device-batch']} samples per phone per step, a small MLP trained "
        f"on mnist1d with the DDP step code while the virtual clock charges "
        f"{d['charged']}'s compute and gradient bytes (flowerbed.sims.span_sim); "
        "samples/s per step from the rounds' metrics beside the scaling model's "
        "figure; a round also moves the (small) trained model to and from the "
        "server:",
        "",
        "| network | phones | samples/s | model samples/s | efficiency | step s "
        "| all-reduce s | virtual s / round | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        lines.append(
            f"| {r['network']} | {r['phones']} | {r['samples-per-s']:.3g} "
            f"| {r['model-samples-per-s']:.3g} | {r['efficiency']:.0%} "
            f"| {r['step-s']:.3g} | {r['comm-s']:.3g} "
            f"| {r['virtual-s-per-round']:.3g} | {r['wall-s']:.1f} |"
        )
    return [*lines, ""]


def _render_rounds(d: Mapping[str, Any]) -> list[str]:
    lines = [
        "LargeBatchRounds on the in-process engine (LeNet on digits, "
        f"{ROUND_BATCH_PER_PHONE} samples per phone per round), the round's "
        "transfers charged to the shared network:",
        "",
        "| network | phones | rounds | virtual s / round | samples / virtual s "
        "| wall s |",
        "|---|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        lines.append(
            f"| {r['network']} | {r['phones']} | {r['rounds']} "
            f"| {r['virtual-s-per-round']:.3g} | {r['samples-per-virtual-s']:.3g} "
            f"| {r['wall-s']:.1f} |"
        )
    return [*lines, ""]


def _render_accuracy(d: Mapping[str, Any]) -> list[str]:
    import statistics

    seeds = d.get("seeds", [1])
    lines = [
        f"Time to {d['target']:.0%} test accuracy, {d['phones']} phones on the switch, "
        f"{d['rounds']} rounds over the same samples ({ROUND_BATCH_PER_PHONE} per "
        f"phone per round), seeds {', '.join(map(str, seeds))}: mean [min, max]. "
        "FedAvg's rate is the best final accuracy of a sweep on the first seed "
        "(chosen with hindsight):",
        "",
        "| strategy | seeds | final accuracy | best accuracy | virtual s to target "
        "| virtual s | wall s |",
        "|---|---|---|---|---|---|---|",
    ]

    def spread(values: list[float], fmt: str) -> str:
        if len(values) == 1:
            return format(values[0], fmt)
        mean = statistics.fmean(values)
        low, high = min(values), max(values)
        return f"{mean:{fmt}} [{low:{fmt}}, {high:{fmt}}]"

    names = list(dict.fromkeys(r["strategy"] for r in d["runs"]))
    for name in names:
        group = [r for r in d["runs"] if r["strategy"] == name]
        reached = [r["time-to-target-s"] for r in group if r["time-to-target-s"]]
        target = (
            "not reached"
            if not reached
            else spread(reached, ".3g")
            + (
                ""
                if len(reached) == len(group)
                else f" (reached on {len(reached)} of {len(group)} seeds)"
            )
        )
        lines.append(
            f"| {name} | {len(group)} "
            f"| {spread([r['final-accuracy'] for r in group], '.3f')} "
            f"| {spread([r['best-accuracy'] for r in group], '.3f')} | {target} "
            f"| {spread([r['virtual-s'] for r in group], '.3g')} "
            f"| {spread([r['wall-s'] for r in group], '.1f')} |"
        )
    if d.get("sweep"):
        tried = ", ".join(
            f"{r['strategy'].removeprefix('Flower FedAvg, ')}: "
            f"{r['final-accuracy']:.3f}"
            for r in d["sweep"]
        )
        lines += ["", f"FedAvg sweep (seed {seeds[0]}, final accuracy): {tried}."]
    finals = {
        name: statistics.fmean(
            r["final-accuracy"] for r in d["runs"] if r["strategy"] == name
        )
        for name in names
    }
    large, *fedavg = names
    if fedavg and not d.get("quick"):
        best = max(fedavg, key=lambda n: finals[n])
        diff = 100 * (finals[large] - finals[best])
        lines += [
            "",
            "Target: large batches cost no more than 1 point of final accuracy "
            f"against FedAvg over the same samples: {large} {finals[large]:.3f} vs "
            f"{best} {finals[best]:.3f} (mean over seeds), {diff:+.1f} points "
            + ("(met)." if diff >= -1.0 else "(**not met**)."),
        ]
    return [*lines, ""]
