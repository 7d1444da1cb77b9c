"""Populations: fleets larger than their dataset, of which a cohort trains each round.

A simulated fleet can have far more devices (``num-nodes``, 10,000 and more) than
a round uses: the strategy samples a cohort (``fraction-train``), and the
in-process engine builds a device's context, data and model only when the device
is first sampled (:meth:`flowerbed.sims.engine.FleetGrid.context`), so unsampled
devices cost a node id and nothing else.

While the dataset can give every device its own disjoint shard of at least
:data:`MIN_SAMPLES` samples, it does (``flowerbed.data.partition``). Beyond that,
each device *draws* its shard for itself, from a random stream of its own
(seed, device, split), so device ``i``'s data never depends on how many others
exist or were sampled:

- ``iid``: :data:`MIN_SAMPLES` distinct samples uniformly at random;
- ``dirichlet``: class proportions ``q ~ Dir(alpha * 1_K)``, then that many
  samples per class (Hsu, Qi, Brown, "Measuring the effects of non-identical
  data distribution for federated visual classification", arXiv:1909.06335,
  Sec. 3, which draws each client's class mix this way).

Shards then overlap between devices, as they would for a population of phones
drawing from one distribution. Other partition schemes cannot be drawn per
device: a population they cannot feed is refused before anything runs.
"""

from __future__ import annotations

import math

import numpy as np
from flowerbed.data import DataError

MIN_SAMPLES = {"train": 2, "test": 1}
"""Samples each device gets at least, per split (as the disjoint partition asks)."""
DRAWABLE = ("iid", "dirichlet")
"""Partition schemes a device can draw its own shard from."""
_SPLIT_STREAM = {"train": 0, "test": 1}


def fits(num_samples: int, num_nodes: int, split: str) -> bool:
    """True when a disjoint partition gives every device its minimum shard."""
    return num_samples >= num_nodes * MIN_SAMPLES[split]


def check_population(
    num_samples: int, num_nodes: int, scheme: str, dataset: str
) -> None:
    """Refuse a population its training data cannot feed.

    Raises
    ------
    DataError
        When ``num_nodes`` devices cannot each have ``MIN_SAMPLES["train"]``
        disjoint samples and ``scheme`` cannot be drawn per device.
    """
    if fits(num_samples, num_nodes, "train") or scheme in DRAWABLE:
        return
    most = num_samples // MIN_SAMPLES["train"]
    raise DataError(
        f"{dataset!r} has {num_samples} training samples: partition {scheme!r} "
        f"cannot give {num_nodes} nodes {MIN_SAMPLES['train']} each (at most "
        f"{most} nodes); use num-nodes <= {most}, or a partition that devices draw "
        f"for themselves ({', '.join(DRAWABLE)})"
    )


TASK_BYTES_PER_MODEL = 3
"""Model-sized buffers one train task of a round holds (its reply's arrays, their
serialised copy, the message); measured: LeNet (85.5 kB) on digits costs ~287 kB
per node-task at 2,000 and 8,000 nodes."""
TASK_OVERHEAD_BYTES = 32 * 1024
"""Bytes one train task holds besides the model-sized buffers (context, records)."""


def cohort_bytes(num_nodes: int, fraction_train: float, model_bytes: int) -> int:
    """Memory a round's train tasks hold: every sampled node's reply waits in
    memory until the round (or its virtual time) reaches it."""
    cohort = math.ceil(fraction_train * num_nodes)
    return cohort * (TASK_BYTES_PER_MODEL * model_bytes + TASK_OVERHEAD_BYTES)


def check_cohort_memory(
    num_nodes: int, fraction_train: float, model_bytes: int, available: int
) -> None:
    """Refuse a round whose train tasks cannot fit in ``available`` bytes.

    Raises
    ------
    DataError
        Naming the round's size, the estimate and the largest cohort that fits.
    """
    need = cohort_bytes(num_nodes, fraction_train, model_bytes)
    if need <= available:
        return
    per_task = need / math.ceil(fraction_train * num_nodes)
    most = int(available // per_task)
    raise DataError(
        f"num-nodes={num_nodes} with fraction-train={fraction_train:g}: a round of "
        f"{math.ceil(fraction_train * num_nodes)} train tasks holds about "
        f"{need / 2**30:.1f} GiB ({per_task / 1024:.0f} KiB each for a "
        f"{model_bytes / 1024:.0f} KiB model), more than the "
        f"{available / 2**30:.1f} GiB of memory available; sample at most {most} "
        "nodes per round (lower num-nodes or fraction-train)"
    )


def drawn_shard(
    labels: np.ndarray,
    node: int,
    split: str,
    scheme: str,
    alpha: float,
    seed: int,
) -> np.ndarray:
    """Sorted sample indices device ``node`` draws for ``split`` (module docstring)."""
    if scheme not in DRAWABLE:
        raise DataError(
            f"partition {scheme!r} cannot be drawn per device; valid: "
            f"{', '.join(DRAWABLE)}"
        )
    size = min(MIN_SAMPLES[split], len(labels))
    rng = np.random.default_rng([seed, node, _SPLIT_STREAM[split]])
    if scheme == "iid":
        return np.sort(rng.choice(len(labels), size=size, replace=False))
    classes = np.unique(labels)
    counts = rng.multinomial(size, rng.dirichlet(np.full(len(classes), alpha)))
    picked = []
    for k, c in zip(classes, counts, strict=True):
        pool = np.flatnonzero(labels == k)
        if c:
            picked.append(rng.choice(pool, size=c, replace=bool(c > len(pool))))
    return np.sort(np.concatenate(picked))
