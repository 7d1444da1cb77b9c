"""Write a bench's results: ``results.json``, one PNG per fleet and BENCHMARKS.md.

Every number and every verdict in the page is formatted from the results
dictionary it is given; the rest is text true of every run. A page with sections
from ``--quick`` runs says so first, judges no target for them and estimates no
full-run duration. Files are written to a temporary name and renamed into place.
"""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = "benchmarks"
PAGE = "BENCHMARKS.md"
CI_PCT = 95
EQUAL_ROUNDS_TEXT = ("10", "25", "50")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _fmt(value: float | None, spec: str = ".3g") -> str:
    return "–" if value is None else format(value, spec)


def _ci(c: Mapping[str, Any], key: str, spec: str) -> str:
    """``value [low, high]`` of a confidence interval dictionary."""
    if c.get(key) is None:
        return "–"
    text = format(c[key], spec)
    if c.get("low") is not None:
        text += f" [{format(c['low'], spec)}, {format(c['high'], spec)}]"
    return text


def headline_sentence(h: Mapping[str, Any], quick: bool = False) -> str:
    """One sentence of the headline, for the console and the page; a quick
    run's is labelled as the toy-size check it is."""
    label = "Quick run (toy sizes, not a measurement)" if quick else "Headline"
    if not h.get("available"):
        return f"{label}: not available ({h.get('reason', 'no data')})."
    seeds = len(h["seeds"])
    return (
        f"{label} on {h['workload']} ({seeds} seed{'s' * (seeds != 1)}): "
        f"flowerbed's recommended default, {h['flowerbed']}, reaches "
        f"{100 * h['target_fraction']:.0f}% of "
        f"the converged accuracy ({100 * h['target_accuracy']:.1f}%) "
        f"{_ci(h['speedup'], 'geomean', '.2f')}x as fast as the best-tuned Flower "
        f"configuration, {h['flower']} (geometric mean of per-seed speed-ups, "
        f"{CI_PCT}% CI); final accuracy "
        f"{_ci(h['final_accuracy_diff_points'], 'mean', '+.1f')} points"
        + (
            f"; accuracy on the slow devices' data "
            f"{_ci(h['slow_accuracy_diff_points'], 'mean', '+.1f')} points against "
            f"Flower's best timeout ({h['flower_best_timeout']})"
            if "slow_accuracy_diff_points" in h
            else ""
        )
        + "."
    )


QUICK_TITLE = (
    "Quick run (`--quick`): toy sizes that check the benchmark's structure only."
)
QUICK_DETAIL = (
    "Its figures are not measurements of the methods: no target is judged and no "
    "full-run duration is estimated. Run `flowerbed bench` without `--quick` for "
    "figures."
)
QUICK_NOTICE = f"**{QUICK_TITLE}** {QUICK_DETAIL}"
"""What a page of a quick run says first (the console says it too)."""
QUICK_TARGETS = "- not judged: a quick run's toy sizes check structure only"
"""The Targets list of a quick run."""


def target_lines(targets: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per target, met or not, with the figures it was judged on (and
    the target's caveat, :data:`flowerbed.bench.suite.TARGET_CAVEATS`)."""
    from flowerbed.bench.suite import TARGET_CAVEATS

    lines = []
    for t in targets:
        figures = ", ".join(
            f"{k} {_fmt(v, '.2f') if isinstance(v, float) or v is None else v}"
            for k, v in t.items()
            if k not in ("name", "text", "met")
        )
        line = f"- **{'met' if t['met'] else 'not met'}**: {t['text']} ({figures})."
        if t["name"] in TARGET_CAVEATS:
            line += f" {TARGET_CAVEATS[t['name']]}"
        lines.append(line)
    return lines


def _median_curve(
    runs: Sequence[Mapping[str, Any]], grid: Sequence[float]
) -> list[float]:
    """Median over seeds of each run's accuracy at each time of ``grid``."""
    from flowerbed.bench.suite import accuracy_at_time

    out = []
    for t in grid:
        values = sorted(
            accuracy_at_time(r["curve"], t, r["initial_accuracy"]) for r in runs
        )
        out.append(values[len(values) // 2])
    return out


def plot_workload(
    cells: Sequence[Mapping[str, Any]], workload: str, path: Path
) -> None:
    """Median accuracy over seeds against virtual time, one line per configuration
    (dashed: Flower's baselines; solid: flowerbed's defaults)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [c for c in cells if c["workload"] == workload]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    configs = list(dict.fromkeys(c["config"] for c in runs))
    end = max((c["budget_s"] for c in runs), default=1.0)
    grid = [end * i / 200 for i in range(1, 201)]
    cmap = plt.get_cmap("tab20")
    for i, name in enumerate(configs):
        mine = [c for c in runs if c["config"] == name]
        style = "--" if mine[0]["family"] == "flower" else "-"
        ax.plot(
            grid,
            [100 * a for a in _median_curve(mine, grid)],
            style,
            color=cmap(i % 20),
            linewidth=1.4,
            label=name,
        )
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("central test accuracy (%), median over seeds")
    ax.set_title(f"{workload}: accuracy against virtual time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right", ncol=2)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)


def _num(value: float, spec: str) -> str:
    """``value`` in ``spec``; with ``.3g``, thousands as whole numbers (1,234, not
    1.23e+03)."""
    if spec == ".3g" and abs(value) >= 1000:
        return f"{value:,.0f}"
    return format(value, spec)


def _spread(
    values: Sequence[float | None],
    spec: str,
    scale: float = 1.0,
    absent: str = "not reached",
) -> str:
    """``median [min–max]`` over seeds; missing values are counted."""
    present = sorted(scale * v for v in values if v is not None)
    missing = len(values) - len(present)
    if not present or missing * 2 >= len(values):
        if not missing:
            return "–"
        suffix = " missed" if absent == "not reached" else ""
        return f"{absent} ({missing}/{len(values)}{suffix})"
    med = (
        present[len(present) // 2]
        if len(present) % 2
        else ((present[len(present) // 2 - 1] + present[len(present) // 2]) / 2)
    )
    text = _num(med, spec)
    if len(present) > 1:
        text += f" [{_num(present[0], spec)}–{_num(present[-1], spec)}]"
    if missing:
        text += f" ({missing} missed)"
    return text


def _ceiling_text(ceilings: Mapping[str, float] | None) -> str:
    """The centralised logistic regression's test accuracy per number of writers
    (:func:`flowerbed.bench.suite.synthetic_ceilings`), as a sentence."""
    if not ceilings:
        return ""
    (writers, acc), *others = ceilings.items()
    text = (
        f" One logistic regression fitted centrally on all the training data "
        f"reaches {100 * acc:.1f}% on the test set ({writers} writers): the ceiling "
        "of every configuration here"
    )
    for n, other in others:
        text += f"; with {n} writers, one per device, it would reach {100 * other:.1f}%"
    return text + "."


def _suite_tables(results: Mapping[str, Any]) -> list[str]:
    from flowerbed.bench.suite import HEADLINE_FRACTION

    lines: list[str] = []
    settings = results["settings"]
    for name in settings["workloads"]:
        summary = results["summary"].get(name)
        desc = settings["workload_descriptions"][name]
        # a workload's description speaks of its full size
        about = "Toy size" if settings.get("quick") else desc["description"]
        lines += [
            f"### {name}",
            "",
            f"{about}. Model `{desc['model']}` trained for real; "
            + (
                f"the clock charges every task as `{desc['charge_as']}` "
                "(bytes and compute, see below). "
                if desc["charge_as"]
                else "the clock charges the trained model itself. "
            )
            + f"Population {desc['population']} devices of fleet `{desc['fleet']}`, "
            f"cohort {desc['cohort']} per round (fraction_train "
            f"{desc['fraction_train']:.3g}"
            + (
                " of the eligible devices, diurnal availability"
                if desc["availability"]
                else ""
            )
            + f"), {desc['local_steps']} local steps of {desc['batch_size']} "
            f"samples at learning rate {desc['learning_rate']:g}; budget "
            f"{desc['budget_rounds']} median task times of virtual time.",
            "",
        ]
        if summary is None:
            lines += ["No successful run.", ""]
            continue
        targets = summary["targets"]
        conv = summary["converged_accuracy"]
        lines += [
            f"Converged accuracy (median over seeds of the best any configuration "
            f"held at the end): {100 * conv:.1f}%. Targets: "
            + ", ".join(
                f"{100 * float(f):.0f}% of it = {100 * t:.1f}%"
                for f, t in targets.items()
            )
            + "."
            + _ceiling_text(settings.get("ceilings", {}).get(name)),
            "",
            f"![accuracy against virtual time on {name}]"
            f"({RESULTS_DIR}/accuracy-{name}.png)",
            "",
            "| configuration | timeout (s) | "
            + " | ".join(f"time to {100 * float(f):.0f}% (s)" for f in targets)
            + " | accuracy at budget (%) | "
            + " | ".join(f"at round {r} (%)" for r in EQUAL_ROUNDS_TEXT)
            + " | slow devices' data (%) | energy to "
            f"{100 * HEADLINE_FRACTION:.0f}% (kJ) | energy (kJ) | data moved (GB) "
            "| rounds |",
            "|---|---|"
            + "---|" * len(targets)
            + "---|"
            + "---|" * len(EQUAL_ROUNDS_TEXT)
            + "---|---|---|---|---|",
        ]
        for config in settings["strategies"]:
            e = summary["configs"].get(config)
            if e is None:
                continue
            timeout = "all" if e["timeout_s"] is None else f"{e['timeout_s']:.1f}"
            lines.append(
                f"| {config} | {timeout} | "
                + " | ".join(_spread(e["ttt"][str(f)], ".3g") for f in targets)
                + f" | {_spread(e['final_accuracy'], '.1f', 100)} | "
                + " | ".join(
                    _spread(e["accuracy_at_rounds"][r], ".1f", 100, "not run")
                    for r in EQUAL_ROUNDS_TEXT
                )
                + f" | {_spread(e['final_slow_accuracy'], '.1f', 100)}"
                f" | {_energy_to(e)}"
                f" | {_spread(e['energy_j'], '.3g', 1e-3)}"
                f" | {_spread(e['bytes'], '.3g', 1e-9)}"
                f" | {_spread(e['rounds'], '.0f')} |"
            )
        comp = results["comparisons"].get(name, {})
        if comp.get("available"):
            lines += ["", _comparison_line(comp)]
        lines.append("")
    return lines


def _energy_to(e: Mapping[str, Any]) -> str:
    """Energy to the headline target, kJ over seeds (runs recorded before energy
    was recorded per evaluation say so)."""
    from flowerbed.bench.suite import HEADLINE_FRACTION

    values = e.get("energy_to", {}).get(str(HEADLINE_FRACTION))
    if values is None:
        return "not recorded"
    return _spread(values, ".3g", 1e-3)


def _comparison_line(c: Mapping[str, Any]) -> str:
    text = (
        f"Recommended default `{c['flowerbed']}` against the best-tuned Flower "
        f"configuration `{c['flower']}` (chosen with hindsight on these seeds), "
        f"target {100 * c['target_accuracy']:.1f}%: speed-up "
        f"{_ci(c['speedup'], 'geomean', '.2f')}x (per seed: "
        + ", ".join(f"{x:.2f}" for x in c["speedups"])
        + f"; reached {c['reached_flowerbed']} and {c['reached_flower']} of "
        f"{len(c['seeds'])}); final accuracy "
        f"{_ci(c['final_accuracy_diff_points'], 'mean', '+.1f')} points; energy "
        "Flower / flowerbed "
        f"{_ci(c['energy_ratio_flower_over_flowerbed'], 'geomean', '.2f')}x at the "
        "budget"
    )
    to_target = c.get("energy_to_target_ratio_flower_over_flowerbed")
    if to_target is not None:
        n = c.get("energy_to_target_seeds", 0)
        bounded = c.get("energy_to_target_bounded_seeds", 0)
        where = f"{n} seed{'s' * (n != 1)} where flowerbed reached it"
        if bounded:
            where += (
                f"; in {bounded} of them Flower never did, and its energy over "
                "the whole run stands in for its energy to the target: a lower "
                "bound"
            )
        text += (
            f", {_ci(to_target, 'geomean', '.2f')}x to the target ({where})"
            if to_target.get("geomean") is not None
            else ", to the target: no seed where flowerbed reached it"
        )
    if "slow_accuracy_diff_points" in c:
        text += (
            "; slow devices' data "
            f"{_ci(c['slow_accuracy_diff_points'], 'mean', '+.1f')} points "
            f"against `{c['flower_best_timeout']}`"
        )
    if c.get("ideal_s"):
        text += (
            f". Transfer-aware ideal {c['ideal_s']:.3g} s: flowerbed "
            f"{_fmt(c['flowerbed_over_ideal'], '.2f')}x, Flower "
            f"{_fmt(c['flower_over_ideal'], '.2f')}x of it"
        )
    return text + "."


AGGREGATION_TARGET = 0.5
"""Target: aggregation at >= this share of the measured memory-bandwidth limit."""
THROUGHPUT_TARGETS: Mapping[int, float] = {10: 6.0, 100: 8.0}
"""Targets by nodes a round: batched node-tasks per CPU-second on the default
path (nothing opted in) >= this many times the per-node path's before batching.
10 nodes is the default scenario; the other sizes on the page are not judged."""

AGGREGATION_NAMES = {
    "streaming": "flowerbed streaming, one reply at a time (`add`)",
    "grouped": "flowerbed streaming, 4 replies per pass (`add_many`)",
    "strategy": "flowerbed strategy (`RuntimeWeightedFedAvg.aggregate_train`)",
    "flower": "Flower aggregate_arrayrecords",
}


def _aggregation_lines(agg: Mapping[str, Any]) -> list[str]:
    if "points" not in agg:
        return [f"Not measured: {agg.get('skipped') or agg.get('error')}", ""]
    if "limit_gbps" not in agg:  # measured before the bandwidth limit was
        return ["Measured by an older flowerbed bench: rerun this part.", ""]
    per_point = any("limit_before_gbps" in p for p in agg["points"])
    limits = [p["limit_gbps"] for p in agg["points"] if "limit_gbps" in p]
    seconds = "CPU s" if per_point else "s"
    lines = [
        f"Update: {agg['floats']:,} float32 ({agg['update_bytes'] / 1e6:.1f} MB) per "
        f"node. Memory bandwidth (`a += b` on fresh huge-page memory, bytes read + "
        f"written, best of 5): "
        f"**{agg['bandwidth_gbps']:.1f} GB/s** measured alone at the start; a fold "
        f"reads the update and reads and writes the running sum, so one fold takes "
        f"in at most a third of that: the limit, "
        f"**{agg['limit_gbps']:.1f} GB/s of updates**"
        + (
            f" ({min(limits):.1f}-{max(limits):.1f} GB/s as each measuring process "
            "found it around its aggregation: each row's ratio is to its own). "
            "Throughput in update bytes per CPU second of aggregation (result "
            "included, after a warm-up aggregation whose result's memory holds "
            "the sums, as the strategies keep it between rounds; peak RSS from "
            "just before the aggregation; `flowerbed.bench.aggregation`)"
            if per_point and limits
            else ""
        )
        + f". Memory available at the start: "
        f"{agg['memory_available_bytes'] / 1e9:.1f} GB; points planned above "
        f"{agg['memory_budget_bytes'] / 1e9:.1f} GB were not run.",
        "",
        "| nodes | method | throughput (GB/s of updates) | of the limit "
        f"| x Flower | aggregation ({seconds}) | peak RSS (GB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in agg["points"]:
        name = AGGREGATION_NAMES.get(p["method"], p["method"])
        if "skipped" in p:
            lines.append(f"| {p['nodes']} | {name} | skipped: {p['skipped']} |||||")
            continue
        of_limit = f"{100 * p['of_limit']:.0f}%" if "of_limit" in p else ""
        vs_flower = f"{p['vs_flower']:.1f}x" if "vs_flower" in p else ""
        lines.append(
            f"| {p['nodes']} | {name} | {p['gbps']:.2f} | {of_limit} | {vs_flower} "
            f"| {p['seconds']:.2f} | {p['peak_rss_bytes'] / 1e9:.2f} |"
        )
    lines.append("")
    ours = [p for p in agg["points"] if p["method"] != "flower" and "of_limit" in p]
    if ours:
        verdicts = (
            ""
            if agg.get("quick")
            else f"Target: at least {AGGREGATION_TARGET:.0%} of the limit, per "
            "method and node count: "
            + "; ".join(
                f"{AGGREGATION_NAMES.get(p['method'], p['method']).split(', ')[-1]} "
                f"at {p['nodes']} nodes "
                + (
                    f"{p['of_limit']:.1%} (met)"
                    if p["of_limit"] >= AGGREGATION_TARGET
                    else f"{p['of_limit']:.1%} (**not met**)"
                )
                for p in ours
            )
            + ". "
        )
        lines += [
            verdicts + "A fold of *updates* (`x - base`, whose norm and NaN/Inf check "
            "it returns) also reads the base, so a lone fold can reach at most "
            "3/4 of the limit; a group of 4, folded together element by "
            "element, reads the base and the sum once for the four. "
            + _kernel_text(ours)
            + "flowerbed's strategies fold four replies per pass (the rows "
            "named after `aggregate_train`: Flower messages validated as they "
            "arrive, FedAvg's weights with the default influence bound — each "
            "group's pass written beside the sum and kept once the bound's "
            "decisions, replayed in order with the norms the pass took, match "
            "what it folded —, and the result encoded as the ArrayRecord the "
            "strategy returns, which the other rows do not do); one at a time "
            "(`add`) is what a subclass overriding `fold_train_reply` gets. "
            "The sum is float32 for "
            "float32 models (its error stays within one float32 rounding of "
            "the result: tests/test_strategies_streaming.py measures it "
            "against float64) and float64 only for float64 models and integer "
            "arrays (exact counts), where float32 would lose what they hold.",
            "",
        ]
    return lines


def _kernel_text(points: Sequence[Mapping[str, Any]]) -> str:
    """Which fold kernel the points used and its first-use cost, as a sentence."""
    kernels = sorted({str(p["kernel"]) for p in points if "kernel" in p})
    if not kernels:
        return ""
    firsts = [float(p["kernel_first_use_s"]) for p in points if "kernel" in p]
    names = {
        "numba": "numba's compiled one-pass kernel (strategies/fold_kernel.py)",
        "numpy": "the NumPy fallback (numba not installed)",
    }
    return (
        "Fold: "
        + " and ".join(names.get(k, k) for k in kernels)
        + f"; its first use in a process took {min(firsts):.2f}-{max(firsts):.2f} "
        "s (numba's import and compiling, or loading its disk cache; not in the "
        "timed figures: a server pays it once). "
    )


def _run_spread(point: Mapping[str, Any]) -> str:
    """ " (a-b, n runs)" when the point is the median of several runs."""
    rates = point.get("rates") or []
    if len(rates) < 2:
        return ""
    return f" ({min(rates):.0f}-{max(rates):.0f}, {len(rates)} runs)"


def _default_scenario() -> Any:
    """The default scenario (:class:`flowerbed.sims.config.Scenario`): the
    throughput part runs it at each fleet size."""
    from flowerbed.sims.config import Scenario

    return Scenario()


def _throughput_lines(t: Mapping[str, Any]) -> list[str]:
    if "points" not in t:
        return [f"Not measured: {t.get('skipped') or t.get('error')}", ""]
    names = {
        "legacy": "in-process, per node as before batching (fresh model and arrays "
        "decoded per message; reproduced baseline)",
        "per-node": "in-process, per node (one ClientApp call per message)",
        "batched": "in-process, batched (one process; the numba kernels, the default)",
        "batched-onednn": "in-process, batched, numba kernels off "
        "(`FLOWERBED_NUMBA_KERNELS=0`: PyTorch's oneDNN)",
        "batched-c": "in-process, batched, opted in to the C kernels "
        "(`FLOWERBED_C_KERNELS=1`)",
        "workers": "in-process, batched over worker processes",
        "ray": "`flwr run` on Flower's simulation engine (Ray)",
    }
    s = _default_scenario()
    measured = [p for p in t["points"] if "tasks_per_cpu_s" in p]
    tasks = [int(p["tasks"]) for p in measured if p.get("tasks") and p["mode"] != "ray"]
    runs = max((len(p.get("rates") or []) for p in measured), default=1)
    lines = [
        f"The default scenario (`{s.model}` on {s.dataset}, `{s.fleet}` fleet, "
        f"`{s.strategy}`, {s.local_steps} local steps of {s.batch_size} samples, "
        "fewer where a node holds fewer) at each fleet size, every node sampled, "
        f"at least {t['rounds']} round{'s' * (t['rounds'] != 1)} a point"
        + (f" and {min(tasks)} node-tasks or more in process" if tasks else "")
        + ", no dropouts, Flower's INFO log off as `flowerbed sim` runs. CPU "
        "seconds: the measuring process and its workers after a warm-up run; "
        + (
            f"in-process points are the median of {runs} runs with the modes "
            "interleaved"
            if runs > 1
            else "in-process points are one run each"
        )
        + (
            "; for Ray, the SuperLink and everything it started, start-up included"
            if any(p["mode"] == "ray" for p in t["points"])
            else ""
        )
        + "."
        + (
            ' A row marked "measured DATE" was not rerun with this part and '
            "carries its own date."
            if any("carried_from" in p for p in t["points"])
            else ""
        ),
        "",
        "| nodes per round | engine | rounds | node-tasks per CPU-second (runs) "
        "| wall s per round | CPU s | final accuracy (%) |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in t["points"]:
        name = names.get(p["mode"], p["mode"])
        if "error" in p:
            lines.append(f"| {p['cohort']} | {name} || failed: {p['error'][:200]} ||||")
            continue
        workers = f" ({p['workers']})" if p["mode"] == "workers" else ""
        if "carried_from" in p:
            workers += f", measured {p['carried_from']}"
        lines.append(
            f"| {p['cohort']} | {name}{workers} | {p.get('rounds', t['rounds'])} "
            f"| {p['tasks_per_cpu_s']:.0f}{_run_spread(p)} "
            f"| {p['wall_s_per_round']:.2f} | {p['cpu_s']:.1f} "
            f"| {100 * p['final_accuracy']:.1f} |"
        )
    lines.append("")
    if t.get("speedup_vs_legacy"):
        default = s.num_nodes
        judged = not t.get("quick")
        lines += [
            "Batched over the per-node path as it was before batching, node-tasks "
            "per CPU-second: "
            + ", ".join(
                f"{n} nodes"
                + (" (the default scenario)" if int(n) == default else "")
                + f" {x:.1f}x"
                + (
                    (" (met)" if x >= THROUGHPUT_TARGETS[int(n)] else " (**not met**)")
                    if judged and int(n) in THROUGHPUT_TARGETS
                    else ""
                )
                for n, x in t["speedup_vs_legacy"].items()
            )
            + "."
            + (
                " Target, on the default path with nothing opted in: at least "
                + " and ".join(
                    f"{x:g}x at {n} nodes a round"
                    for n, x in THROUGHPUT_TARGETS.items()
                )
                + f" ({default}: the default scenario's `num-nodes`)"
                + (
                    "; the other fleet sizes show how the gain changes with the fleet."
                    if set(map(int, t["speedup_vs_legacy"])) - set(THROUGHPUT_TARGETS)
                    else "."
                )
                if judged
                else ""
            ),
            "",
        ]
    if t.get("speedup"):
        lines += [
            "Batched over today's per-node path: "
            + ", ".join(f"{n} nodes {x:.1f}x" for n, x in t["speedup"].items())
            + ".",
            "",
        ]
    if t.get("c_speedup_vs_legacy"):
        lines += [
            "Opted in to the C kernels, over the per-node path before batching: "
            + ", ".join(
                f"{n} nodes {x:.1f}x" for n, x in t["c_speedup_vs_legacy"].items()
            )
            + "; the default path's node-tasks per CPU-second as a share of the "
            "C kernels': "
            + ", ".join(
                f"{n} nodes {x:.2f}x" for n, x in (t.get("default_of_c") or {}).items()
            )
            + ".",
            "",
        ]
    return lines


def _startup_lines(s: Mapping[str, Any]) -> list[str]:
    if "commands" not in s:
        return [f"Not measured: {s.get('skipped') or s.get('error')}", ""]
    lines = [
        f"Fresh processes, best of {s['repeats']}.",
        "",
        "| command | wall s | CPU s |",
        "|---|---|---|",
    ]
    for name, c in s["commands"].items():
        lines.append(f"| `{name}` | {c['wall_s']:.2f} | {c['cpu_s']:.2f} |")
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
    sizes = sel.get("fleet_sizes") or []
    fleets = sel.get("num_fleets")
    nodes = (
        ""
        if not sizes
        else f" of {min(sizes)} nodes"
        if min(sizes) == max(sizes)
        else f" of {min(sizes)}–{max(sizes)} nodes"
    )
    lines = [
        f"{fleets} random fleet{'s' * (fleets != 1)}{nodes} (seed "
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


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10)
    return f"{n}{suffix or 'th'}"


def _quantiles_text() -> str:
    """The timeout sweep's percentiles
    (:data:`flowerbed.bench.suite.TIMEOUT_QUANTILES`) in words: "25th, 50th and
    75th"."""
    from flowerbed.bench.suite import TIMEOUT_QUANTILES

    names = [_ordinal(round(100 * q)) for q in TIMEOUT_QUANTILES]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _margin_text() -> str:
    from flowerbed.bench.suite import TIMEOUT_MARGIN

    return f"{100 * (TIMEOUT_MARGIN - 1):g}%"


def _availability_text() -> str:
    """The suite's availability model, from
    :class:`flowerbed.sims.availability.DiurnalAvailability`'s defaults (the
    suite uses them): mean, peak/trough = (1 + a) / (1 - a), peak hour, slot."""
    from flowerbed.sims.availability import DiurnalAvailability as D

    ratio = (1 + D.amplitude) / (1 - D.amplitude)
    peak = D.peak_hour % 24
    return (
        "devices are eligible (idle, charging, on Wi-Fi) by "
        f"`flowerbed.sims.availability.DiurnalAvailability` ({100 * D.mean:g}% "
        f"on average, {ratio:.3g}x more at {_clock(peak)} local than at "
        f"{_clock((peak + 12) % 24)}, redrawn every {D.slot_s / 60:g} virtual "
        "minutes)"
    )


def _clock(hour: float) -> str:
    """``hour`` of the day as HH:MM."""
    minutes = round(hour * 60)
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


def _definitions(results: Mapping[str, Any]) -> list[str]:
    s = results["settings"]
    lines = [
        "## How to read this",
        "",
        f"- Seeds {', '.join(map(str, s['seeds']))}; every configuration runs on the "
        "same seeds (same devices, data split, availability and failures). Time is "
        "the in-process engine's virtual time: what the devices would have taken; "
        "this machine's load does not change it. A run stops at its workload's "
        "virtual-time budget or at 3x the budget's rounds.",
        '- Cells show the median over seeds and [min–max]; "missed" counts seeds '
        "that never reached the target in the budget. Confidence intervals "
        f"({CI_PCT}%) are Student-t intervals over the seeds' paired values: on the "
        "logarithm of per-seed speed-ups (reported as a geometric mean) and on "
        "per-seed accuracy differences. A run that never reached the target counts "
        "at the budget in speed-ups (which flatters the one that missed).",
        "- Converged accuracy: the median over seeds of the best accuracy any "
        "configuration held at the end of its run (median of its last five "
        "evaluations). Targets are fractions of it, so the headline target "
        "sits near what the workload converges to within the budget.",
        "- Accuracy at budget: the newest model evaluated by the budget's virtual "
        "time (equal virtual time). At round r: equal rounds (FedBuff: model "
        "versions). Slow devices' data: the central test set weighted as the slow "
        "devices' data is (device-correlated labels: their label shares; "
        "Synthetic: their writers' test samples; IID: the whole test set).",
        "- Energy: what the devices reported (busy power x compute + idle power x "
        "transfer, `flowerbed.sims.vclock.energy_joules`) for every train task they "
        "finished, used or not (the clock runs on after the run to collect work in "
        "flight); tasks lost mid-way report none. Data moved: charged model bytes "
        "x (tasks dispatched + replies received).",
        "- Transfer-aware ideal: the updates the best-tuned Flower configuration "
        "folded up to its median time to the target, delivered by the cohort's "
        "devices working back to back, each task costing its full virtual time "
        "(download, local steps, upload): ideal = updates / (cohort x mean over "
        "the fleet of 1 / task time).",
        "- Flower's timeout sweep: `start(timeout=...)` at the "
        f"{_quantiles_text()} percentiles of the population's task times "
        f"({_margin_text()} above them; a "
        "percentile whose time equals a lower one's is the same run and is "
        "skipped); the best Flower configuration per workload is picked with "
        "hindsight by median time to the headline target. flowerbed's "
        "strategies run with their defaults (`flowerbed sim --strategy NAME`), "
        "one setting for every workload.",
        f"- Availability: {_availability_text()}; "
        "each task then fails as its device profile says (per-task fault plus the "
        "end of an exponential online session, half of the failures silent).",
        "",
        "Charged models (virtual clock only; the model trained is the small one "
        "named per workload):",
        "",
    ]
    from flowerbed.models import CHARGED_MODELS

    for name, (_, _, source) in CHARGED_MODELS.items():
        lines.append(f"- `{name}`: {source}")
    lines += ["", "Configurations:", ""]
    for name, desc in s["strategy_descriptions"].items():
        lines.append(f"- `{name}` ({s['strategy_families'][name]}): {desc}")
    lines.append("")
    return lines


def suite_lines(data: Mapping[str, Any]) -> list[str]:
    """The suite section: headline, targets (judged on a full run only), one
    table per workload, errors, definitions."""
    if "settings" not in data:
        return ["## Headline", "", f"Not measured: {data.get('error')}", ""]
    if "workloads" not in data["settings"]:
        return [
            "## Headline",
            "",
            "The suite section holds results of an earlier format: rerun "
            "`flowerbed bench --sections suite`.",
            "",
        ]
    quick = bool(data["settings"].get("quick"))
    lines = ["## Headline", "", headline_sentence(data["headline"], quick), ""]
    lines += ["## Targets", ""]
    if quick:
        lines.append(QUICK_TARGETS)
    else:
        lines += target_lines(data["targets"]) or ["- no target could be evaluated"]
    lines += ["", "## Strategies on unequal fleets", ""]
    lines += _suite_tables(data)
    if data["errors"]:
        lines += ["### Errors", ""]
        for e in data["errors"]:
            lines.append(
                f"- {e['workload']} / {e['config']} / seed {e['seed']}: "
                f"`{e['error'][:300]}`"
            )
        lines.append("")
    lines += _definitions(data)
    return lines


MACHINERY_PARTS = (
    ("aggregation", "Aggregation throughput and memory"),
    ("throughput", "Node tasks: per node, batched, workers, Ray"),
    ("startup", "Start-up"),
    ("client", "Client-side metering overhead"),
    ("gateway", "Gateway memory per phone"),
)
"""Machinery parts and their headings, in the order of the page."""


def _aggregation_heading(agg: Mapping[str, Any]) -> str:
    """The aggregation part's heading, naming the update it measured."""
    from flowerbed.bench.aggregation import RESNET50_FLOATS

    heading = dict(MACHINERY_PARTS)["aggregation"]
    if "floats" not in agg:
        return heading
    if agg["floats"] == RESNET50_FLOATS:
        return f"{heading} (ResNet-50-sized update)"
    return f"{heading} ({agg['floats']:,}-float update)"


def machinery_lines(mach: Mapping[str, Any]) -> list[str]:
    """The machinery section: one subsection per part, each with when, at which
    load and (if recorded) on how many cores it was measured."""
    renderers = {
        "aggregation": _aggregation_lines,
        "throughput": _throughput_lines,
        "startup": _startup_lines,
        "client": _client_lines,
        "gateway": _gateway_lines,
    }
    lines = [
        "## Machinery cost",
        "",
        "Figures depend on the machine and its load (see the top): aggregation "
        "throughput and node-task rates are per CPU second, the others wall-clock.",
        "",
    ]
    if "error" in mach:
        return [*lines, f"Not measured: {mach['error']}", ""]
    for part, heading in MACHINERY_PARTS:
        data = mach.get(part, {"skipped": "not run"})
        if part == "aggregation":
            heading = _aggregation_heading(data)
        lines += [f"### {heading}", ""]
        if "measured" in data:
            load = data.get("load_average")
            cores = data.get("cores")
            lines += [
                f"Measured {data['measured']} (UTC)"
                + (" at toy size (`--quick`)" if data.get("quick") else "")
                + (
                    ", load average at the start of the part "
                    + " / ".join(f"{x:.2f}" for x in load)
                    + " (1/5/15 min)"
                    + (f" on {cores} cores" if cores else "")
                    if load
                    else ""
                )
                + ".",
                "",
            ]
        lines += renderers[part](data)
    return lines


def selection_lines(sel: Mapping[str, Any]) -> list[str]:
    """The cluster-selection table (see :func:`_selection_lines`)."""
    return _selection_lines(sel)


def is_quick(entry: Mapping[str, Any]) -> bool:
    """Whether a section's entry comes from a ``--quick`` run: its ``quick``
    field, or for entries written before it, its command."""
    if "quick" in entry:
        return bool(entry["quick"])
    return "--quick" in shlex.split(str(entry.get("command", "")))


def _provenance(name: str, title: str, entry: Mapping[str, Any]) -> str:
    m, v = entry["machine"], entry["versions"]
    return (
        f"- **{title}** (`{name}`"
        + (", quick: toy sizes" if is_quick(entry) else "")
        + f"): {entry['created']} (UTC), "
        f"{entry['wall_s'] / 60:.1f} minutes, `{entry['command']}`; "
        f"{m['cpu_model']}, {m['cpu_count']} cores, "
        f"{m['memory_bytes'] / 2**30:.1f} GiB RAM, load average at start "
        f"{' / '.join(f'{x:.2f}' for x in m['load_average'])} (1/5/15 min); "
        + ", ".join(f"{k} {val}" for k, val in v.items())
    )


FULL_BENCH_TARGET_MIN = 60.0
"""Target: a full ``flowerbed bench`` takes at most this many minutes."""


def full_run_minutes(results: Mapping[str, Any]) -> dict[str, float]:
    """Each section's minutes in a full ``flowerbed bench``: its module's
    ``full_run_seconds(data, wall_s)`` where it has one (sections rerun in part
    or resumed), else the wall time of its last run."""
    from .sections import SECTIONS, section_module

    out = {}
    for name in SECTIONS:
        entry = results["sections"].get(name)
        if entry is None:
            continue
        estimate = getattr(section_module(name), "full_run_seconds", None)
        wall = float(entry["wall_s"])
        seconds = wall
        if estimate is not None and "error" not in entry["data"]:
            seconds = estimate(entry["data"], wall)
        out[name] = seconds / 60
    return out


def cost_line(results: Mapping[str, Any]) -> str | None:
    """A full ``flowerbed bench``'s minutes, estimated from the runs on the page,
    against :data:`FULL_BENCH_TARGET_MIN`; None when a section on the page ran
    ``--quick`` (toy sizes say nothing of a full run's time)."""
    from .sections import SECTIONS, section_module

    if any(is_quick(e) for e in results["sections"].values()):
        return None
    missing = [s for s in SECTIONS if s not in results["sections"]]
    if missing:
        return (
            f"Full `flowerbed bench`: not estimated; not run yet: {', '.join(missing)}."
        )
    minutes = full_run_minutes(results)
    total = sum(minutes.values())
    verdict = "met" if total <= FULL_BENCH_TARGET_MIN else "**not met**"
    text = (
        f"Full `flowerbed bench`, estimated from the runs above: about {total:.0f} "
        "minutes ("
        + ", ".join(f"{s} {m:.1f}" for s, m in minutes.items())
        + f"); target at most {FULL_BENCH_TARGET_MIN:.0f} minutes: {verdict}. "
        "Each section counts as its last run above, on its machine and under the "
        "load given there, except the suite (its default configurations' cells at "
        "their own run times over its worker processes; resumed cells included) "
        "and machinery (the sum of its parts' own times), which are rerun in part."
    )
    suite = results["sections"].get("suite")
    if suite and "error" not in suite["data"]:
        extra = section_module("suite").opt_in_seconds(suite["data"]) / 60
        if extra >= 0.05:
            text += (
                f" The suite's variant rows on this page are opt-in (`--strategies`) "
                f"and add about {extra:.0f} minutes."
            )
    return text


def quick_notice(results: Mapping[str, Any]) -> str | None:
    """What the page says first when some of its sections ran ``--quick``."""
    from .sections import SECTIONS

    quick = [s for s in SECTIONS if s in results["sections"]]
    quick = [s for s in quick if is_quick(results["sections"][s])]
    if not quick:
        return None
    if len(quick) == len(results["sections"]):
        return QUICK_NOTICE
    return (
        f"**Sections {', '.join(f'`{s}`' for s in quick)} ran `--quick`: toy sizes "
        "that check the benchmark's structure only.** Their figures are not "
        "measurements of the methods: no target is judged for them and no "
        "full-run duration is estimated."
    )


def render(results: Mapping[str, Any], command: str) -> str:
    """BENCHMARKS.md for ``results`` (format 2), written by ``command`` (the
    ``flowerbed bench`` command line): every section present, in the order of
    :data:`flowerbed.bench.sections.SECTIONS`."""
    from .sections import SECTIONS, section_module

    present = [s for s in SECTIONS if s in results["sections"]]
    unknown = [s for s in results["sections"] if s not in SECTIONS]
    lines = ["# flowerbed benchmarks", ""]
    notice = quick_notice(results)
    if notice:
        lines += [notice, ""]
    lines += [
        f"Generated by `{command}`; do not edit by hand. Each section can be rerun "
        "on its own (`--sections NAME`); the others keep their figures. Raw data: "
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
    cost = cost_line(results)
    if cost:
        lines += ["", cost]
    lines.append("")
    for s in present:
        lines += modules[s].render(results["sections"][s]["data"])
    return "\n".join(lines).rstrip() + "\n"


FORMAT = 2
"""results.json layout: ``{"format": 2, "sections": {name: entry}}``, each entry
``{"created", "command", "quick", "machine", "versions", "wall_s", "data"}``
(``quick`` since it was added; older entries say it in ``command``)."""


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


def write(results: Mapping[str, Any], out_dir: str | Path, command: str) -> Path:
    """Write ``BENCHMARKS.md`` (generated by ``command``) into ``out_dir`` and
    results.json into ``benchmarks/``; return the page's path."""
    out = Path(out_dir)
    data = out / RESULTS_DIR
    data.mkdir(parents=True, exist_ok=True)
    _atomic_write(data / "results.json", json.dumps(results, indent=1) + "\n")
    page = out / PAGE
    _atomic_write(page, render(results, command))
    return page
