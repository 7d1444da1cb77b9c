"""Section "tiles": fused-tile training of a CNN's early layers on emulated Pi 3s (S2).

A YOLOv2-tiny-style network (``yolo-tiny``: 416x416 inputs, 6 conv layers with
max-pooling, a weight-heavy 3x3 conv to 1024 channels, a classification head)
trained by :mod:`flowerbed.parallel.tiles.runner` on real local processes, each
emulating a Raspberry Pi 3B, boards joined by an emulated 100 Mb/s link
(:mod:`flowerbed.bench.tiles_bench`):

- one device: its four cores (the honest baseline) and one core of a Pi 3 (the
  paper's baseline, derived from the four-core run: :func:`one_core`);
- 2, 4 and 6 boards, tiles and grouping planned by the cost model's DP;
- the effect of grouping at 6 boards: every layer its own group, and one
  fused group, against the DP's choice.

Per configuration: step time (the slowest board's median after a warm-up
step), speed-up against one core and against one whole board, the link-bound
limit (one board's time split perfectly over the boards, plus the plan's
communication at the link's speed: halo exchanges, gather to rank 0, all-reduce),
the communication share (seconds a board spends in exchanges and waiting, over
the step), peak activation bytes per board (tensors autograd kept, measured;
and the planner's count), and peak RSS per board. Target (judged on full runs
only): at the most boards >= 4x less peak activation memory per board than one
device; speed-up over one whole board reported against the link-bound limit.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from .sections import SectionRun

TITLE = "Fused-tile training (S2)"
IMAGE = 416
WIDTH = 16
CLASSES = 20
BATCH = 1
STEPS = 3
BOARDS = (2, 4, 6)
LINK_MBPS = 100.0
MEMORY_MB = 900.0
"""A 1 GB Pi 3 leaves about this much to one training process."""
QUICK_IMAGE, QUICK_WIDTH, QUICK_STEPS, QUICK_BOARDS = 64, 4, 2, (2,)
"""``--quick``: a 64x64 input, width 4, two steps, one and two boards."""
TARGET_ACTIVATION_RATIO = 4.0
PAPER = (
    "Rama, Threadgill, Gerstlauer (arXiv 2409.09083) report 2x-15x against one core "
    "on 2-6 Raspberry Pi 3, up to 8x less memory per device and up to 1.5x from "
    "grouping"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tiles section")
    g.add_argument(
        "--tiles-boards",
        help=f"comma-separated board counts (default {','.join(map(str, BOARDS))})",
    )
    g.add_argument("--tiles-batch", type=int, help=f"samples per step ({BATCH})")
    g.add_argument("--tiles-steps", type=int, help=f"steps per run ({STEPS})")
    g.add_argument("--tiles-image", type=int, help=f"input side ({IMAGE})")


def check(args: argparse.Namespace) -> None:
    boards = _boards(args)
    if any(b < 2 or b > 16 for b in boards):
        raise ValueError(f"--tiles-boards must be 2..16 each, got {boards}")
    for name in ("tiles_batch", "tiles_steps"):
        value = getattr(args, name, None)
        if value is not None and value < 1 + (name == "tiles_steps"):
            raise ValueError(f"--{name.replace('_', '-')} is too small: {value}")
    image = getattr(args, "tiles_image", None)
    if image is not None and (image < 32 or image % 32):
        raise ValueError(f"--tiles-image must be a multiple of 32, got {image}")


def choices() -> list[str]:
    return [f"--tiles-boards: any of 2..16 (default {','.join(map(str, BOARDS))})"]


def _boards(args: argparse.Namespace) -> list[int]:
    raw = getattr(args, "tiles_boards", None)
    if not raw:
        return list(QUICK_BOARDS if getattr(args, "quick", False) else BOARDS)
    try:
        return [int(v) for v in str(raw).split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--tiles-boards must list integers, got {raw!r}") from None


def run(ctx: SectionRun) -> dict[str, Any]:
    from flowerbed.parallel.group import free_port

    from .tiles_bench import CORES, Setup, measure, pi3_flops

    quick = ctx.quick
    image = getattr(ctx.args, "tiles_image", None) or (QUICK_IMAGE if quick else IMAGE)
    width = QUICK_WIDTH if quick else WIDTH
    steps = getattr(ctx.args, "tiles_steps", None) or (QUICK_STEPS if quick else STEPS)
    batch = getattr(ctx.args, "tiles_batch", None) or BATCH
    boards = _boards(ctx.args)
    board = pi3_flops()
    setups = [
        Setup("1 board", 1, board),
        *(Setup(f"{n} boards", n, board) for n in boards),
    ]
    grouping_at = max(boards)
    args = {"image_size": image, "width": width, "num_classes": CLASSES}
    step = ctx.tracker(len(setups) + (0 if quick else 2))
    runs = []

    def measured(setup: Setup, count: int) -> dict[str, Any]:
        return measure(
            setup,
            model_args=args,
            image=image,
            batch=batch,
            steps=count,
            link_mbps=LINK_MBPS,
            memory_mb=MEMORY_MB,
            port=free_port(),
        )

    for setup in setups:
        # one device: the warm-up step and one measured step are enough
        runs.append(measured(setup, 2 if setup.boards == 1 else steps))
        step(setup.name)
    runs.insert(0, one_core(runs[0], CORES))
    grouping = []
    if not quick:
        dp = next(r for r in runs if r["boards"] == grouping_at)
        front = dp["front"]
        for name, bounds in (
            ("every layer a group", tuple(range(front + 1))),
            ("one fused group", (0, front)),
        ):
            setup = Setup(f"{grouping_at} boards, {name}", grouping_at, board, bounds)
            try:
                grouping.append(measured(setup, steps))
            except ValueError as err:  # a plan the tracer refuses
                grouping.append({"name": setup.name, "error": str(err)})
            step(name)
    return {
        "quick": quick,  # toy sizes: the page judges no target on them
        "model": f"yolo-tiny {image}x{image}, width {width}",
        "batch": batch,
        "board-gflops": board / 1e9,
        "cores": CORES,
        "link-mbps": LINK_MBPS,
        "memory-mb": MEMORY_MB,
        "runs": runs,
        "grouping": grouping,
        "grouping-boards": grouping_at,
    }


def one_core(board: Mapping[str, Any], cores: int) -> dict[str, Any]:
    """The one-core baseline from the one-board run, not run itself.

    The emulation makes every forward and backward call last FLOPs / speed
    (:mod:`flowerbed.parallel.emulation`), and one core is a board's speed /
    ``cores``: the same run with each call ``cores`` times as long. So its step
    is ``cores`` x the board's emulated compute plus the board's time outside it
    (the optimiser step, the loss); memory and the plan are the board's. A real
    one-core run of the full-size section, once, gave 83.29 s against this
    formula's 83.25 s, for about a fifth of the section's time.
    """
    extra = board["step-s"] - max(board["compute-s"])
    return {
        **board,
        "name": "1 core",
        "gflops": board["gflops"] / cores,
        "predicted-step-s": board["predicted-step-s"] * cores,
        "step-s": max(board["compute-s"]) * cores + extra,
        "compute-s": [c * cores for c in board["compute-s"]],
        "wall-s": 0.0,
        "derived-from": board["name"],
    }


def summary(data: Mapping[str, Any]) -> dict[str, Any]:
    """Speed-ups, limits and memory ratios derived from the runs."""
    runs = {r["name"]: r for r in data["runs"]}
    core, board = runs["1 core"]["step-s"], runs["1 board"]["step-s"]
    single_act = max(runs["1 board"]["activation-bytes"])
    rows = []
    for r in data["runs"] + [g for g in data.get("grouping", []) if "error" not in g]:
        n = r["boards"]
        limit_s = board / n + (r["predicted-link-s"] if n > 1 else 0.0)
        link_share = (
            max(link / r["step-s"] for link in r["link-s"]) if r["step-s"] > 0 else 0.0
        )
        rows.append(
            {
                "name": r["name"]
                + (
                    f" (from the {r['derived-from']} run)"
                    if "derived-from" in r
                    else ""
                ),
                "boards": n,
                "step-s": r["step-s"],
                "predicted-step-s": r["predicted-step-s"],
                "vs-core": core / r["step-s"],
                "vs-board": board / r["step-s"],
                "limit-vs-board": board / limit_s,
                "link-share": link_share,
                "activation-mb": max(r["activation-bytes"]) / 2**20,
                "planned-activation-mb": max(r["predicted-activation-bytes"]) / 2**20,
                "activation-ratio": single_act / max(r["activation-bytes"]),
                "rss-mb": max(r["peak-rss-bytes"]) / 2**20,
                "rss-growth-mb": max(
                    p - b
                    for p, b in zip(
                        r["peak-rss-bytes"], r["baseline-rss-bytes"], strict=True
                    )
                )
                / 2**20,
                "halo": r["halo-macs"] / r["front-macs"] if r["front-macs"] else 0.0,
                "bounds": r["bounds"],
                "overrun-s": max(r["overrun-s"]),
            }
        )
    return {"rows": rows}


def _limit(row: Mapping[str, Any]) -> str:
    return f"{row['limit-vs-board']:.2f}x" if row["boards"] > 1 else "-"


def render(data: Mapping[str, Any]) -> list[str]:
    lines = [f"## {TITLE}", ""]
    if "error" in data:
        return [*lines, f"The section failed: {data['error']}", ""]
    rows = summary(data)["rows"]
    lines += [
        f"{data['model']}, batch {data['batch']}, on local processes each emulating a "
        f"Raspberry Pi 3B ({data['board-gflops']:.2f} GFLOP/s for its {data['cores']} "
        f"cores, 1/{data['cores']} of it for one core; flowerbed.sims.devices), "
        "boards on "
        f"an emulated {data['link-mbps']:g} Mb/s link (1 ms per message). Step: the "
        "slowest board's median after a warm-up step. Limit: one board's step split "
        "evenly over the boards plus the plan's communication at the link's speed. "
        "Link share: the largest share of a step a board spends exchanging or "
        "waiting. Activations: peak bytes autograd kept per board in a step "
        "(measured; planned in brackets); ratio = one board's / the largest board's.",
        "",
        "| configuration | groups (front) | step s | planned s | vs 1 core "
        "| vs 1 board | limit vs 1 board | link share | halo work "
        "| activations MiB | ratio | peak RSS MiB (+run) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['bounds']} | {r['step-s']:.2f} "
            f"| {r['predicted-step-s']:.2f} | {r['vs-core']:.2f}x "
            f"| {r['vs-board']:.2f}x | {_limit(r)} "
            f"| {r['link-share']:.0%} | {r['halo']:.1%} "
            f"| {r['activation-mb']:.1f} ({r['planned-activation-mb']:.1f}) "
            f"| {r['activation-ratio']:.1f}x "
            f"| {r['rss-mb']:.0f} (+{r['rss-growth-mb']:.0f}) |"
        )
    lines.append("")
    for g in data.get("grouping", []):
        if "error" in g:
            lines += [f"- {g['name']}: not runnable: {g['error']}", ""]
    multi = [r for r in rows if r["boards"] > 1 and "," not in r["name"]]
    if multi and not data.get("quick"):
        widest = max(multi, key=lambda r: r["boards"])
        met = widest["activation-ratio"] >= TARGET_ACTIVATION_RATIO
        lines += [
            f"Target: at {widest['boards']} boards >= {TARGET_ACTIVATION_RATIO:g}x "
            f"less peak activation memory per board: "
            f"{widest['activation-ratio']:.1f}x "
            f"({'met' if met else 'NOT met'}). Speed-up over one whole board: "
            f"{widest['vs-board']:.2f}x against a link-bound limit of "
            f"{widest['limit-vs-board']:.2f}x.",
            "",
        ]
    overrun = max((r["overrun-s"] for r in rows), default=0.0)
    if overrun > 0.05:
        lines += [
            f"Emulation: a board's real compute exceeded its emulated time by up to "
            f"{overrun:.2f} s per run (the host was slower than a Pi 3 then; those "
            "steps are slower than a Pi 3's).",
            "",
        ]
    lines += [f"Paper (not measured here): {PAPER}.", ""]
    return lines
