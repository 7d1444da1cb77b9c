"""The deadline's pacer: a factor on the deadline that follows accuracy progress."""

from __future__ import annotations


class Pacer:
    """Oort's pacer (Lai et al., OSDI 2021, Sec. 4.3).

    Every ``window`` rounds it compares the accuracy gained over the last
    ``window`` rounds with the ``window`` before: if progress slowed, ``f *=
    1 + step`` (more patience, more participants), otherwise ``f *= 1 -
    step``; ``f`` stays within ``bounds``.
    """

    def __init__(self) -> None:
        self.factor = 1.0
        """``f``, the factor on the round's deadline."""
        self.progress: list[float] = []
        """The accuracy after each round the pacer has seen, oldest first."""

    def update(
        self,
        server_round: int,
        value: float,
        step: float,
        window: int,
        bounds: tuple[float, float],
    ) -> str | None:
        """Record the accuracy ``value`` after ``server_round``; on a window's
        last round (with two windows and one more value seen) move
        :attr:`factor` and say which way, else None."""
        self.progress.append(value)
        if len(self.progress) < 2 * window + 1 or server_round % window != 0:
            return None
        recent = self.progress[-1] - self.progress[-1 - window]
        before = self.progress[-1 - window] - self.progress[-1 - 2 * window]
        lo, hi = bounds
        if recent < before:
            self.factor = min(hi, self.factor * (1 + step))
            return "slowed: relaxing"
        self.factor = max(lo, self.factor * (1 - step))
        return "held: tightening"
