"""Section "pipeline": pipeline training across unequal boards (FTPipeHD, S3).

Three parts:

- ``local``: real runs of :class:`PipelineTraining` on local processes, one per
  emulated device (``flowerbed.sims.pipeline_local``: catalogue speeds, the
  emulation slowed ``TIME_SCALE`` times so that real compute stays below it on a
  small shared machine), a VGG-style CNN on 32x32 digits. Side by side, on a
  Jetson Nano, a Pi 4B and a Pi 3B at half clock (a 13x spread): samples per
  second of (a) an even partition — equal layers per stage, and the
  homogeneous assumption of PipeDream-style partitioners (stages of equal
  compute, as if the devices were alike) — (b) FTPipeHD's DP, (c) the DP when
  the Pi 4B slows 4x mid-run, with and without re-partitioning, (d) the best
  single device alone. The ideal is the sum of the members' capacities (each
  device training the whole model alone), the bound without communication.
  Targets (judged on full runs only): >= 3x the even partition, >= 0.8 of the
  ideal.
- ``failures``: a Jetson Nano, a Pi 5, a Pi 4B and a Pi 3B at half clock; one
  member dies mid-round (then two, not adjacent); time lost against the same job
  without failure, with replication every R steps and with none (restart from
  the last segment, the central copy).
- ``deployment``: a real Flower deployment (a SuperLink and four SuperNodes on
  127.0.0.1, the span ClientApp, :mod:`flowerbed.bench.span_deployment`); a
  board is killed mid-segment both ways (with its ClientApp; its
  ``flower-supernode`` alone), and for each kill mode the time from the kill to
  the next segment's first step (``failure-to-next-step-s``) with what it was
  spent on. Left out of ``--quick`` (it starts five Flower processes).
- ``virtual``: the makespan model (the virtual clock) for fleets larger than
  this machine, 3 to 11 catalogue boards on a VGG-style CNN (width 16), links
  from the catalogue; and the model's error against every local run above
  (target: within 15%).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .sections import PartsOption, SectionRun

TITLE = "Pipeline training across unequal boards"
PARTS = ("local", "failures", "deployment", "virtual")
FLEET = ("jetson-nano", "rpi4b", "rpi3b@2")
FAILURE_FLEET = ("jetson-nano", "rpi5", "rpi4b", "rpi3b@2")
VIRTUAL_CYCLE = ("jetson-nano", "rpi5", "rpi4b", "rpi3b")
TIME_SCALE = 4.0
MODEL_ARGS = {"in_channels": 1, "image_size": 32, "num_classes": 10, "width": 8}
VIRTUAL_ARGS = {"in_channels": 3, "image_size": 32, "num_classes": 10, "width": 16}
BATCH, MICRO, K, R = 32, 16, 8, 3
SLOW_FACTOR = 4.0
TARGET_SPEEDUP = 3.0
TARGET_IDEAL = 0.8
TARGET_MODEL_ERROR = 0.15


OPTION = PartsOption("pipeline", PARTS)
add_arguments = OPTION.add_arguments
check = OPTION.check
choices = OPTION.choices


def run(ctx: SectionRun) -> dict[str, Any]:
    import logging

    import flwr.common.logger  # noqa: F401  (sets the flwr logger's level on import)

    logging.getLogger("flwr").setLevel(logging.WARNING)
    parts = OPTION.chosen(ctx.args)
    data: dict[str, Any] = dict(ctx.previous or {})
    data.pop("error", None)
    step = ctx.tracker(len(parts))
    began = time.monotonic()
    load = _load()
    if "local" in parts:
        data["local"] = local(ctx.quick)
        step("local")
    if "failures" in parts:
        # --quick leaves the failure runs out (each starts four processes; the
        # crash path is tested in tests/test_pipeline_training.py).
        if not ctx.quick:
            data["failures"] = failures(ctx.quick)
        step("failures")
    if "deployment" in parts:
        if not ctx.quick:
            data["deployment"] = deployment()
        step("deployment")
    if "virtual" in parts:
        data["virtual"] = virtual(data.get("local"))
        step("virtual")
    data["meta"] = {
        "seconds": time.monotonic() - began,
        "load-at-start": load,
        "time-scale": TIME_SCALE,
        "quick": ctx.quick,
    }
    return data


def _load() -> float:
    try:
        import os

        return float(os.getloadavg()[0])
    except OSError:
        return -1.0


# --------------------------------------------------------------------------------
# Local runs
# --------------------------------------------------------------------------------


def _settings(quick: bool, **changes: Any) -> dict[str, Any]:
    if quick:
        settings: dict[str, Any] = {
            "model": "deep-mlp",
            "model_args": {"in_features": 64, "hidden": 32, "depth": 6},
            "input_shape": (1, 8, 8),
            "dataset": "digits",
            "steps_per_round": 4,
            "batch_size": 16,
            "micro_batches": 4,
        }
    else:
        settings = {
            "model": "vgg",
            "model_args": MODEL_ARGS,
            "input_shape": (1, 32, 32),
            "dataset": "digits32",
            "steps_per_round": K,
            "batch_size": BATCH,
            "micro_batches": MICRO,
        }
    settings.update({"replicate_every": R, "lr": 0.05})
    settings.update(changes)
    return settings


def _homogeneous_sizes(settings: Mapping[str, Any], stages: int) -> list[int]:
    """PipeDream-style stages: equal compute, as if every device were alike
    (the DP with equal powers on per-layer FLOPs)."""
    import torch
    from flowerbed.models import build_sequential, count_macs
    from flowerbed.parallel.pipeline.partition import LayerCosts, partition

    model = build_sequential(settings["model"], settings["model_args"])
    micro = settings["batch_size"] // settings["micro_batches"]
    x = torch.zeros((micro, *settings["input_shape"]))
    macs = []
    with torch.no_grad():
        for layer in model:
            macs.append(float(count_macs(layer, x)) + 1.0)
            x = layer(x)
    n = len(macs)
    costs = LayerCosts(
        tuple(2 * m for m in macs), tuple(4 * m for m in macs), (1.0,) * n, (1.0,) * n
    )
    return partition(costs, [1.0] * stages).sizes


def _run(
    devices: Sequence[str], settings: dict[str, Any], rounds: int, **aids: Any
) -> dict[str, Any]:
    from flowerbed.sims.pipeline_local import nodes_for, run_local

    nodes = nodes_for(devices, TIME_SCALE)
    for index, aid in aids.get("crash", {}).items():
        nodes[index].crash_at_step = aid
    for index, (at, factor) in aids.get("slow", {}).items():
        nodes[index].slow_from_step, nodes[index].slow_factor = at, factor
    done = run_local(nodes, settings, rounds=rounds)
    rounds_data = {
        int(r): dict(m) for r, m in done.result.train_metrics_clientapp.items()
    }
    steady = [m["samples-per-s"] for m in rounds_data.values()]
    examples = sum(m["num-examples"] for m in rounds_data.values())
    seconds = sum(m["round-s"] for m in rounds_data.values())
    errors = [
        abs(m["model-step-s"] - m["step-s"]) / m["step-s"]
        for m in rounds_data.values()
        if m["step-s"] > 0
    ]
    forecast = [
        abs(m["predicted-step-s"] - m["step-s"]) / m["step-s"]
        for m in rounds_data.values()
        if m["step-s"] > 0
    ]
    return {
        "devices": list(devices),
        "rounds": rounds_data,
        "samples-per-s": statistics.median(steady) if steady else 0.0,
        "last-samples-per-s": steady[-1] if steady else 0.0,
        "end-to-end-samples-per-s": examples / seconds if seconds else 0.0,
        "partitions": [m["partition"] for m in rounds_data.values()],
        "lost-steps": sum(m["lost-steps"] for m in rounds_data.values()),
        "wall-s": done.wall_s,
        "events": done.events,
        "model-errors": errors,
        "forecast-errors": forecast,
        "failure-s": sum(m["failure-s"] for m in rounds_data.values()),
        "power": {done.members[n]: p for n, p in done.power.items()},
        "profiled-power": [p for _, p in sorted(done.profiled_power.items())],
        "reference-s": done.reference_s,
    }


def local(quick: bool) -> dict[str, Any]:
    fleet = FLEET
    rounds = 1 if quick else 2
    base = _settings(quick)
    layers_even = _even_sizes(base, len(fleet))
    homogeneous = _homogeneous_sizes(base, len(fleet))
    runs: dict[str, Any] = {}
    runs["dp"] = _run(fleet, base, rounds)
    if not quick:  # --quick proves the structure with the DP run alone
        runs["even-compute"] = _run(
            fleet, _settings(quick, stage_sizes=homogeneous), rounds
        )
        runs["even-layers"] = _run(
            fleet, _settings(quick, stage_sizes=layers_even), rounds
        )
        runs["single"] = _run(fleet, _settings(quick, num_stages=1), rounds)
        slow = {1: (K, SLOW_FACTOR)}  # the Pi 4B slows from round 2 on
        runs["dp-slowdown"] = _run(fleet, base, 3, slow=slow)
        runs["dp-slowdown-fixed"] = _run(
            fleet, _settings(quick, repartition=False), 3, slow=slow
        )
    dp = runs["dp"]
    micro = base["batch_size"] / base["micro_batches"]
    ideal = sum(micro / (dp["reference-s"] * p) for p in dp["profiled-power"] if p > 0)
    return {
        "fleet": list(fleet),
        "settings": {k: v for k, v in base.items() if k != "input_shape"},
        "runs": runs,
        "ideal-samples-per-s": ideal,
        "even-layers-sizes": layers_even,
        "even-compute-sizes": homogeneous,
    }


def _even_sizes(settings: Mapping[str, Any], stages: int) -> list[int]:
    from flowerbed.models import build_sequential
    from flowerbed.parallel.pipeline.partition import even_partition
    from flowerbed.parallel.plan import stage_sizes

    layers = len(build_sequential(settings["model"], settings["model_args"]))
    return stage_sizes(even_partition(layers, stages))


# --------------------------------------------------------------------------------
# Failures
# --------------------------------------------------------------------------------


def failures(quick: bool) -> dict[str, Any]:
    fleet = FAILURE_FLEET
    rounds = 2
    # In round 2, one step after a replication (R = 3): K + 5 (full), K + 3 (quick).
    crash_step = 7 if quick else K + 5
    cases = {
        "none": {},
        "one": {"crash": {1: crash_step}},
        "two": {"crash": {1: crash_step, 3: crash_step}},  # ranks 1 and 3
    }
    out: dict[str, Any] = {"fleet": list(fleet), "crash-step": crash_step}
    for every, label in ((R, "replicated"), (0, "segment-restart")):
        settings = _settings(quick, replicate_every=every)
        for case, aids in cases.items():
            if quick and (case != "one" or label != "replicated"):
                continue  # --quick: one failure, replicated
            out[f"{label}/{case}"] = _run(fleet, settings, rounds, **aids)
    return out


# --------------------------------------------------------------------------------
# A real deployment
# --------------------------------------------------------------------------------


def deployment() -> dict[str, Any]:
    """Kills on a real Flower deployment (:mod:`flowerbed.bench.span_deployment`)."""
    import tempfile

    from . import span_deployment

    with tempfile.TemporaryDirectory(prefix="flowerbed-span-deploy-") as tmp:
        out = span_deployment.run(Path(tmp) / "kills")
        sized = span_deployment.run(Path(tmp) / "sized", sized=True)
    out["sized"] = {k: sized[k] for k in ("rounds", "job-wall-s", "finished")}
    return out


# --------------------------------------------------------------------------------
# The virtual clock
# --------------------------------------------------------------------------------


def virtual(local_data: Mapping[str, Any] | None) -> dict[str, Any]:
    """Predicted throughput of larger fleets, and the model's measured error."""
    import torch
    from flowerbed.models import build_sequential, count_macs
    from flowerbed.parallel.pipeline.makespan import replicate_s
    from flowerbed.parallel.pipeline.planner import Layout, PipelinePlanner
    from flowerbed.sims.devices import get_device
    from flowerbed.sims.pipeline_local import device_gflops

    model = build_sequential("vgg", VIRTUAL_ARGS)
    micro = BATCH // MICRO
    x = torch.zeros((micro, 3, 32, 32))
    macs, out_bytes, state = [], [], []
    with torch.no_grad():
        for layer in model:
            macs.append(float(count_macs(layer, x)))
            x = layer(x)
            out_bytes.append(4.0 * x.numel())
            state.append(4.0 * sum(p.numel() for p in layer.parameters()))
    rows = []
    for count in (3, 4, 6, 8, 11):
        devices = [VIRTUAL_CYCLE[i % len(VIRTUAL_CYCLE)] for i in range(count)]
        rates = [device_gflops(d) * 1e9 for d in devices]
        fastest = max(rates)
        planner = PipelinePlanner(
            out_bytes=out_bytes,
            state_bytes=state,
            micro_batches=MICRO,
            link_bandwidth=min(get_device(d).uplink_mbps for d in devices) * 1e6 / 8,
        )
        planner.profiled(
            {
                i: (
                    [2 * m / rate for m in macs],
                    [4 * m / rate for m in macs],
                )
                for i, rate in enumerate(rates)
            }
        )
        members = list(range(count))
        best, t_dp = planner.best_subset(members)
        homogeneous = PipelinePlanner(
            out_bytes=out_bytes,
            state_bytes=state,
            micro_batches=MICRO,
            link_bandwidth=planner.link_bandwidth,
        )
        homogeneous.profiled(
            {
                i: ([2 * m / fastest for m in macs], [4 * m / fastest for m in macs])
                for i in members
            }
        )
        even_layout = Layout(tuple(members), homogeneous.best(members)[0].bounds)
        _, t_even = planner.predict(even_layout)
        ideal = sum(micro / (6 * sum(macs) / r) for r in rates)
        used = len(best.members)
        stage_state = [
            sum(state[best.bounds[s] : best.bounds[s + 1]]) for s in range(used)
        ]
        bw = [planner.link(a, (a + 1) % count) for a in best.members]
        repl = replicate_s(stage_state, bw) / R
        rows.append(
            {
                "devices": count,
                "dp-samples-per-s": BATCH / t_dp,
                "even-samples-per-s": BATCH / t_even,
                "ideal-samples-per-s": ideal,
                "dp-sizes": best.sizes,
                "used": used,
                "replication-s-per-step": repl,
                "step-s": t_dp,
            }
        )
    errors: list[float] = []
    forecast: list[float] = []
    for run_data in ((local_data or {}).get("runs") or {}).values():
        errors += run_data.get("model-errors", [])
        forecast += run_data.get("forecast-errors", [])
    return {
        "model": "vgg width 16, 3x32x32",
        "rows": rows,
        "model-errors": errors,
        "max-model-error": max(errors) if errors else None,
        "median-model-error": statistics.median(errors) if errors else None,
        "median-forecast-error": statistics.median(forecast) if forecast else None,
    }


# --------------------------------------------------------------------------------
# The page
# --------------------------------------------------------------------------------


def _met(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def render(data: Mapping[str, Any]) -> list[str]:
    lines = ["## Pipeline training across unequal boards (FTPipeHD, S3)", ""]
    if "error" in data:
        return [*lines, f"The section failed: {data['error']}", ""]
    meta = data.get("meta", {})
    quick = bool(meta.get("quick"))
    if quick:
        lines += [
            f"A quick run (`--quick`), toy sizes: {meta.get('seconds', 0) / 60:.1f} "
            f"min, load average {meta.get('load-at-start', -1):.1f} at the start; "
            f"devices emulated {meta.get('time-scale', TIME_SCALE):g}x slower than "
            "the catalogue. It checks that the section runs; no target is judged.",
            "",
        ]
    elif meta:
        lines += [
            f"Measured by `flowerbed bench --sections pipeline` in "
            f"{meta.get('seconds', 0) / 60:.1f} min (load average "
            f"{meta.get('load-at-start', -1):.1f} at the start, 2 cores); devices "
            f"emulated {meta.get('time-scale', TIME_SCALE):g}x slower than the "
            "catalogue (ratios do not depend on it).",
            "",
        ]
    if "local" in data:
        lines += _render_local(data["local"], judged=not quick)
    if "failures" in data:
        lines += _render_failures(data["failures"])
    if "deployment" in data:
        lines += _render_deployment(data["deployment"])
    if "virtual" in data:
        lines += _render_virtual(data["virtual"], judged=not quick)
    return lines


def _render_local(d: Mapping[str, Any], judged: bool = True) -> list[str]:
    runs = d["runs"]
    ideal = d["ideal-samples-per-s"]
    labels = {
        "even-layers": f"(a) even: equal layers {d['even-layers-sizes']}",
        "even-compute": "(a) even: equal compute (PipeDream's homogeneous "
        f"assumption) {d['even-compute-sizes']}",
        "dp": "(b) FTPipeHD DP",
        "dp-slowdown": f"(c) DP, Pi 4B {SLOW_FACTOR:g}x slower from round 2, "
        "re-partitioning",
        "dp-slowdown-fixed": "(c) same slowdown, partition kept",
        "single": "(d) best single device",
    }
    lines = [
        f"### Throughput on {', '.join(d['fleet'])} (local processes)",
        "",
        f"Model `{d['settings']['model']}`, {d['settings']['batch_size']} samples per "
        f"step in {d['settings']['micro_batches']} micro-batches, 1F1B, replication "
        f"every {d['settings']['replicate_every']} steps. Steady samples/s = batch / "
        "measured step time (median over rounds; for (c) the last round); "
        "end-to-end includes each round's Flower messages and group set-up.",
        "",
        "| configuration | partitions | samples/s | end-to-end samples/s | x even "
        "(compute) | of ideal |",
        "|---|---|---|---|---|---|",
    ]
    base = runs.get("even-compute", {}).get("samples-per-s") or math.nan
    for key, label in labels.items():
        if key not in runs:
            continue
        r = runs[key]
        value = (
            r["last-samples-per-s"] if key.startswith("dp-slow") else r["samples-per-s"]
        )
        lines.append(
            f"| {label} | {r['partitions']} | {value:.2f} "
            f"| {r['end-to-end-samples-per-s']:.2f} "
            f"| {'–' if math.isnan(base) else f'{value / base:.2f}'} "
            f"| {value / ideal:.2f} |"
        )
    dp = runs["dp"]["samples-per-s"]
    speedup = dp / base
    over_layers = ""
    if "even-layers" in runs:
        speedup_layers = dp / (runs["even-layers"]["samples-per-s"] or math.nan)
        over_layers = f", {speedup_layers:.2f}x over equal layers"
    even = (
        f"- Target >= {TARGET_SPEEDUP:g}x over the even partition: DP "
        f"{speedup:.2f}x over equal compute{over_layers} "
        f"— {_met(speedup >= TARGET_SPEEDUP)}."
        if "even-compute" in runs
        else f"- Target >= {TARGET_SPEEDUP:g}x over the even partition: not "
        "measured (the even partitions did not run)."
    )
    lines += [
        "",
        f"Ideal (sum of the members' capacities, each training the whole model "
        f"alone): {ideal:.2f} samples/s.",
    ]
    if judged:
        lines += [
            "",
            even,
            f"- Target >= {TARGET_IDEAL:g} of the ideal: {dp / ideal:.2f} — "
            f"{_met(dp / ideal >= TARGET_IDEAL)}.",
        ]
    for key in ("dp-slowdown", "dp-slowdown-fixed"):
        if key in runs and runs[key]["events"]:
            repartitions = [e for e in runs[key]["events"] if "re-partition" in e]
            if repartitions:
                lines.append(f"- Re-partition logged: `{repartitions[0]}`")
    return [*lines, ""]


def _render_failures(d: Mapping[str, Any]) -> list[str]:
    lines = [
        f"### Failures on {', '.join(d['fleet'])}",
        "",
        f"Members die (their process exits) at step {d['crash-step']}, mid-round 2. "
        "Time lost = the failed attempt's seconds beyond the steps kept (its "
        "set-up, the lost steps, the wait until the loss was known), as the "
        "strategy measures it (`failure-s`); replicated = a ring copy every "
        f"{R} steps, segment restart = no replication, back to the last segment "
        "(the central copy). Job wall = the whole job (it finishes on the "
        "survivors, whose pipeline may be faster or slower than before).",
        "",
        "| replication | failures | lost steps | time lost s | job wall s |",
        "|---|---|---|---|---|",
    ]
    for label in ("replicated", "segment-restart"):
        for case in ("none", "one", "two"):
            r = d.get(f"{label}/{case}")
            if r is None:
                continue
            lines.append(
                f"| {label} | {case} | {r['lost-steps']} | {r['failure-s']:.1f} "
                f"| {r['wall-s']:.1f} |"
            )
    return [*lines, ""]


def _render_deployment(d: Mapping[str, Any]) -> list[str]:
    lines = [
        "### A lost board on a real deployment",
        "",
        "A SuperLink and four SuperNodes on 127.0.0.1 (one board 10x slower) run "
        "the pipeline job; mid-round 2 a board is killed with its ClientApp, "
        "mid-round 3 another board's `flower-supernode` alone. Delivered = the "
        "next segment's message at a survivor's SuperNode (the loss found, the "
        "job re-planned; a SuperNode without messages looks again after 3 s); "
        "first step = the survivors' next segment starting "
        "(`failure-to-next-step-s`, target 10 s), after a fresh `flwr-clientapp` "
        "process per message (ClientApp start: the process, its imports, the "
        "message) and the rendezvous.",
        "",
        "| kill | delivered s | first step s | member set-up s | ClientApp start s "
        "| rendezvous s |",
        "|---|---|---|---|---|---|",
    ]
    for mode, k in d.get("kills", {}).items():
        lines.append(
            f"| {mode} | {k['delivered-s']:.1f} | {k['failure-to-next-step-s']:.1f} "
            f"| {k['member-setup-s']:.1f} | {k['clientapp-start-s']:.1f} "
            f"| {k['rendezvous-s']:.1f} |"
        )
    rounds = d.get("rounds", {})
    if rounds:
        lines += [
            "",
            "Set-up per round (fixed 12 steps; the segment that completed the "
            "round): the segment's wall time less its steps' time, and the "
            "slowest member's own set-up from its process's start to its first "
            "step.",
            "",
            "| round | set-up s | segment s | share | member set-up s |",
            "|---|---|---|---|---|",
        ]
        for r, v in sorted(rounds.items(), key=lambda kv: int(kv[0])):
            lines.append(
                f"| {r} | {v['setup-s']:.1f} | {v['segment-s']:.1f} "
                f"| {100 * v['setup-share']:.0f}% | {v['member-setup-s']:.1f} |"
            )
    finished = "finished" if d.get("finished") else "did not finish"
    lines += ["", f"The job {finished} in {d.get('job-wall-s', 0):.0f} s.", ""]
    sized = d.get("sized", {})
    if sized.get("rounds"):
        lines += [
            "The same fleet without kills, two rounds with segments sized by the "
            "strategy (`steps_per_round=None`: round 1 runs 20 steps, later "
            "rounds as many as keep set-up at most 10% of a round):",
            "",
            "| round | steps next | set-up s | segment s | share |",
            "|---|---|---|---|---|",
        ]
        for r, v in sorted(sized["rounds"].items(), key=lambda kv: int(kv[0])):
            lines.append(
                f"| {r} | {v.get('next-steps', 0)} | {v['setup-s']:.1f} "
                f"| {v['segment-s']:.1f} | {100 * v['setup-share']:.0f}% |"
            )
        lines.append("")
    return lines


def _render_virtual(d: Mapping[str, Any], judged: bool = True) -> list[str]:
    lines = [
        "### The virtual clock: larger fleets",
        "",
        f"Makespan model of 1F1B ({MICRO} micro-batches of {BATCH // MICRO}), "
        f"{d['model']}, devices cycling through {', '.join(VIRTUAL_CYCLE)} at "
        "catalogue speeds, links at the slowest device's catalogue bandwidth; "
        f"replication every {R} steps, its time spread per step.",
        "",
        "| devices | DP samples/s | DP uses | even (compute) samples/s | DP / even "
        "| ideal | of ideal | DP sizes | replication s/step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in d["rows"]:
        lines.append(
            f"| {r['devices']} | {r['dp-samples-per-s']:.2f} | {r['used']} "
            f"| {r['even-samples-per-s']:.2f} "
            f"| {r['dp-samples-per-s'] / r['even-samples-per-s']:.2f} "
            f"| {r['ideal-samples-per-s']:.2f} "
            f"| {r['dp-samples-per-s'] / r['ideal-samples-per-s']:.2f} "
            f"| {r['dp-sizes']} | {r['replication-s-per-step']:.3f} |"
        )
    worst = d.get("max-model-error")
    if worst is not None:
        lines += [
            "",
            "- The model against the local runs (its step time from the stage "
            "times measured in the same round, against the measured step): largest "
            f"error {worst:.0%}, median {d['median-model-error']:.0%} over "
            f"{len(d['model-errors'])} rounds"
            + (
                f"; target within {TARGET_MODEL_ERROR:.0%} — "
                f"{_met(worst <= TARGET_MODEL_ERROR)}."
                if judged
                else "."
            ),
        ]
        if d.get("median-forecast-error") is not None:
            lines.append(
                "- The forecast the planner acts on (powers from the rounds "
                "before, so a device that slows is missed once): median error "
                f"{d['median-forecast-error']:.0%}."
            )
    return [*lines, ""]


# --------------------------------------------------------------------------------
# The guide's copy of the figures
# --------------------------------------------------------------------------------

GUIDE_START = "<!-- bench:pipeline -->"
GUIDE_END = "<!-- /bench:pipeline -->"


def guide_block(data: Mapping[str, Any]) -> str:
    """The figures as docs/pipeline.md shows them (the page's section, without
    its top heading)."""
    return "\n".join(render(data)[2:]).strip() + "\n"


def update_guide(page: Any = None, results: Any = None) -> None:
    """Copy the published figures into docs/pipeline.md (between its markers).

    Run after ``flowerbed bench --sections pipeline --publish``:
    ``python -c "from flowerbed.bench.pipeline_section import update_guide;
    update_guide()"``.
    """
    import json
    from pathlib import Path

    from .sections import app_root

    page = Path(page or app_root() / "docs" / "pipeline.md")
    results = Path(results or app_root() / "docs" / "benchmarks" / "results.json")
    data = json.loads(results.read_text())["sections"]["pipeline"]["data"]
    text = page.read_text()
    head, rest = text.split(GUIDE_START + "\n", 1)
    _, tail = rest.split(GUIDE_END, 1)
    page.write_text(f"{head}{GUIDE_START}\n{guide_block(data)}{GUIDE_END}{tail}")
