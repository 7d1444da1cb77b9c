"""What ``flowerbed sim`` prints: the per-round table, the closing line and the
failure summary, each made from a run's records or its results.json content.

The table fits an 80-column terminal: short headers, explained in its caption.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flowerbed.sims.recorder import RoundRecord
    from rich.table import Table

COLUMNS = (
    "round",
    "virtual s",
    "accuracy",
    "trained",
    "failed",
    "stragglers",
    "energy J",
)
"""Headers of the per-round table, one word or two short ones each."""
LEGEND = (
    "virtual s: the virtual clock when the round closed; trained: updates that "
    "arrived (results.json's participants); stragglers: tasks still out when the "
    "round closed"
)
"""The table's caption: what its abbreviated headers mean."""
MAX_NODES_LISTED = 5
"""Node ids a failure summary line names before it says how many more."""
MAX_KINDS_LISTED = 5
"""Kinds of failure printed; results.json's ``errors`` holds them all."""


def round_table(title: str) -> Table:
    """An empty per-round table (fill it with :func:`round_row`)."""
    from rich.table import Table

    table = Table(title=title, caption=LEGEND, caption_justify="left")
    for header in COLUMNS:
        table.add_column(header, justify="right", no_wrap=True, min_width=len(header))
    return table


def round_row(r: RoundRecord) -> tuple[str, ...]:
    """One round's cells, in :data:`COLUMNS` order."""
    return (
        str(r.round),
        f"{r.virtual_time_s:.1f}",
        f"{100 * r.accuracy:.1f}%",
        str(len(r.participants)),
        str(len(r.failed)),
        str(r.stragglers),
        f"{r.energy_j:.1f}",
    )


def closing_line(results: Mapping[str, Any]) -> str:
    """Final accuracy, virtual time to the target accuracy and energy."""
    final = results["final_accuracy"]
    ttt = results["time_to_target_s"]
    target = results["target_accuracy"]
    accuracy = "no round completed" if final is None else f"final accuracy {final:.1%}"
    reached = "not reached" if ttt is None else f"{ttt:.1f} s of virtual time"
    return (
        f"{accuracy}  |  time to {target:.0%}: {reached}  |  "
        f"energy {results['total_energy_j']:.1f} J"
    )


def failure_lines(results: Mapping[str, Any]) -> list[str]:
    """How many train tasks failed and why, from results.json's content.

    Per kind of error (:meth:`flowerbed.sims.recorder.FailureKind.as_dict`): how
    many tasks, on which nodes (the ids Flower's log names), in which rounds, and
    one failure in full, e.g.::

        4 of 40 train tasks failed:
          3 tasks on 2 nodes (1003, 1017) in rounds 1-2 and 4; the first:
            node 1017 in round 1: rpi3b (partition 17) dropped out
          node 1005 in round 2: no reply within the message's TTL of 3600 s

    A kind with one task is that task's line alone. No lines when none failed.
    """
    failed = int(results["failed_tasks"])
    if not failed:
        return []
    errors: Sequence[Mapping[str, Any]] = results["errors"]
    lines = [
        f"{failed} of {failed + int(results['trained_tasks'])} train tasks failed:"
    ]
    for error in errors[:MAX_KINDS_LISTED]:
        nodes = [int(n) for n in error["nodes"]]
        example = error["example"]
        first = (
            f"node {example['node']} in round {example['round']}: {example['reason']}"
        )
        if error["count"] == 1:
            lines.append(f"  {first}")
            continue
        lines.append(
            f"  {_count(error['count'], 'task')} on {_count(len(nodes), 'node')} "
            f"({_listed(nodes)}) in {_plural(len(error['rounds']), 'round')} "
            f"{spans(error['rounds'])}; the first:"
        )
        lines.append(f"    {first}")
    if len(errors) > MAX_KINDS_LISTED:
        lines.append(
            f"  and {_count(len(errors) - MAX_KINDS_LISTED, 'other kind')} "
            "(results.json: errors)"
        )
    return lines


def spans(numbers: Iterable[int]) -> str:
    """Numbers as sorted runs: ``[5, 1, 2, 3, 7]`` -> ``"1-3, 5 and 7"``."""
    runs: list[list[int]] = []
    for n in sorted(set(numbers)):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    texts = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    return " and ".join(filter(None, [", ".join(texts[:-1]), *texts[-1:]]))


def _listed(nodes: Sequence[int]) -> str:
    shown = ", ".join(str(n) for n in nodes[:MAX_NODES_LISTED])
    more = len(nodes) - MAX_NODES_LISTED
    return shown + (f" and {more} more" if more > 0 else "")


def _plural(n: int, noun: str) -> str:
    return noun if n == 1 else f"{noun}s"


def _count(n: int, noun: str) -> str:
    return f"{n} {_plural(n, noun)}"
