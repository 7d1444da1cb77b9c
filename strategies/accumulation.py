"""Streaming aggregation: folding replies into a running weighted sum of updates
(O(model) memory), and the weighted mean of their metrics.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from logging import WARNING

import numpy as np
from flowerbed import keys
from flowerbed.arrays import array_view, encode_record
from flowerbed.replies import (
    ReplyRejected,
)
from flwr.app import (
    ArrayRecord,
    MetricRecord,
    RecordDict,
)
from flwr.supercore import log

from . import fold_kernel


def to_numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    """Decode every array of ``record`` into writable arrays of its own."""
    return {name: array_view(array).copy() for name, array in record.items()}


def to_arrayrecord(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    """Encode NumPy arrays as an ArrayRecord (order kept)."""
    return encode_record(arrays)


PAD_FROM = 2
"""Fewest values the compiled fold pads to :data:`fold_kernel.MOST` (see
``_fold_compiled``)."""

FOLD_CHUNK = 1 << 16
"""Elements folded per step: 256 KiB of float32, so that the chunk's difference
stays in a core's L2 cache between the passes of one fold step (difference,
sum of squares, scale, add)."""


def _rejection(name: str, delta: np.ndarray) -> ReplyRejected:
    """Why an update whose ``delta`` has a non-finite sum of squares is refused."""
    if not np.isfinite(delta).all():
        return ReplyRejected(f"array {name!r} contains NaN or Inf")
    return ReplyRejected(f"array {name!r} changes by more than float32 can sum")


def _sum_dtype(dtype: np.dtype) -> np.dtype:
    """The running sum's dtype for arrays of ``dtype``: see UpdateAccumulator."""
    if dtype.kind == "f" and dtype.itemsize <= 4:
        return np.dtype(np.float32)
    return np.dtype(np.float64)


def update_norm(
    arrays: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray]
) -> float:
    """``||x - base||`` over the float arrays, in float64; ReplyRejected naming
    the array if it is not finite."""
    squares = 0.0
    for name, value in arrays.items():
        if np.asarray(value).dtype.kind != "f":
            continue
        delta = np.subtract(value, base[name], dtype=np.float64)
        squares += float(np.dot(delta.ravel(), delta.ravel()))
        if not math.isfinite(squares):
            raise ReplyRejected(f"array {name!r} contains NaN or Inf")
    return math.sqrt(squares)


def check_positive(label: str, value: float | None) -> None:
    """ValueError naming ``label`` unless ``value`` is None or finite and > 0."""
    if value is not None and not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{label} must be finite and > 0, got {value}")


def _read_only(array: np.ndarray) -> np.ndarray:
    """A read-only view of ``array`` (the array itself stays writable)."""
    view = array.view()
    view.flags.writeable = False
    return view


def _fold_compiled(
    compiled: fold_kernel.Kernel,
    name: str,
    flat: Sequence[np.ndarray],
    base: np.ndarray,
    total: np.ndarray,
    factors: Sequence[float],
    fresh: bool,
    source: np.ndarray | None = None,
) -> tuple[list[float], dict[int, tuple[ReplyRejected, int]]]:
    """:meth:`UpdateAccumulator._fold` by the compiled kernel: one call for all
    the values (``fresh``: ``total`` is not written yet; ``source``: the sum so
    far, which ``total``, not written yet, is to replace)."""
    dtype = total.dtype
    # The kernel compiles once per tuple type: the values as read-only
    # views, in tuples of fold_kernel.MOST and one of the rest.
    flat = [v if not v.flags.writeable else _read_only(v) for v in flat]
    scalars = np.array(factors, dtype)  # as NumPy rounds a Python float
    squares: list[float] = []
    stopped: list[int] = []
    for first in range(0, len(flat), fold_kernel.MOST):
        count = min(fold_kernel.MOST, len(flat) - first)
        values = flat[first : first + count]
        factors_now = scalars[first : first + count]
        starts = fresh and first == 0
        if PAD_FROM <= count < fold_kernel.MOST and not starts:
            # Padded to four with the base itself at factor 0: it adds
            # exactly 0 and is read from cache (the same addresses as the
            # base), so two or three values fold together too.
            pad = fold_kernel.MOST - count
            values = values + [_read_only(base)] * pad
            factors_now = np.concatenate([factors_now, np.zeros(pad, dtype)])
        found, where = compiled(
            tuple(values),
            base,
            total,
            factors_now,
            dtype.type(0),
            starts,
            source if first == 0 else None,
        )
        squares += found[:count].tolist()
        stopped += where[:count].tolist()
    failed: dict[int, tuple[ReplyRejected, int]] = {}
    for k, start in enumerate(stopped):
        if start >= 0:
            block = slice(start, start + fold_kernel.BLOCK)
            failed[k] = (_rejection(name, flat[k][block] - base[block]), start)
    if base.dtype.kind != "f":
        squares = [0.0] * len(flat)
    return squares, failed


@dataclass(frozen=True)
class Update:
    """One reply for :meth:`UpdateAccumulator.add_many` (``add``'s arguments)."""

    arrays: Mapping[str, np.ndarray]
    base: Mapping[str, np.ndarray]
    weight: float
    scale: float = 1.0
    steps: float = 1.0
    max_norm: float | None = None
    norm: float | None = None
    """``||x - base||`` when the caller already knows it (a clipped update is
    then scaled before it is folded, without a pass of its own)."""


class UpdateAccumulator:
    """Running weighted sum of model updates: O(model) memory, any number of replies.

    Each reply ``i`` contributes its update ``delta_i = x_i - base_i`` (``base_i``
    is the global model it trained from) with weight ``w_i`` and scale ``c_i``::

        S = sum_i w_i c_i delta_i,   W = sum_i w_i,   T = sum_i w_i tau_i

    :meth:`result` returns ``x + m S / W`` where ``m = 1`` for plain averaging
    (with ``c_i = 1`` and a common base this equals ``sum_i (w_i/W) x_i``, FedAvg)
    and ``m = T / W`` for FedNova (Wang et al., NeurIPS 2020, Eq. 6 with vanilla
    SGD: ``c_i = 1/tau_i``, ``tau_eff = sum_i p_i tau_i``).

    Speed: :meth:`add` folds each array in one pass with the compiled kernel
    of :mod:`flowerbed.strategies.fold_kernel` (numba; installed with
    flowerbed): per element it forms ``delta``, adds its square to the update's
    sum of squares (the update's norm, and the NaN/Inf check: the sum is finite
    exactly when every element is, and stays below float32's range) and adds
    ``w_i c_i delta`` into the sum, so the update, its base and the sum are each
    read once from memory and the sum written once, with no temporaries; a
    non-finite element never enters the sum. Arrays read from an
    ``ArrayRecord`` with :func:`array_view` are not copied at all. Without
    numba (or for mixed dtypes, float16 and integer arrays) the same sums are
    made with NumPy in chunks of :data:`FOLD_CHUNK` elements, several passes
    over each cache-resident chunk. :meth:`add_many` folds several replies
    that trained from the same base together: the kernel takes four at a time
    element by element, so the base and the sum are read (and the sum
    written) once for the four, ~1.7x the throughput of one at a time on
    this project's machine; NumPy goes chunk by chunk. The sum is the same,
    bit for bit, as adding the replies one by one in the same order (their
    norms to float32 summation order). Measured by ``flowerbed bench``'s
    machinery section. Memory: a new sum is written by its first update, not
    zeroed first; :meth:`result` is made in the sum's own memory; and
    ``memory`` (arrays no longer needed, such as the last result once it was
    encoded) is where the sums are made, so that a server that keeps it
    between rounds does not fault in fresh pages each round (about a third of
    a fold's time per model-sized array here).
    The base is read for every update because the norm and the NaN/Inf check
    are of ``delta``, and because summing ``delta`` keeps float32 exact enough
    (below); folding raw replies and taking the weighted base off once at the
    end would save that read but sum model-sized values, whose float32
    roundings are of the weights, not of the updates: for the 138 updates
    below, 12.3 float32 ulp of the result at most (mean 1.8) against 0.58
    (mean 0.25) for the sum of updates, measured against float64.

    Precision: ``S`` is kept in float32 for float16/32 arrays and in float64 for
    float64 and integer arrays (integer arrays such as BatchNorm's
    ``num_batches_tracked`` are then rounded in :meth:`result`). Summing the
    *updates* rather than the models keeps float32 accurate: each addition
    rounds relative to ``|S|``, which is of the size of an update, not of a
    weight, so the result's error is far below one float32 ulp of the model.
    Measured in ``tests/test_strategies_streaming.py``: 138 updates of 1e-3
    relative size with uneven weights agree with a float64 computation to
    within one float32 rounding of the result (0.53 ulp at most where
    ``|x| > 0.01``) plus, for weights near 0, one float32 rounding of an
    update's size. A float64 sum would only change the result for updates
    below float32's resolution of the weights, which a float32 model cannot
    hold anyway; it is used where it does matter: float64 models, and integer
    arrays (exact counts up to 2**53). The norm's sum of squares is float32
    within a block of ``fold_kernel.BLOCK`` (NumPy: a chunk) elements and
    float64 across them.

    Clipping: :meth:`add` returns the update's L2 norm ``||delta_i||`` (over its
    float arrays), computed in the same pass, and with ``max_norm`` scales the
    update by ``min(1, max_norm / ||delta_i||)`` before it counts (norm
    clipping, e.g. Sun et al., "Can You Really Backdoor Federated Learning?",
    2019, Sec. 4). The factor is applied before the update enters the sum,
    never by taking an excess back out afterwards: an update 10^18 times too
    long, added and then mostly subtracted, would cancel away the float32 digits
    of every other update in the sum. The norm is the caller's (``norm``, known
    from an earlier pass) or is taken in a float64 pass of its own.
    """

    def __init__(
        self,
        memory: Mapping[str, np.ndarray] | None = None,
        spare: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        self._sum: dict[str, np.ndarray] = {}
        self._pool: dict[str, list[np.ndarray]] = {}
        for given in (spare or {}, memory or {}):  # memory first (popped last)
            for name, array in given.items():
                self._pool.setdefault(name, []).append(array)
        self._staged: dict[str, np.ndarray] | None = None
        self._buffers: dict[np.dtype, np.ndarray] = {}
        self.total_weight = 0.0
        self.weighted_steps = 0.0
        self.count = 0
        self._spent = False

    def _check_open(self) -> None:
        if self._spent:
            raise RuntimeError(
                "UpdateAccumulator.result() was taken (in the sum's memory): "
                "fold further updates into a new accumulator"
            )

    def add(
        self,
        arrays: Mapping[str, np.ndarray],
        base: Mapping[str, np.ndarray],
        weight: float,
        *,
        scale: float = 1.0,
        steps: float = 1.0,
        max_norm: float | None = None,
        norm: float | None = None,
    ) -> float:
        """Fold one update in; return its L2 norm ``||x - base||`` before scaling.

        ``norm``: the update's norm when the caller knows it (see :class:`Update`).

        ``arrays`` and ``base`` may be dropped (or reused) afterwards; ``arrays``
        may be read-only views and of another float dtype than ``base``.

        Raises
        ------
        ValueError
            When ``weight`` (or ``max_norm``) is not finite and > 0.
        ReplyRejected
            When an array of the update contains NaN or Inf, or differences too
            large to sum (over ~1.8e19); the sum is then left as it was (to
            within one rounding per element already folded).
        """
        (outcome,) = self.add_many(
            [Update(arrays, base, weight, scale, steps, max_norm, norm)]
        )
        if isinstance(outcome, ReplyRejected):
            raise outcome
        return outcome

    def add_many(
        self,
        updates: Sequence[Update],
        *,
        keep: Callable[[list[float | ReplyRejected]], bool] | None = None,
    ) -> list[float | ReplyRejected]:
        """Fold several updates in one pass; each one's norm, or why it was rejected.

        Equal to calling :meth:`add` on each in order (the same sum, bit for
        bit, when none is rejected), but replies sharing their base arrays (the
        same objects) are folded together, chunk by chunk (see the class). A
        rejected update (NaN/Inf) is returned as its :class:`ReplyRejected` and
        leaves the sum as it was; the others still count.

        ``keep``: the updates count only if ``keep(outcomes)`` says so, once
        their norms are known; otherwise the sum is as it was, exactly. The
        pass then writes the sum plus the updates to other memory (the same
        memory traffic: the sum is read and a sum written either way) and
        keeps it or drops it, each array's other sum going back to memory
        for the next time (:meth:`leftover`). This lets a caller decide what
        an update may count for (a bound needing its norm) after one pass for
        the group, and fold it again with that decision when the decision
        differs from what was folded (:class:`flowerbed.strategies.robust.
        BoundedSum`): an unbounded update is never taken back out of the sum,
        which would cancel the other updates' digits in float32.

        Raises
        ------
        ValueError
            When a ``weight`` (or ``max_norm``) is not finite and > 0, before
            anything is folded.
        """
        for update in updates:
            check_positive("weight", update.weight)
            check_positive("max_norm", update.max_norm)
        self._check_open()
        groups: dict[tuple[object, ...], list[int]] = {}
        for i, update in enumerate(updates):
            names = tuple(update.arrays)
            key = (names, *(id(update.base.get(name)) for name in names))
            groups.setdefault(key, []).append(i)
        outcomes: list[float | ReplyRejected] = [0.0] * len(updates)
        if keep is not None:
            self._staged = {}
        try:
            for members in groups.values():
                for i, outcome in zip(
                    members,
                    self._fold_group([updates[i] for i in members]),
                    strict=True,
                ):
                    outcomes[i] = outcome
        finally:
            staged, self._staged = self._staged, None
        if staged is not None:
            kept = keep is not None and keep(outcomes)
            for name, array in staged.items():
                free: np.ndarray | None = array
                if kept:  # the sum so far becomes free memory
                    free, self._sum[name] = self._sum.get(name), array
                if free is not None:
                    self._pool.setdefault(name, []).append(free)
            if not kept:
                return outcomes
        for update, outcome in zip(updates, outcomes, strict=True):
            if not isinstance(outcome, ReplyRejected):
                self.total_weight += update.weight
                self.weighted_steps += update.weight * update.steps
                self.count += 1
        return outcomes

    def _fold_group(self, group: Sequence[Update]) -> list[float | ReplyRejected]:
        """Fold updates whose arrays have the same names and base objects."""
        factors = [u.weight * u.scale for u in group]
        clipped = list(factors)  # of the float arrays (the norm's)
        for j, update in enumerate(group):
            if update.max_norm is None:
                continue
            norm = update.norm
            if norm is None:
                try:
                    norm = update_norm(update.arrays, update.base)
                except ReplyRejected:  # the fold below rejects it, naming it
                    continue
            if norm > update.max_norm:
                clipped[j] *= update.max_norm / norm

        def factor(j: int, value: np.ndarray) -> float:
            """Update ``j``'s factor for one of its arrays (clipping scales its
            float arrays only: they are what the norm measures)."""
            return clipped[j] if np.asarray(value).dtype.kind == "f" else factors[j]

        squares = [0.0] * len(group)
        rejected: dict[int, tuple[ReplyRejected, str, int]] = {}
        names = list(group[0].arrays)
        for name in names:
            live = [j for j in range(len(group)) if j not in rejected]
            if not live:
                break
            base = group[0].base[name]
            values = [group[j].arrays[name] for j in live]
            found, failures = self._fold(
                name,
                values,
                base,
                [factor(j, v) for j, v in zip(live, values, strict=True)],
            )
            for k, j in enumerate(live):
                squares[j] += found[k]
            for k, (rejection, start) in failures.items():
                rejected[live[k]] = (rejection, name, start)
        outcomes: list[float | ReplyRejected] = []
        for j, update in enumerate(group):
            if j in rejected:  # take back what was folded of it
                rejection, failed, start = rejected[j]
                for name in names[: names.index(failed)]:
                    value = update.arrays[name]
                    self._fold(name, [value], update.base[name], [-factor(j, value)])
                if start:
                    value = np.ravel(update.arrays[failed])[:start]
                    base = np.ravel(update.base[failed])[:start]
                    self._fold(failed, [value], base, [-factor(j, value)])
                outcomes.append(rejection)
                continue
            outcomes.append(math.sqrt(squares[j]))
        return outcomes

    def leftover(self) -> dict[str, np.ndarray]:
        """Memory given (``memory``, ``spare``) or freed (a sum a staged group
        replaced) and not used: worth keeping for the next accumulator's
        ``spare``."""
        return {name: arrays[-1] for name, arrays in self._pool.items() if arrays}

    def _new_sum(self, name: str, size: int, dtype: np.dtype) -> np.ndarray:
        """Memory for the sum of ``name`` (not written): the array of the same
        name, size and dtype given as ``memory``, else new memory."""
        arrays = self._pool.get(name)
        given = arrays.pop() if arrays else None
        if (
            isinstance(given, np.ndarray)
            and given.size == size
            and given.dtype == dtype
            and given.flags.writeable
            and given.flags.c_contiguous
        ):
            return given.reshape(-1)
        return np.empty(size, dtype)

    def _buffer(self, dtype: np.dtype) -> np.ndarray:
        if dtype not in self._buffers:
            self._buffers[dtype] = np.empty(FOLD_CHUNK, dtype)
        return self._buffers[dtype]

    def _fold(
        self,
        name: str,
        values: Sequence[np.ndarray],
        base: np.ndarray,
        factors: Sequence[float],
    ) -> tuple[list[float], dict[int, tuple[ReplyRejected, int]]]:
        """Add ``factor_k (value_k - base)`` into the sum, chunk by chunk.

        Returns each value's sum of squares and, for each value with a
        non-finite (or too large) chunk, its rejection and where that chunk
        starts: such a value is not folded from there on (the caller takes
        back what was).
        """
        flat = [
            np.ravel(v) for v in values
        ]  # C order, as the base: a copy only if Fortran
        base = np.ravel(base)
        dtype = _sum_dtype(base.dtype)
        compiled = fold_kernel.kernel() if base.dtype == dtype else None
        sums = self._sum if self._staged is None else self._staged
        # Staged (add_many's ``keep``): the sum so far stays as it is, and the
        # first fold of each array writes it plus the values to new memory.
        source = self._sum.get(name) if sums is not self._sum else None
        if compiled is not None and all(v.dtype == dtype for v in flat):
            fresh = name not in sums
            if fresh:  # the kernel writes it: no zeros to write first
                sums[name] = self._new_sum(name, base.size, dtype)
            total = sums[name]
            return _fold_compiled(
                compiled,
                name,
                flat,
                base,
                total,
                factors,
                fresh and source is None,
                source if fresh else None,
            )
        if name not in sums:
            sums[name] = self._new_sum(name, base.size, dtype)
            if source is None:
                sums[name].fill(0)
            else:
                np.copyto(sums[name], source)
        total = sums[name]
        scalars = [dtype.type(f) for f in factors]  # as NumPy rounds a Python float
        squares = [0.0] * len(flat)
        failed: dict[int, tuple[ReplyRejected, int]] = {}
        live = list(range(len(flat)))
        with np.errstate(over="ignore", invalid="ignore"):
            for start in range(0, base.size, FOLD_CHUNK):
                stop = min(start + FOLD_CHUNK, base.size)
                part = base[start:stop]
                into = total[start:stop]
                for k in live:
                    delta = self._buffer(dtype)[: stop - start]
                    np.subtract(flat[k][start:stop], part, out=delta, casting="unsafe")
                    chunk = float(np.dot(delta, delta))
                    if not math.isfinite(chunk):
                        failed[k] = (_rejection(name, delta), start)
                        continue
                    delta *= scalars[k]
                    into += delta
                    squares[k] += chunk
                if failed and len(failed) > len(flat) - len(live):
                    live = [k for k in live if k not in failed]
        if base.dtype.kind != "f":
            squares = [0.0] * len(flat)
        return squares, failed

    def result(
        self,
        current: Mapping[str, np.ndarray],
        *,
        normalise_steps: bool = False,
        step_size: float = 1.0,
    ) -> dict[str, np.ndarray]:
        """Return ``current + eta m S / W`` in each array's own dtype.

        ``eta = step_size`` is a server learning rate (FedBuff's ``eta_g``).
        Float arrays with a sum of their own dtype are made in the sum's own
        memory, chunk by chunk (one pass over the sum and the model, while the
        chunk is in cache): no new model-sized allocation, whose first touch
        costs the kernel about as much as folding an update. The sum is then
        spent: the accumulator takes no more updates, and a second call raises.
        """
        if self.count == 0:
            raise ValueError("no updates to aggregate")
        self._check_open()
        self._spent = True
        m = self.weighted_steps / self.total_weight if normalise_steps else 1.0
        m *= step_size
        factor = m / self.total_weight
        finish = fold_kernel.finisher()
        out: dict[str, np.ndarray] = {}
        for name, value in current.items():
            total = self._sum[name]
            value = np.asarray(value)
            if value.dtype == total.dtype:
                flat = np.ravel(value)
                new = total
                if finish is not None:
                    finish(new, flat, total.dtype.type(factor))
                else:
                    for start in range(0, total.size, FOLD_CHUNK):
                        part = new[start : start + FOLD_CHUNK]
                        np.multiply(part, factor, out=part)
                        part += flat[start : start + FOLD_CHUNK]
                new = new.reshape(value.shape)
            else:
                new = np.multiply(total, factor, dtype=total.dtype).reshape(value.shape)
                new += value
            if value.dtype.kind in "iub":
                new = np.rint(new)
            out[name] = new.astype(value.dtype, copy=False)
        return out


def _metric_shape(value: object) -> int | None:
    """None for a number, the length of a list: what averaging needs to agree."""
    return len(value) if isinstance(value, list) else None


IDENTIFIERS = frozenset({keys.PARTITION_ID, "node-id", "partition_id", "node_id"})
"""Metrics that name something rather than measure it: left out of the round's
averaged metrics (an average partition id of 4.5 is not a fact about the round)."""


class MetricsAccumulator:
    """Keeps only the MetricRecords of accepted replies (small), for aggregation."""

    def __init__(self, weighted_by_key: str) -> None:
        self.weighted_by_key = weighted_by_key
        self.records: list[RecordDict] = []

    def add(self, metrics: MetricRecord, weight: float) -> None:
        """Keep ``metrics`` with ``weight`` as its weighting value, leaving out
        the identifiers (:data:`IDENTIFIERS`): their mean means nothing."""
        kept = MetricRecord({k: v for k, v in metrics.items() if k not in IDENTIFIERS})
        kept[self.weighted_by_key] = weight
        self.records.append(RecordDict({keys.METRICS: kept}))

    def cap(self, most: float) -> int:
        """Count no record's weight above ``most`` (the influence bound's cap);
        return how many weights it lowered."""
        lowered = 0
        for weight, kept in zip(self.weights(), self._kept(), strict=True):
            if weight > most:
                kept[self.weighted_by_key] = most
                lowered += 1
        return lowered

    def weights(self) -> list[float]:
        """The kept records' weights, in the order they were added."""
        return [float(kept[self.weighted_by_key]) for kept in self._kept()]  # type: ignore[arg-type]

    def _kept(self) -> list[MetricRecord]:
        kept = [record[keys.METRICS] for record in self.records]
        assert all(isinstance(k, MetricRecord) for k in kept)
        return kept  # type: ignore[return-value]

    def result(
        self, aggr_fn: Callable[[list[RecordDict], str], MetricRecord]
    ) -> MetricRecord | None:
        """Aggregate with Flower's ``(list[RecordDict], str) -> MetricRecord``,
        after :meth:`agree`."""
        if not self.records:
            return None
        self.agree()
        return aggr_fn(self.records, self.weighted_by_key)

    def agree(self) -> None:
        """Leave a metric out of the replies where it has another shape than in
        most: a number where most have a list, or a list of another length.

        Flower's average of MetricRecords raises on both, which would end the
        run; rejecting the whole reply would let one fast node's odd metric
        reject every honest reply after it. So the replies' updates all count,
        and only the odd metric values are dropped (logged).
        """
        kept = self._kept()
        shapes: dict[str, Counter[int | None]] = {}
        for record in kept:
            for key, value in record.items():
                shapes.setdefault(key, Counter())[_metric_shape(value)] += 1
        for key, counts in shapes.items():
            if len(counts) == 1 or key == self.weighted_by_key:
                continue
            usual = max(counts, key=lambda shape: (counts[shape], shape is None))
            odd = [r for r in kept if key in r and _metric_shape(r[key]) != usual]
            for record in odd:
                del record[key]
            log(
                WARNING,
                "metric %r left out of %d replies: not %s as in the other %d",
                key,
                len(odd),
                "a number" if usual is None else f"a list of {usual}",
                counts[usual],
            )
