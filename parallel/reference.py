"""The single-device reference of a span job: what one process would have trained.

Every span job here is exact: a pipeline with a flush per step, large-batch
all-reduce and fused tiles all end where plain training of the same model on
one device ends after the same steps on the same batches (the batch of global
step ``t`` is :func:`~flowerbed.parallel.job_data.batch_indices` of the job's
seed and ``t``). :func:`single_device` computes that reference, so a user can
check a run themselves::

    from flowerbed.parallel import single_device

    job = strategy.reference_job()  # PipelineTraining, LargeBatchSync, TiledTraining
    result = strategy.start(grid, initial_arrays, num_rounds=3)
    expected = single_device(job, initial_arrays, steps=strategy.step)
    # result.arrays equals expected up to float32 rounding

It is a deliberately plain loop — build the model, load the weights, then per
step: the batch, the job's loss, backward, the optimiser at that step's rate —
that shares no code with the distributed members beyond the model, the data
and the optimiser definitions, so agreement means something.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .user_code import Training

SGD = "sgd"
"""Plain ``torch.optim.SGD`` (pipeline and tile jobs)."""
LARGE_BATCH = ("sgd-large-batch", "lars", "lamb")
"""Large-batch optimisers (:mod:`flowerbed.parallel.large_batch.optimizers`):
momentum SGD, LARS, LAMB on NumPy views of the weights."""
SYNTHETIC = "synthetic"
"""Tile jobs' timing dataset: images and labels drawn from ``(seed, step)``."""


@dataclass(frozen=True)
class ReferenceJob:
    """What defines a span job's training, as pure data (each span strategy's
    ``reference_job()`` fills it in).

    Attributes
    ----------
    model, model_args : str, dict
        The model by name (:func:`~flowerbed.parallel.user_code.build_module`).
    dataset : str
        A job dataset name, or ``"synthetic"`` (tile jobs).
    batch_size, seed : int
        Samples per step and the seed of the batch order.
    lr : float
        The learning rate (constant unless ``schedule`` is given).
    schedule : dict, optional
        A large-batch schedule
        (:meth:`~flowerbed.parallel.large_batch.recipe.LrSchedule.to_config`):
        step ``t``'s rate is ``LrSchedule.from_config(schedule).lr(t)``.
    optimizer : str
        ``"sgd"`` (``torch.optim.SGD``), or a large-batch kind (:data:`LARGE_BATCH`;
        ``"sgd-large-batch"`` is that module's momentum SGD).
    momentum, weight_decay, trust : float
        The optimiser's settings.
    training : Training
        The user's loss and optimiser factory, if any (the factory replaces
        ``optimizer``).
    input_shape, num_classes : tuple, int
        Sample shape and classes of ``"synthetic"`` data.
    eval_norm_layers : int
        Leading top-level layers whose batch norms run in eval mode (a tile job
        with ``norm="frozen"``: its front).
    layered : bool
        Build the model as the layered model a pipeline or tile job cuts
        (:func:`~flowerbed.parallel.user_code.build_layers`: its array names).
    """

    model: str
    model_args: Mapping[str, Any] = field(default_factory=dict)
    dataset: str = "digits"
    batch_size: int = 32
    seed: int = 0
    lr: float = 0.05
    schedule: Mapping[str, Any] | None = None
    optimizer: str = SGD
    momentum: float = 0.0
    weight_decay: float = 0.0
    trust: float = 0.001
    training: Training = field(default_factory=Training)
    input_shape: tuple[int, ...] = ()
    num_classes: int = 10
    eval_norm_layers: int = 0
    layered: bool = False

    def __post_init__(self) -> None:
        valid = (SGD, *LARGE_BATCH)
        if self.optimizer not in valid:
            raise ValueError(
                f"optimizer {self.optimizer!r}; valid choices: {', '.join(valid)}"
            )
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")

    def lr_at(self, step: int) -> float:
        """The learning rate of global step ``step``."""
        if self.schedule is None:
            return self.lr
        from .large_batch.recipe import LrSchedule

        return LrSchedule.from_config(dict(self.schedule)).lr(step)


def single_device(
    job: ReferenceJob,
    initial_arrays: Mapping[str, Any],
    steps: int,
    *,
    start_step: int = 0,
    data: tuple[np.ndarray, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """The weights after ``steps`` steps of ``job`` on one device, from
    ``initial_arrays`` (a ``state_dict``-like mapping or a Flower ``ArrayRecord``)
    at global step ``start_step``.

    ``data``: the training set ``(x, y)`` of a job whose dataset is ``"local"``
    (the first board's own data); otherwise the job's dataset is loaded. The
    optimiser starts without state, as the job's does at step 0. Raises
    ``ValueError`` naming what does not fit.
    """
    import torch
    from torch import nn

    from .job_data import batch_indices, load_job_dataset
    from .member import load_module_state
    from .user_code import build_layers, build_module

    if steps < 0 or start_step < 0:
        raise ValueError(
            f"steps and start_step must be >= 0, got {steps}, {start_step}"
        )
    build = build_layers if job.layered else build_module
    model: nn.Module = build(job.model, job.model_args, seed=job.seed)
    weights = {
        k: (v.numpy() if hasattr(v, "numpy") else np.asarray(v))
        for k, v in initial_arrays.items()
    }
    load_module_state(model, None, weights, strict=True)
    model.train()
    for index, layer in enumerate(model.children()):
        if index >= job.eval_norm_layers:
            break
        for module in layer.modules():
            if isinstance(module, nn.BatchNorm1d | nn.BatchNorm2d):
                module.eval()
    loss_fn = job.training.loss_fn()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = job.training.make_optimizer(
        params,
        job.lr_at(start_step),
        lambda ps: torch.optim.SGD(
            ps, lr=job.lr, momentum=job.momentum, weight_decay=job.weight_decay
        ),
    )
    large = None
    if not job.training.custom_optimizer and job.optimizer in LARGE_BATCH:
        from .large_batch.optimizers import LargeBatchOptimizer

        kind = "sgd" if job.optimizer == LARGE_BATCH[0] else job.optimizer
        large = LargeBatchOptimizer(
            kind,
            momentum=job.momentum,
            weight_decay=job.weight_decay,
            trust=job.trust,
        )
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    views = {n: p.detach().numpy() for n, p in named.items()}
    if data is None and job.dataset not in (SYNTHETIC, "local"):
        loaded = load_job_dataset(job.dataset)
        data = (loaded.x_train, loaded.y_train)
    if data is None and job.dataset == "local":
        raise ValueError("dataset 'local': pass the first board's data as data=(x, y)")
    for step in range(start_step, start_step + steps):
        if data is None:
            rng = np.random.default_rng((job.seed, step))
            x_np = rng.standard_normal(
                (job.batch_size, *job.input_shape), dtype=np.float32
            )
            y_np = rng.integers(0, job.num_classes, job.batch_size)
        else:
            idx = batch_indices(job.seed, step, len(data[1]), job.batch_size)
            x_np, y_np = data[0][idx], data[1][idx]
        x = torch.from_numpy(np.ascontiguousarray(x_np, dtype=np.float32))
        y = torch.from_numpy(np.asarray(y_np, dtype=np.int64))
        for p in params:
            p.grad = None
        loss_fn(model(x), y).backward()
        lr = job.lr_at(step)
        if large is not None:
            grads = {
                n: p.grad.numpy() if p.grad is not None else np.zeros_like(views[n])
                for n, p in named.items()
            }
            large.step(views, grads, lr)
        else:
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
