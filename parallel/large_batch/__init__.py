"""Large-batch synchronous training (Goyal et al. 2017; LARS, You et al. 2017;
LAMB, You et al. 2020): every board holds the whole model and takes a share of
each global batch; one all-reduce per step.

- :mod:`~flowerbed.parallel.large_batch.recipe` — batch shares proportional to
  speed, the loss scale that makes unequal shares one large batch, the
  linear-scaling and warm-up schedule (pure).
- :mod:`~flowerbed.parallel.large_batch.optimizers` — momentum SGD, LARS and
  LAMB on named NumPy arrays (pure).
- :mod:`~flowerbed.parallel.large_batch.allreduce` — the member's side: the
  ``allreduce`` mode (DistributedDataParallel on gloo).

Importing this package imports no torch; the names the former module
``flowerbed.parallel.large_batch`` held resolve from
:mod:`~flowerbed.parallel.large_batch.recipe` with a :class:`DeprecationWarning`
for one release.
"""

from __future__ import annotations

from flowerbed.moved import moved_names

__getattr__ = moved_names(
    __name__,
    dict.fromkeys(
        ("LrSchedule", "batch_shares", "loss_scale", "share_bounds"),
        "flowerbed.parallel.large_batch.recipe",
    ),
)
