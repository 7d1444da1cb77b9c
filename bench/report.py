"""Write a bench's results: ``results.json``, one PNG per fleet and BENCHMARKS.md.

Every number in the page is formatted from the results dictionary it is given; none
is written by hand. Files are written to a temporary name and renamed into place.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = "benchmarks"
PAGE = "BENCHMARKS.md"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _fmt(value: float | None, spec: str = ".3g") -> str:
    return "–" if value is None else format(value, spec)


def _cell(s: Mapping[str, Any], spec: str = ".3g", scale: float = 1.0) -> str:
    """``median [min–max]`` of a spread, with the runs that had no value."""
    if s["median"] is None:
        text = "not reached" if s.get("missing") else "–"
    else:
        med, lo, hi = (scale * s[k] for k in ("median", "min", "max"))
        text = format(med, spec)
        if s["n"] > 1:
            text += f" [{format(lo, spec)}–{format(hi, spec)}]"
    if s.get("missing") and s["median"] is not None:
        text += f" ({s['missing']} not reached)"
    return text


def headline_sentence(h: Mapping[str, Any]) -> str:
    """One sentence of the headline, for the console and the page."""
    if not h.get("available"):
        return f"Headline: not available ({h.get('reason', 'no data')})."
    met = "meets" if h["target_met"] else "does not meet"
    return (
        f"Headline on {h['fleet']}: {h['best_strategy']} reaches the target "
        f"{h['median_speedup']:.2f}x faster (median) than {h['reference']}, final "
        f"accuracy {h['final_accuracy_diff_points']:+.2f} points; this {met} the "
        f"target (>= {h['target_speedup']:g}x, >= "
        f"-{h['target_max_accuracy_drop_points']:g} points). Time-to-target / ideal: "
        f"{_fmt(h['best_over_ideal'], '.2f')} for {h['best_strategy']}, "
        f"{_fmt(h['reference_over_ideal'], '.2f')} for {h['reference']}."
    )


def plot_fleet(cells: Sequence[Mapping[str, Any]], fleet: str, path: Path) -> None:
    """Accuracy against virtual time, one colour per strategy, one line per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    strategies = list(
        dict.fromkeys(c["strategy"] for c in cells if c["fleet"] == fleet)
    )
    cmap = plt.get_cmap("tab10")
    for i, strategy in enumerate(strategies):
        style = "--" if strategy.startswith("flwr-") else "-"
        runs = [c for c in cells if c["fleet"] == fleet and c["strategy"] == strategy]
        for j, run in enumerate(runs):
            points = [(t, 100 * a) for t, a in run["curve"] if t > 0]
            if not points:
                continue
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                style,
                color=cmap(i % 10),
                alpha=0.8,
                linewidth=1.2,
                label=strategy if j == 0 else None,
            )
    ax.set_xscale("log")
    ax.set_xlabel("virtual time (s, log scale)")
    ax.set_ylabel("central test accuracy (%)")
    ax.set_title(f"{fleet}: accuracy against virtual time (one line per seed)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)


def _suite_tables(results: Mapping[str, Any]) -> list[str]:
    lines: list[str] = []
    settings = results["settings"]
    summary = results["summary"]
    for fleet in settings["fleets"]:
        table = summary.get(fleet, {})
        desc = settings["fleet_descriptions"][fleet]
        lines += [
            f"### {fleet}",
            "",
            f"{desc['description']}; mix `{desc['fleet']}`, per-task dropout "
            f"{desc['dropout']:g}.",
            "",
            f"![accuracy against virtual time on {fleet}]"
            f"({RESULTS_DIR}/accuracy-{fleet}.png)",
            "",
            "| strategy | time to target (s) | speed-up vs "
            f"{settings['reference']} | final accuracy (%) | accuracy diff (points) "
            "| energy (J) | EDP (J·s) | rounds to target | updates discarded |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for strategy in settings["strategies"]:
            e = table.get(strategy)
            if e is None:
                lines.append(f"| {strategy} | failed (see Errors) |||||||| ")
                continue
            lines.append(
                f"| {strategy} | {_cell(e['time_to_target_s'])} "
                f"| {_cell(e['speedup'], '.2f')} "
                f"| {_cell(e['final_accuracy'], '.1f', 100)} "
                f"| {_cell(e['final_accuracy_diff'], '+.1f', 100)} "
                f"| {_cell(e['energy_j'], '.3g')} "
                f"| {_cell(e['edp_js'], '.3g')} "
                f"| {_cell(e['rounds_to_target'], '.0f')} "
                f"| {_cell(e['updates_discarded'], '.0f')} |"
            )
        lines.append("")
    return lines


def _aggregation_lines(agg: Mapping[str, Any]) -> list[str]:
    if "points" not in agg:
        return [f"Not measured: {agg.get('skipped') or agg.get('error')}", ""]
    lines = [
        f"Update: {agg['floats']:,} float32 ({agg['update_bytes'] / 1e6:.1f} MB) per "
        f"node. Memory bandwidth (numpy copy, read + write): "
        f"**{agg['copy_gbps']:.1f} GB/s**. Memory available at the start: "
        f"{agg['memory_available_bytes'] / 1e9:.1f} GB; points planned above "
        f"{agg['memory_budget_bytes'] / 1e9:.1f} GB were not run.",
        "",
        "| nodes | method | throughput (GB/s of updates) | aggregation (s) "
        "| peak RSS (GB) |",
        "|---|---|---|---|---|",
    ]
    for p in agg["points"]:
        name = (
            "flowerbed streaming"
            if p["method"] == "streaming"
            else ("Flower aggregate_arrayrecords")
        )
        if "skipped" in p:
            lines.append(f"| {p['nodes']} | {name} | skipped: {p['skipped']} | | |")
            continue
        lines.append(
            f"| {p['nodes']} | {name} | {p['gbps']:.2f} | {p['seconds']:.1f} "
            f"| {p['peak_rss_bytes'] / 1e9:.2f} |"
        )
    lines.append("")
    return lines


def _engine_lines(eng: Mapping[str, Any]) -> list[str]:
    if "in_process" not in eng:
        return [f"Not measured: {eng.get('skipped') or eng.get('error')}", ""]
    scen = ", ".join(f"{k}={v}" for k, v in eng["scenario"].items())
    lines = [
        f"Scenario: {scen}.",
        "",
        "| engine | wall s per round | wall s total (incl. start-up) "
        "| final accuracy (%) |",
        "|---|---|---|---|",
    ]
    local = eng["in_process"]
    lines.append(
        f"| in-process (`flowerbed sim`) | {_fmt(local['per_round_s'], '.2f')} "
        f"| {local['total_s']:.1f} | {100 * local['final_accuracy']:.1f} |"
    )
    ray = eng["flwr_run"]
    if "error" in ray:
        lines.append(f"| `flwr run` (Ray) | failed: {ray['error'][:300]} | | |")
    else:
        lines.append(
            f"| `flwr run` (Ray) | {_fmt(ray['per_round_s'], '.2f')} "
            f"| {ray['total_s']:.1f} | {100 * ray['final_accuracy']:.1f} |"
        )
    lines.append("")
    return lines


def _client_lines(c: Mapping[str, Any]) -> list[str]:
    if "step_s" not in c:
        return [f"Not measured: {c.get('skipped') or c.get('error')}", ""]
    per_step = c["timed_task_overhead_s"] / c["steps_per_task"]
    return [
        f"LeNet-5 on digits, batch {c['batch_size']}, {c['steps_per_task']} steps per "
        f"task, median of {c['repeats']} repeats, one torch thread. One training step "
        f"takes {1e3 * c['step_s']:.2f} ms here.",
        "",
        "| what | seconds | fraction of a training step |",
        "|---|---|---|",
        f"| `timed_train` over `train_steps` (per step: deadline check, power "
        f"sampler, final temperature read) | {per_step:.2e} "
        f"| {c['timed_overhead_per_step_fraction']:.2%} |",
        f"| one `read_telemetry()` (CPU, temperature, memory, throttling, power) "
        f"| {c['read_telemetry_s']:.2e} | {c['read_telemetry_fraction_of_step']:.2%} |",
        "",
        "Timing noise on a loaded machine can make the first difference slightly "
        'negative; read it as "below the noise".',
        "",
    ]


def _gateway_lines(g: Mapping[str, Any]) -> list[str]:
    if "per_phone_bytes" not in g:
        return [f"Not measured: {g.get('skipped') or g.get('error')}", ""]
    return [
        f"{g['phones']} simulated phones on one `flowerbed bridge` gateway "
        f"(`flowerbed.clients.bridge.scale.measure_memory_per_phone`): gateway RSS "
        f"{g['baseline_bytes'] / 2**20:.1f} MiB with none, "
        f"{g['loaded_bytes'] / 2**20:.1f} MiB with all connected; "
        f"**{g['per_phone_bytes'] / 2**10:.0f} KiB per phone**; every phone's node "
        f"active after {g['connect_s']:.1f} s.",
        "",
    ]


def _selection_lines(sel: Mapping[str, Any]) -> list[str]:
    if "objectives" not in sel:
        return [f"Not measured: {sel.get('skipped') or sel.get('error')}", ""]
    setup = sel.get("setup", {})
    noise = sel.get("noise", {})
    target = 100 * float(setup.get("target_confidence", 0))
    lines = [
        f"{sel.get('num_fleets')} random fleets of 2–12 nodes (seed "
        f"{sel.get('seed')}), from `{sel.get('source')}`. Ground truth: every "
        "configuration's expected cost on the virtual clock with run-time jitter "
        f"({setup.get('truth_rounds')} simulated rounds each; the "
        f"{setup.get('truth_shortlist')} leading per objective again for "
        f"{setup.get('truth_fine_rounds')}), for a job of "
        f"{setup.get('num_rounds')} rounds. The estimate sees only simulated "
        f"profiling reports: a probe of {setup.get('profile_steps')} steps per "
        "node (early finishers repeat), then refinement rehearses the nodes the "
        f"choice hinges on until it is {target:.0f}% "
        f"sure to be within {100 * float(setup.get('indifference', 0)):.1f}% of the "
        f"best or {100 * float(setup.get('profile_budget', 0)):.0f}% of the "
        "estimated job is spent; then the job's rounds are simulated with "
        "racing (every other round on the leading rival while unsure, at most "
        f"{100 * float(setup.get('race_share', 0)):.0f}% of the rounds). "
        '"Chose the true best" and regret judge the configuration in use at '
        'the end of the job; "before training" the choice after profiling; '
        "job regret the rounds as run, rivals' included. Noise: "
        + ", ".join(f"{k} {v:g}" for k, v in noise.items())
        + f". The paper's figure (Gu et al. 2019) is "
        f"{100 * float(sel.get('paper_best_fraction', 0)):.2f}%.",
        "",
        "| objective | chose the true best | within 1% of best | mean regret (%) "
        "| max regret (%) | before training: chose the best | job regret (%) "
        "| profiling overhead (% of total) | rehearsal batches | rounds on rivals "
        "| oracle chose the best |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, f in sel["objectives"].items():
        lines.append(
            f"| {name} | {100 * f['best_fraction']:.1f}% "
            f"| {100 * f.get('near_best_fraction', float('nan')):.1f}% "
            f"| {f['mean_regret_pct']:.2f} "
            f"| {f.get('max_regret_pct', float('nan')):.2f} "
            f"| {100 * f.get('before_training_best_fraction', float('nan')):.1f}% "
            f"| {f.get('job_mean_regret_pct', float('nan')):.2f} "
            f"| {f['profiling_overhead_pct']:.2f} "
            f"| {f.get('refinement_mean_batches', float('nan')):.1f} "
            f"| {f.get('race_mean_rounds', float('nan')):.1f} "
            f"| {100 * f.get('oracle_best_fraction', float('nan')):.1f}% |"
        )
    sens = sel.get("sensitivity")
    if sens and "objectives" in sens:
        lines += [
            "",
            f"With power meters calibrated to {sens['power_gain_error']:g} "
            "(same fleets and noise otherwise):",
            "",
            "| objective | chose the true best | within 1% of best | mean regret (%) "
            "| max regret (%) |",
            "|---|---|---|---|---|",
        ]
        for name, f in sens["objectives"].items():
            lines.append(
                f"| {name} | {100 * f['best_fraction']:.1f}% "
                f"| {100 * f['near_best_fraction']:.1f}% "
                f"| {f['mean_regret_pct']:.2f} | {f['max_regret_pct']:.2f} |"
            )
    lines += [
        "",
        "Oracle: the same formulas fed the true devices and jitter (perfect "
        "profiling). Power readings carry a per-node calibration error "
        f"(power_gain_error {noise.get('power_gain_error', float('nan')):g}) that no "
        "amount of profiling removes; it bounds the energy and EDP figures.",
        "",
    ]
    return lines


def _definitions(results: Mapping[str, Any]) -> list[str]:
    s = results["settings"]
    lines = [
        "## How to read this",
        "",
        f"- Every cell: {s['num_nodes']} nodes, {s['num_rounds']} rounds (FedBuff: "
        f"2 model versions per round, so it folds as many updates), "
        f"{s['local_steps']} local steps of 16 samples at learning rate "
        f"{s['learning_rate']:g}, LeNet-5 on `digits` (IID), "
        f"seeds {', '.join(map(str, s['seeds']))}, target accuracy "
        f"{100 * s['target']:.0f}%. Time is the in-process engine's virtual time: "
        "what the devices would have taken; this machine's load does not change it.",
        "- Cells show the median over seeds and [min–max]. Speed-up and accuracy "
        f"difference pair each seed's run with {s['reference']} on the same seed.",
        "- Energy: what the nodes reported (busy power x compute + idle power x "
        "transfer) for every train task they finished, used or discarded (after "
        "the run the engine's clock runs on to collect replies still in flight; "
        "replies dropped when their message's TTL expired and failed tasks report "
        "nothing). `results.json` also holds `energy_used_updates_j`, the part in "
        "replies received in time. EDP: energy x virtual duration of the run "
        "(Gonzalez and Horowitz, IEEE JSSC 1996).",
        "- Updates discarded: train tasks dispatched minus updates folded into a "
        "global model (failures, vanished nodes, replies after the round closed or "
        "too stale, work in flight when the run ended).",
        "- Ideal time-to-target: samples the reference needed to reach the target "
        "divided by the fleet's summed training throughput (every node computing "
        "all the time, communication free).",
        "",
        "Strategies:",
        "",
    ]
    for name, desc in s["strategy_descriptions"].items():
        lines.append(f"- `{name}`: {desc}")
    lines.append("")
    return lines


def suite_lines(data: Mapping[str, Any]) -> list[str]:
    """The suite section: headline, one table per fleet, errors, definitions."""
    if "settings" not in data:
        return ["## Headline", "", f"Not measured: {data.get('error')}", ""]
    h = data["headline"]
    lines = ["## Headline", "", headline_sentence(h), ""]
    if h.get("available"):
        lines += [
            f"Median virtual time to {100 * data['settings']['target']:.0f}%: "
            f"{h['reference']} {_fmt(h['reference_time_to_target_s'])} s, "
            f"{h['best_strategy']} {_fmt(h['best_time_to_target_s'])} s, ideal "
            f"{_fmt(h['ideal_time_to_target_s'])} s.",
            "",
        ]
    lines += ["## Strategies on unequal fleets", ""]
    lines += _suite_tables(data)
    if data["errors"]:
        lines += ["### Errors", ""]
        for e in data["errors"]:
            lines.append(
                f"- {e['fleet']} / {e['strategy']} / seed {e['seed']}: "
                f"`{e['error'][:300]}`"
            )
        lines.append("")
    lines += _definitions(data)
    return lines


MACHINERY_PARTS = (
    ("aggregation", "Aggregation throughput and memory (ResNet-50-sized update)"),
    ("engines", "In-process engine against `flwr run` (Ray)"),
    ("client", "Client-side metering overhead"),
    ("gateway", "Gateway memory per phone"),
)
"""Machinery parts and their headings, in the order of the page."""


def machinery_lines(mach: Mapping[str, Any]) -> list[str]:
    """The machinery section: one subsection per part."""
    renderers = {
        "aggregation": _aggregation_lines,
        "engines": _engine_lines,
        "client": _client_lines,
        "gateway": _gateway_lines,
    }
    lines = [
        "## Machinery cost",
        "",
        "Wall-clock figures: they depend on this machine and its load (see the top).",
        "",
    ]
    if "error" in mach:
        return [*lines, f"Not measured: {mach['error']}", ""]
    for part, heading in MACHINERY_PARTS:
        data = mach.get(part, {"skipped": "not run"})
        lines += [f"### {heading}", ""]
        if "measured" in data:
            lines += [f"Measured {data['measured']} (UTC).", ""]
        lines += renderers[part](data)
    return lines


def selection_lines(sel: Mapping[str, Any]) -> list[str]:
    """The cluster-selection table (see :func:`_selection_lines`)."""
    return _selection_lines(sel)


def _provenance(name: str, title: str, entry: Mapping[str, Any]) -> str:
    m, v = entry["machine"], entry["versions"]
    return (
        f"- **{title}** (`{name}`): {entry['created']} (UTC), "
        f"{entry['wall_s'] / 60:.1f} minutes, `{entry['command']}`; "
        f"{m['cpu_model']}, {m['cpu_count']} cores, "
        f"{m['memory_bytes'] / 2**30:.1f} GiB RAM, load average at start "
        f"{' / '.join(f'{x:.2f}' for x in m['load_average'])} (1/5/15 min); "
        + ", ".join(f"{k} {val}" for k, val in v.items())
    )


def render(results: Mapping[str, Any]) -> str:
    """BENCHMARKS.md for ``results`` (format 2): every section present, in the
    order of :data:`flowerbed.bench.sections.SECTIONS`."""
    from .sections import SECTIONS, section_module

    present = [s for s in SECTIONS if s in results["sections"]]
    unknown = [s for s in results["sections"] if s not in SECTIONS]
    lines = [
        "# flowerbed benchmarks",
        "",
        "Generated by `flowerbed bench --publish`; do not edit by hand. Each section "
        "can be rerun on its own (`flowerbed bench --sections NAME --publish`); the "
        "others keep their figures. Raw data: "
        f"[{RESULTS_DIR}/results.json]({RESULTS_DIR}/results.json).",
        "",
        "Sections and the run that produced each:",
        "",
    ]
    modules = {s: section_module(s) for s in present}
    for s in present:
        lines.append(_provenance(s, modules[s].TITLE, results["sections"][s]))
    for s in SECTIONS:
        if s not in present:
            lines.append(f"- `{s}`: not run yet")
    for s in unknown:
        lines.append(f"- `{s}`: in results.json but not a registered section")
    lines.append("")
    for s in present:
        lines += modules[s].render(results["sections"][s]["data"])
    return "\n".join(lines).rstrip() + "\n"


FORMAT = 2
"""results.json layout: ``{"format": 2, "sections": {name: entry}}``, each entry
``{"created", "command", "machine", "versions", "wall_s", "data"}``."""


def from_legacy(old: Mapping[str, Any]) -> dict[str, Any]:
    """A results.json written before sections (one run of everything) as format 2."""
    run = {k: old[k] for k in ("created", "command", "machine", "versions", "wall_s")}
    settings = {k: v for k, v in old["settings"].items() if k != "machinery"}
    suite = {
        "settings": settings,
        **{k: old[k] for k in ("cells", "errors", "summary", "headline")},
    }
    return {
        "format": FORMAT,
        "sections": {
            "suite": {**run, "data": suite},
            "machinery": {**run, "data": dict(old["machinery"])},
            "selection": {**run, "data": dict(old["selection"])},
        },
    }


def load(out_dir: str | Path) -> dict[str, Any]:
    """The results.json under ``out_dir`` (format 2), or an empty one."""
    path = Path(out_dir) / RESULTS_DIR / "results.json"
    if not path.exists():
        return {"format": FORMAT, "sections": {}}
    try:
        results = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); move it away") from err
    if not isinstance(results, dict):
        raise ValueError(f"{path} does not hold a JSON object; move it away")
    if "sections" not in results:
        return from_legacy(results)
    return results


def write(results: Mapping[str, Any], out_dir: str | Path) -> Path:
    """Write ``BENCHMARKS.md`` into ``out_dir`` and results.json into
    ``benchmarks/``; return the page's path."""
    out = Path(out_dir)
    data = out / RESULTS_DIR
    data.mkdir(parents=True, exist_ok=True)
    _atomic_write(data / "results.json", json.dumps(results, indent=1) + "\n")
    page = out / PAGE
    _atomic_write(page, render(results))
    return page
