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

Before anything runs, :func:`check_partition` builds the disjoint partition the
nodes will use (:func:`train_partition`, the same call) and refuses one that leaves
a node short, and :func:`check_memory` refuses a population and round that cannot
fit in memory. This module imports no torch, so ``flowerbed sim --check`` does not.
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import numpy as np
from flowerbed.data import DataError, Dataset, load_dataset, partition
from flowerbed.sims.config import Scenario
from flowerbed.sims.fleet import assign_devices, speed_groups

MIN_SAMPLES = {"train": 2, "test": 1}
"""Samples each device gets at least, per split (as the disjoint partition asks)."""
DRAWABLE = ("iid", "dirichlet")
"""Partition schemes a device can draw its own shard from."""
_SPLIT_STREAM = {"train": 0, "test": 1}


def fits(num_samples: int, num_nodes: int, split: str) -> bool:
    """True when a disjoint partition gives every device its minimum shard."""
    return num_samples >= num_nodes * MIN_SAMPLES[split]


@functools.lru_cache(maxsize=4)
def cached_dataset(name: str, data_dir: str) -> Dataset:
    """:func:`flowerbed.data.load_dataset`, once per process: the checks before a
    run and its nodes read the same arrays."""
    return load_dataset(name, data_dir)


def train_partition(
    scenario: Scenario, data: Dataset, num_nodes: int
) -> list[np.ndarray]:
    """The disjoint training shards of ``num_nodes`` nodes, as the nodes build them
    (for a population the data can feed, see :func:`fits`)."""
    groups = (
        speed_groups(assign_devices(scenario.fleet, num_nodes, scenario.seed))
        if scenario.partition == "device"
        else None
    )
    return partition(
        data.y_train,
        num_nodes,
        scenario.partition,
        scenario.alpha,
        scenario.seed,
        MIN_SAMPLES["train"],
        groups=groups,
        writers=data.train_writers,
        affinity=scenario.affinity,
    )


def check_partition(scenario: Scenario, data: Dataset, num_nodes: int) -> None:
    """Refuse a partition that leaves a node without its training samples.

    A population the data can feed gets the partition its nodes will build
    (:func:`train_partition`), and every shard must hold ``MIN_SAMPLES["train"]``.
    A larger one draws shards per device, each of exactly that size by
    construction (:func:`drawn_shard`), so only its scheme is checked
    (:func:`check_population`).

    Raises
    ------
    DataError
        Naming the keys to change (``partition``, ``alpha``, ``num-nodes``) and
        what works.
    """
    num_samples = len(data.y_train)
    if not fits(num_samples, num_nodes, "train"):
        check_population(num_samples, num_nodes, scenario.partition, scenario.dataset)
        return
    least = MIN_SAMPLES["train"]
    where = (
        f"partition {scenario.partition!r} of {scenario.dataset!r} "
        f"({num_samples} training samples) for num-nodes={num_nodes}"
    )
    try:
        shards = train_partition(scenario, data, num_nodes)
    except ValueError as err:
        if scenario.partition != "dirichlet":
            raise DataError(f"{where}: {err}") from None
        raise DataError(
            f"{where} with alpha={scenario.alpha:g} leaves a node fewer than {least} "
            f"samples in every draw; {_dirichlet_remedy(scenario, data, num_nodes)}"
        ) from None
    short = sum(len(shard) < least for shard in shards)
    if short:
        raise DataError(
            f"{where} leaves {short} of {num_nodes} nodes fewer than {least} samples; "
            "lower num-nodes or use partition 'iid'"
        )


def _dirichlet_remedy(scenario: Scenario, data: Dataset, num_nodes: int) -> str:
    """What fixes a Dirichlet partition that starves a node: the default alpha,
    when larger and it works, else fewer nodes or ``iid``."""
    default = Scenario.alpha
    if scenario.alpha < default:
        try:
            train_partition(replace(scenario, alpha=default), data, num_nodes)
        except ValueError:
            pass
        else:
            return (
                f"raise alpha (alpha={default:g} works here), lower num-nodes or "
                "use partition 'iid'"
            )
    return "lower num-nodes or use partition 'iid'"


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


POPULATION_BYTES_PER_NODE = 440
"""Bytes one node of a population holds whether sampled or not (its ``SimNode``,
node id, device draw); measured: peak memory of ``flowerbed sim`` grows by 433 B
per node between 400,000 and 1,600,000 nodes (cohorts of 16, LeNet on digits)."""
TASK_BYTES_PER_MODEL = 3
"""Model-sized buffers one train task of a round holds (its reply's arrays, their
serialised copy, the message); measured: LeNet (85.5 kB) on digits costs ~287 kB
per node-task at 2,000 and 8,000 nodes."""
TASK_OVERHEAD_BYTES = 32 * 1024
"""Bytes one train task holds besides the model-sized buffers (context, records)."""
MODEL_BYTES_BOUND = 12 * 2**20
"""At least the bytes of every model on every dataset (the largest, MobileNetV2 on
CIFAR-10, is 8.9 MB; a test checks): a run that fits with models this large fits
without building its model, so checking it needs no torch."""


def population_bytes(num_nodes: int) -> int:
    """Memory a population holds before any node is sampled."""
    return num_nodes * POPULATION_BYTES_PER_NODE


def task_bytes(model_bytes: int) -> int:
    """Memory one train task of a round holds."""
    return TASK_BYTES_PER_MODEL * model_bytes + TASK_OVERHEAD_BYTES


def cohort_bytes(num_nodes: int, fraction_train: float, model_bytes: int) -> int:
    """Memory a round's train tasks hold: every sampled node's reply waits in
    memory until the round (or its virtual time) reaches it."""
    return math.ceil(fraction_train * num_nodes) * task_bytes(model_bytes)


def run_bytes(num_nodes: int, fraction_train: float, model_bytes: int) -> int:
    """Memory a run's population and one round's train tasks hold together."""
    return population_bytes(num_nodes) + cohort_bytes(
        num_nodes, fraction_train, model_bytes
    )


def check_memory(
    num_nodes: int, fraction_train: float, model_bytes: int, available: int
) -> None:
    """Refuse a population and round that cannot fit in ``available`` bytes.

    ``num-nodes`` is named when the population leaves no room for even one train
    task (with the largest population that fits at this ``fraction-train``), else
    the round's size (:func:`check_cohort_memory`, in what the population leaves).

    Raises
    ------
    DataError
        Naming the keys to change, the estimate and the memory available.
    """
    held = population_bytes(num_nodes)
    if held + task_bytes(model_bytes) <= available:
        check_cohort_memory(num_nodes, fraction_train, model_bytes, available, held)
        return
    per_node = POPULATION_BYTES_PER_NODE + fraction_train * task_bytes(model_bytes)
    most = int(available / per_node)
    while most > 0 and run_bytes(most, fraction_train, model_bytes) > available:
        most -= 1
    raise DataError(
        f"num-nodes={num_nodes}: a population of {num_nodes} nodes holds about "
        f"{held / 2**30:.1f} GiB ({POPULATION_BYTES_PER_NODE} B per node), more than "
        f"the {available / 2**30:.1f} GiB of memory available; use num-nodes <= "
        f"{most} at fraction-train={fraction_train:g}"
    )


def check_cohort_memory(
    num_nodes: int,
    fraction_train: float,
    model_bytes: int,
    available: int,
    held: int = 0,
) -> None:
    """Refuse a round whose train tasks cannot fit in ``available`` bytes, of which
    ``held`` already hold the population.

    Raises
    ------
    DataError
        Naming the round's size, the estimate and the largest cohort that fits.
    """
    need = cohort_bytes(num_nodes, fraction_train, model_bytes)
    free = available - held
    if need <= free:
        return
    cohort = math.ceil(fraction_train * num_nodes)
    per_task = task_bytes(model_bytes)
    beside = (
        f" beside the {held / 2**30:.1f} GiB its {num_nodes} nodes hold" if held else ""
    )
    raise DataError(
        f"num-nodes={num_nodes} with fraction-train={fraction_train:g}: a round of "
        f"{cohort} train tasks holds about {need / 2**30:.1f} GiB "
        f"({per_task / 1024:.0f} KiB each for a {model_bytes / 1024:.0f} KiB model), "
        f"more than the {free / 2**30:.1f} GiB of memory available{beside}; sample "
        f"at most {free // per_task} nodes per round (lower num-nodes or "
        "fraction-train)"
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
