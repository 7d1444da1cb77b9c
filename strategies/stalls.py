"""Rounds without an update: what became of a round's messages, and what to change.

:class:`RoundTally` counts what became of one round's train messages; when no
update has been applied for :data:`STALL_ROUNDS` rounds in a row (or in a whole
run) the round loop logs the likely cause that :func:`stall_cause` (or a
strategy's own, such as :func:`deadline_stall_cause`) reads from it, with the
setting to change.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from logging import ERROR, WARNING

from flowerbed.replies import UNAVAILABLE_CODES
from flwr.supercore import log

from .inflight import Arrival

STALL_ROUNDS = 3
"""Rounds in a row without an update before the log says so prominently."""


@dataclass
class RoundTally:
    """What became of one round's train messages (for the no-progress warning)."""

    sampled: int
    usable: int
    rejected: Counter[str]
    """Reasons of rejected replies (error replies included), with counts."""
    unavailable: int
    """Replies that never came: expired TTL or node gone."""
    missing: int
    """Messages still unanswered when the round closed."""

    @classmethod
    def of(cls, sampled: int, handed: list[Arrival], missing: int) -> RoundTally:
        unavailable = sum(a.error_code in UNAVAILABLE_CODES for a in handed)
        rejected = Counter(
            a.reason
            for a in handed
            if not a.usable and a.error_code not in UNAVAILABLE_CODES
        )
        usable = sum(a.usable for a in handed)
        return cls(sampled, usable, rejected, unavailable, missing)


def stall_cause(tally: RoundTally, min_available_nodes: int, timeout: float) -> str:
    """Likely cause of a round without an update, and the setting to change."""
    if tally.sampled == 0:
        return (
            "no node could be sampled (all quarantined or busy, or fewer than "
            f"min_available_nodes={min_available_nodes} connected)"
        )
    if tally.rejected:
        reason, count = tally.rejected.most_common(1)[0]
        return (
            f"{sum(tally.rejected.values())} of {tally.sampled} replies were "
            f"rejected, most often ({count}x): {reason}"
        )
    return (
        f"{tally.missing + tally.unavailable} of {tally.sampled} sampled nodes "
        f"did not reply within start()'s timeout={timeout:g} s or their "
        "messages expired: raise timeout"
    )


def deadline_stall_cause(
    tally: RoundTally,
    min_completion: int,
    deadline: float | None,
    adaptive: tuple[float, float] | None,
    deadline_s: float | None,
) -> str | None:
    """The cause when a round with a deadline got too few usable replies;
    None when :func:`stall_cause` says it better.

    ``adaptive``: the adaptive deadline's growth per round and ``start()``'s
    timeout (None for a fixed deadline ``deadline_s``).
    """
    if tally.sampled and 0 < tally.usable < min_completion:
        return (
            f"only {tally.usable} usable replies, fewer than min_completion="
            f"{min_completion}: lower min_completion or sample more nodes"
        )
    late = tally.missing + tally.unavailable
    if not (tally.sampled and late and deadline is not None):
        return None
    if adaptive is not None:
        growth, timeout = adaptive
        advice = (
            f"the adaptive deadline grows by {growth:g}x per round "
            f"(up to start()'s timeout={timeout:g} s)"
        )
    else:
        advice = f"raise deadline_s (now {deadline_s:g}) or set adaptive_deadline=True"
    return (
        f"{late} of {tally.sampled} sampled nodes missed the "
        f"{deadline:.3g} s deadline or their messages expired: {advice}"
    )


def warn_stalled(server_round: int, rounds: int, cause: str) -> None:
    """Log that no update has been applied for ``rounds`` rounds, and why."""
    log(
        WARNING,
        "NO PROGRESS: no update applied for %d rounds (up to round %d); "
        "the model is the one of round %d. Likely cause: %s",
        rounds,
        server_round,
        server_round - rounds,
        cause,
    )


def warn_never_trained(rounds: int, cause: str) -> None:
    """Log that none of a run's ``rounds`` rounds applied an update, and why."""
    log(
        ERROR,
        "NO TRAINING: none of the %d rounds applied an update, so the final "
        "model is the initial one. Likely cause: %s",
        rounds,
        cause,
    )
