"""``flowerbed bench``: run some or all sections, update results.json, rebuild the page.

Each section (:mod:`flowerbed.bench.sections`) measures one thing and renders its
part of BENCHMARKS.md. A run updates the sections it ran in
``<out>/benchmarks/results.json`` and keeps the others, then rebuilds
``<out>/BENCHMARKS.md`` from every section present; ``--rebuild`` only rebuilds
the page. ``--out`` defaults to ``outputs/bench``; ``--publish`` writes into the
checkout's ``docs/`` instead (the committed page). The page and the console
name the command that wrote them (:func:`command_line`).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .sections import SECTIONS, SectionRun, app_root, section_module

DEFAULT_OUT = Path("outputs") / "bench"


QUICK_TIME = "39-45 CPU seconds: 1.4 to 3.5 minutes on 2 cores shared with other work"
"""What ``--quick`` took, timed three times by ``/usr/bin/time -v flowerbed bench
--quick`` (the processes it waits for included) on a 2-core machine shared with
other jobs: 1:23, 2:52 and 3:32 of wall time at load averages 7, 9 and 11;
39, 45 and 43 CPU seconds."""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "bench",
        help="benchmark strategies on unequal fleets and the machinery's cost",
        description="Run the benchmark's sections (default all: "
        f"{', '.join(SECTIONS)}), merge them into <out>/benchmarks/results.json "
        "(sections not run keep their figures) and rebuild <out>/BENCHMARKS.md "
        "from every section present. --publish regenerates the checkout's "
        "docs/BENCHMARKS.md instead.",
    )
    add_options(p)
    p.set_defaults(func=run)


def add_options(p: argparse.ArgumentParser) -> None:
    """``flowerbed bench``'s options, the sections' own included."""
    p.add_argument(
        "--quick",
        action="store_true",
        help="toy sizes that check every section runs and renders, not how fast "
        f"anything is: no targets judged, no duration estimated ({QUICK_TIME}; no "
        "Ray, no gateway, no pipeline baselines or failure runs)",
    )
    p.add_argument(
        "--sections",
        help=f"comma-separated subset of: {', '.join(SECTIONS)} (default all)",
    )
    p.add_argument(
        "--rebuild",
        action="store_true",
        help="run nothing: rebuild BENCHMARKS.md from the results.json already in "
        "the output folder (after the page's text changed)",
    )
    p.add_argument(
        "--list",
        action="store_true",
        help="print what each section's options take (workloads, strategies, "
        "parts) and exit",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--out", help=f"output folder (default {DEFAULT_OUT}, under the current folder)"
    )
    where.add_argument(
        "--publish",
        action="store_true",
        help="write into the checkout's docs/ (the committed BENCHMARKS.md)",
    )
    for name in SECTIONS:
        hook = getattr(section_module(name), "add_arguments", None)
        if hook is not None:
            hook(p)


def command_line(args: argparse.Namespace) -> str:
    """The ``flowerbed bench`` command that ``args`` were parsed from, each option
    given a value other than its default (in the parser's order)."""
    parser = argparse.ArgumentParser(prog="flowerbed bench", add_help=False)
    add_options(parser)
    words = ["flowerbed", "bench"]
    for action in parser._actions:  # argparse lists its options nowhere public
        value = getattr(args, action.dest, action.default)
        if not action.option_strings or value is None or value == action.default:
            continue
        flag = max(action.option_strings, key=len)
        words += [flag] if action.nargs == 0 else [flag, str(value)]
    return shlex.join(words)


def sections_from_args(args: argparse.Namespace) -> list[str]:
    """The sections to run, each checked; ``ValueError`` naming a bad option."""
    from .suite_section import split

    names = split(args.sections) or list(SECTIONS)
    for name in names:
        section_module(name)
    for name in names:
        checker = getattr(section_module(name), "check", None)
        if checker is not None:
            checker(args)
    return names


def out_dir(args: argparse.Namespace) -> Path:
    """Where the page goes; ``ValueError`` when --publish has no checkout."""
    if not args.publish:
        return Path(args.out) if args.out else DEFAULT_OUT
    root = app_root()
    if not (root / "pyproject.toml").is_file() or not (root / "docs").is_dir():
        raise ValueError(
            f"--publish regenerates a source checkout's docs/, but flowerbed runs "
            f"from {root}, which is not one; use --out"
        )
    return root / "docs"


def writable(folder: Path) -> None:
    """Create ``folder`` and its ``benchmarks/``, and check both can be written,
    before anything runs."""
    for path in (folder, folder / "benchmarks"):
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"--out {folder}: cannot create {path} ({err})") from err
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"--out {folder}: {path} is not writable")


def machine_info() -> dict[str, Any]:
    """CPU model, cores, memory and load average, read now."""
    model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "memory_bytes": mem,
        "load_average": list(os.getloadavg()),
        "platform": platform.platform(),
    }


def versions() -> dict[str, str]:
    import flowerbed
    import flwr
    import numpy
    import torch

    return {
        "flowerbed": flowerbed.__version__,
        "flwr": flwr.__version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "python": platform.python_version(),
    }


def run_section(
    name: str, args: argparse.Namespace, data_dir: Path, previous: Any, progress: Any
) -> dict[str, Any]:
    """Run one section; its entry for results.json (an error is recorded)."""
    started_at = datetime.now(timezone.utc)
    started = time.monotonic()
    entry: dict[str, Any] = {
        "created": started_at.isoformat(timespec="seconds"),
        "command": command_line(args),
        "quick": bool(args.quick),
        "machine": machine_info(),
        "versions": versions(),
    }
    ctx = SectionRun(
        name,
        args,
        data_dir,
        previous.get("data") if isinstance(previous, dict) else None,
        progress,
    )
    try:
        data = section_module(name).run(ctx)
    except Exception as err:  # a failing section is a result, not the end
        data = {"error": f"{type(err).__name__}: {err}"}
    entry.update(wall_s=time.monotonic() - started, data=data)
    return entry


def bench(
    names: Sequence[str], args: argparse.Namespace, out: Path, console: Any
) -> dict[str, Any]:
    """Run ``names`` with a progress display; write the merged results and page."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from . import report
    from .suite_section import quiet

    results = report.load(out)
    data_dir = out / report.RESULTS_DIR
    data_dir.mkdir(parents=True, exist_ok=True)
    quiet()
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[last]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )
    with progress:
        for name in names:
            previous = results["sections"].get(name)
            entry = run_section(name, args, data_dir, previous, progress)
            results["sections"][name] = entry
            report.write(results, out, command_line(args))
    return results


def list_choices() -> list[str]:
    """Each section's ``choices()`` lines, under its name."""
    lines = []
    for name in SECTIONS:
        choices = getattr(section_module(name), "choices", None)
        if choices is not None:
            lines += [f"{name}:", *(f"  {line}" for line in choices())]
    return lines


def rebuild(args: argparse.Namespace, out: Path) -> int:
    """``--rebuild``: the page from the results.json in ``out``, nothing run."""
    from . import report

    if args.quick or args.sections:
        print(
            "flowerbed bench: error: --rebuild runs nothing; drop --quick and "
            "--sections",
            file=sys.stderr,
        )
        return 2
    try:
        results = report.load(out)
    except ValueError as err:
        print(f"flowerbed bench: error: {err}", file=sys.stderr)
        return 2
    if not results["sections"]:
        print(
            f"flowerbed bench: error: --rebuild found no results in "
            f"{out / report.RESULTS_DIR / 'results.json'}; run the bench first",
            file=sys.stderr,
        )
        return 2
    page = report.write(results, out, command_line(args))
    print(f"wrote {page} from {out / report.RESULTS_DIR / 'results.json'}")
    return 0


def summary(
    names: Sequence[str], results: Mapping[str, Any], quick: bool
) -> tuple[list[str], list[str]]:
    """The console's lines after a run of ``names`` (rich markup), and the
    sections that failed. A quick run says first that it checks structure only
    and judges no target."""
    from .report import PAGE, QUICK_DETAIL, QUICK_TITLE, headline_sentence, target_lines

    lines = [f"[bold]{QUICK_TITLE}[/bold] {QUICK_DETAIL}"] if quick else []
    failed = []
    for name in names:
        data = results["sections"][name]["data"]
        if "error" in data:
            failed.append(f"{name} ({data['error']})")
        if name == "suite" and "headline" in data:
            lines.append(headline_sentence(data["headline"], quick))
            if not quick:
                lines += target_lines(data["targets"])
            if data["errors"]:
                lines.append(
                    f"[yellow]{len(data['errors'])} suite runs failed; see "
                    f"{PAGE}[/yellow]"
                )
    if failed:
        lines.append(f"[red]sections that failed:[/red] {'; '.join(failed)}")
    return lines, failed


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .report import PAGE, QUICK_DETAIL, QUICK_TITLE

    if args.list:
        print("\n".join(list_choices()))
        return 0
    console = Console()
    try:
        out = out_dir(args)
        if args.rebuild:
            return rebuild(args, out)
        names = sections_from_args(args)
        writable(out)
    except ValueError as err:
        print(f"flowerbed bench: error: {err}", file=sys.stderr)
        return 2
    if args.quick:
        console.print(f"[bold]{QUICK_TITLE}[/bold] {QUICK_DETAIL}")
    started = time.monotonic()
    results = bench(names, args, out, console)
    lines, failed = summary(names, results, args.quick)
    for line in lines:
        console.print(line)
    console.print(
        f"wrote {out / PAGE} and {out / 'benchmarks'} "
        f"({', '.join(names)}) in {(time.monotonic() - started) / 60:.1f} min"
    )
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    from flowerbed.cli import main as cli_main

    return cli_main(["bench", *(argv or [])])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
