"""Data of a job that spans devices: named datasets and the batch of each step.

The member holding the first stage reads the data; every other member only sees
activations (and the last stage the labels, which the first stage broadcasts at
the segment start). The batch of global step ``t`` is a function of the job's
seed and ``t`` alone (:func:`batch_indices`), so a segment retried after a loss
repeats exactly the batches it lost, and single-process training of the same
steps sees the same data (the tests compare the two).

Built-in datasets (offline): ``digits`` (scikit-learn's 8x8 digits, 1 channel),
``digits32`` (the same, each pixel repeated 4x4: 32x32 for the VGG-style CNN),
``har`` (generated human-activity windows, 9 x 128, see
:func:`flowerbed.data.make_har`), ``mnist1d`` (35,000 generated 1 x 40 signals,
:func:`flowerbed.data.make_mnist1d`: large batches of many members);
``mnist`` and ``cifar10`` from a data folder.
"""

from __future__ import annotations

import functools

import numpy as np
from flowerbed.data import DataError, Dataset, load_dataset, make_har

JOB_DATASETS = ("digits", "digits32", "har", "mnist1d", "mnist", "cifar10")


@functools.lru_cache(maxsize=4)
def load_job_dataset(name: str, data_dir: str = "") -> Dataset:
    """A job dataset by name (see the module docstring); unknown names list choices."""
    if name == "digits32":
        base = load_dataset("digits")
        up = np.ones((1, 1, 4, 4), dtype=np.float32)
        return Dataset(
            "digits32",
            np.kron(base.x_train, up),
            base.y_train,
            np.kron(base.x_test, up),
            base.y_test,
        )
    if name == "har":
        return make_har()
    if name in ("digits", "mnist1d", "mnist", "cifar10"):
        return load_dataset(name, data_dir)
    raise DataError(
        f"unknown job dataset {name!r}; valid choices: {', '.join(JOB_DATASETS)}"
    )


def batch_indices(
    seed: int, step: int, num_samples: int, batch_size: int
) -> np.ndarray:
    """Sample indices of global step ``step``'s batch (without replacement).

    ``numpy.random.default_rng((seed, step))``: a separate stream per step, so any
    step's batch is known without drawing the ones before it.
    """
    if num_samples < batch_size:
        raise DataError(f"batch of {batch_size} from only {num_samples} samples")
    rng = np.random.default_rng((seed, step))
    return rng.choice(num_samples, size=batch_size, replace=False)
