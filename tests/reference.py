"""Single-process training, the yardstick of the pipeline tests.

A synchronous pipeline (a flush per step) must end where plain SGD on one
process ends after the same steps on the same batches (the batch of global step
``t`` is :func:`flowerbed.parallel.job_data.batch_indices` of ``t``).
"""

from __future__ import annotations

import numpy as np
import torch
from flowerbed.models import build_sequential
from flowerbed.parallel.job_data import batch_indices, load_job_dataset


def single_process(
    model: str,
    args: dict,
    steps: int,
    batch: int,
    lr: float,
    momentum: float = 0.0,
    dataset: str = "digits",
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Weights after ``steps`` SGD steps of ``model`` built with ``seed``."""
    net = build_sequential(model, args, seed=seed)
    data = load_job_dataset(dataset)
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    for step in range(steps):
        idx = batch_indices(seed, step, len(data.y_train), batch)
        x, y = torch.from_numpy(data.x_train[idx]), torch.from_numpy(data.y_train[idx])
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return {k: v.numpy() for k, v in net.state_dict().items()}
