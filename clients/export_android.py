"""``flowerbed export-android``: a flowerbed model as an ExecuTorch training program.

Phones train on-device with ExecuTorch's training runtime
(``org.pytorch.executorch.training.TrainingModule`` and ``SGD``). That runtime runs a
*joint* program: one method that takes a batch and returns the loss, the logits, the
gradient of every parameter and the parameters themselves. This module builds that
program from a flowerbed torch model:

1. the model is given a forward that ends in its loss (mean cross-entropy over the
   batch, the loss of :func:`flowerbed.clients.training.train_steps`), returning
   ``(loss, logits)``; the loss must be the first output, which the runtime
   differentiates;
2. ``torch.export.export`` captures it with a dynamic batch dimension,
   ``torch.export.experimental._export_forward_backward`` adds the backward pass,
   and ``executorch.exir.to_edge(...).to_executorch()`` lowers it to a ``.pte``.

The names contract: the program names each parameter by its key in the model's
``state_dict`` (for example ``features.0.weight``), which is also its name in the
Flower ``ArrayRecord`` the gateway relays, so the phone loads the global model into the
program by name and sends its update back under the same names. To keep the names
free of a wrapper prefix, the loss is added by giving a shallow copy of the model a
subclass of its own class (same parameter objects, new ``forward``), not by nesting
the model inside a wrapper module.

One kernel is avoided on purpose: ExecuTorch's portable
``max_pool2d_with_indices_backward`` adds into its output without zeroing it first, so
every Conv2d -> MaxPool2d model gets gradients polluted by stale memory (pytorch/
executorch issue #21686; the kernel in executorch 1.5.1 still has it). The export
replaces that op by PyTorch's own decomposition of it (a ``scatter_add`` into a zero
tensor, from ``torch._decomp``), so the ``.pte`` is correct on any runtime version.

ExecuTorch is imported only inside the export, so ``import flowerbed`` never needs it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flowerbed.clients.export_android_cli import (
    DEFAULT_HIDDEN,
    DEFAULT_MAX_BATCH_SIZE,
    EXPORT_MODELS,
)
from flowerbed.data import check_dataset_name
from flowerbed.models import MODELS, build_model, he_init
from torch import nn
from torch.nn import functional as F

METHOD_NAME = "forward"
"""The program's joint method: ``forward(images, labels) -> loss, logits, ...``."""


EXECUTORCH_INSTALL = (
    "pip install --no-deps executorch==1.5.1 && "
    "pip install flatbuffers pyyaml ruamel.yaml packaging numpy tabulate"
)


@dataclass(frozen=True)
class InputShape:
    """Shape of one sample and the number of classes of a dataset."""

    in_channels: int
    image_size: int
    num_classes: int


DATASET_SHAPES: dict[str, InputShape] = {
    "digits": InputShape(1, 8, 10),
    "mnist": InputShape(1, 28, 10),
    "cifar10": InputShape(3, 32, 10),
}
"""Sample shapes of :data:`flowerbed.data.DATASETS` (fixed by each dataset's format),
so a program can be exported without the dataset's files at hand."""


class SoftmaxRegression(nn.Module):
    """Multinomial logistic regression on the flattened image: one layer ``fc``."""

    def __init__(self, in_features: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(in_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(x, 1))


class MLP(nn.Module):
    """One hidden ReLU layer on the flattened image: layers ``fc1`` and ``fc2``."""

    def __init__(self, in_features: int, hidden: int, num_classes: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


def build_export_model(
    name: str, dataset: str, *, hidden: int = DEFAULT_HIDDEN
) -> tuple[nn.Module, InputShape]:
    """Build a model by name for a dataset's sample shape.

    Parameters
    ----------
    name : str
        One of :data:`EXPORT_MODELS`: a zoo model (``lenet``, ``mobilenet``) or a
        phone-trainer model (``mlp``, ``softmax``).
    dataset : str
        One of :data:`flowerbed.data.DATASETS`; fixes the input shape and classes.
    hidden : int, default DEFAULT_HIDDEN
        Hidden width of ``mlp``; ignored by the other models.

    Returns
    -------
    tuple of (torch.nn.Module, InputShape)
        The model, He-initialised like every flowerbed model
        (:func:`flowerbed.models.he_init`, under the current torch RNG state), and
        the sample shape it takes.

    Raises
    ------
    ValueError
        For an unknown model or dataset name (the message lists the valid choices)
        or a non-positive ``hidden``.
    """
    check_dataset_name(dataset)
    shape = DATASET_SHAPES[dataset]
    in_features = shape.in_channels * shape.image_size * shape.image_size
    if name == "softmax":
        return he_init(SoftmaxRegression(in_features, shape.num_classes)), shape
    if name == "mlp":
        if hidden < 1:
            raise ValueError(f"hidden must be >= 1, got {hidden}")
        return he_init(MLP(in_features, hidden, shape.num_classes)), shape
    if name not in MODELS:
        raise ValueError(
            f"unknown model {name!r}; valid choices: {', '.join(EXPORT_MODELS)}"
        )
    model = build_model(name, shape.in_channels, shape.image_size, shape.num_classes)
    return model, shape


def load_arrays(model: nn.Module, path: str | Path) -> None:
    """Load named float32 arrays from an ``.npz`` file into ``model``'s parameters.

    The file holds one array per ``state_dict`` key, saved under that key (for
    example ``np.savez(path, **{k: v.numpy() for k, v in sd.items()})``). Values are
    copied bit for bit.

    Raises
    ------
    ValueError
        If the file is missing or unreadable, or its names, shapes or dtypes differ
        from the model's (the message names the offending arrays).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"arrays file {path} not found")
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {key: npz[key] for key in npz.files}
    except (OSError, ValueError) as err:
        raise ValueError(f"arrays file {path} is not a readable .npz: {err}") from err
    state = model.state_dict()
    missing = [k for k in state if k not in arrays]
    extra = [k for k in arrays if k not in state]
    if missing or extra:
        raise ValueError(
            f"arrays in {path} do not match the model's names: missing "
            f"{missing or 'none'}, unexpected {extra or 'none'}; expected exactly "
            f"{list(state)}"
        )
    for key, value in state.items():
        array = arrays[key]
        if array.dtype != np.float32:
            raise ValueError(f"array {key!r} in {path} is {array.dtype}, not float32")
        if tuple(array.shape) != tuple(value.shape):
            raise ValueError(
                f"array {key!r} in {path} has shape {tuple(array.shape)}, "
                f"the model expects {tuple(value.shape)}"
            )
    model.load_state_dict({k: torch.from_numpy(arrays[k].copy()) for k in state})


def _with_cross_entropy(model: nn.Module) -> nn.Module:
    """Shallow copy of ``model`` with forward ``(images, labels) -> (loss, logits)``.

    The copy shares the model's parameter objects and submodules, and its class is a
    subclass of the model's own, so every parameter keeps its ``state_dict`` name
    (a wrapper module would prefix them all). The logits are detached: only the loss
    is differentiated.
    """
    base = type(model)

    def forward(self: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> Any:
        logits = base.forward(self, images)
        return F.cross_entropy(logits, labels), logits.detach()

    with_loss = copy.copy(model)
    with_loss.__class__ = type(
        f"{base.__name__}WithLoss", (base,), {"forward": forward}
    )
    return with_loss


def _check_exportable(model: nn.Module) -> None:
    """Every ``state_dict`` entry must be a float32 parameter (what phones exchange)."""
    buffers = [name for name, _ in model.named_buffers()]
    if buffers:
        raise ValueError(
            f"model has buffers {buffers}: a phone program exchanges parameters "
            "only; use a model without batch norm or other running state"
        )
    wrong = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
    if wrong:
        raise ValueError(f"parameters {wrong} are not float32")


def _decompose_pool_backward(joint: Any) -> Any:
    """Replace ``max_pool2d_with_indices_backward`` by PyTorch's decomposition of it.

    ExecuTorch's portable kernel for that op does not zero its output (see the
    module docstring); the decomposition scatter-adds into a fresh zero tensor.
    PyTorch's decomposition declines to run in deterministic-algorithms mode, so the
    mode is lifted for the call and restored after it.
    """
    from torch._decomp import decomposition_table

    pool_backward = torch.ops.aten.max_pool2d_with_indices_backward.default
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        joint = joint.run_decompositions(
            {pool_backward: decomposition_table[pool_backward]}
        )
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    if any(node.target == pool_backward for node in joint.graph.nodes):
        raise RuntimeError(
            "max_pool2d_with_indices_backward survived its decomposition; the "
            "program would train on corrupted gradients"
        )
    return joint


def export_training_program(
    model: nn.Module,
    shape: InputShape,
    *,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
) -> bytes:
    """Export ``model`` with its cross-entropy loss as an ExecuTorch training program.

    Parameters
    ----------
    model : torch.nn.Module
        A float32 model mapping ``[batch, C, H, W]`` images to ``[batch, classes]``
        logits, with parameters only (no buffers). Its current weights become the
        program's initial weights; the model itself is not modified.
    shape : InputShape
        Sample shape and number of classes.
    max_batch_size : int, default DEFAULT_MAX_BATCH_SIZE
        Largest batch the program accepts (at least 2); any batch from 1 to this
        size works, and memory is planned for this size.

    Returns
    -------
    bytes
        The ``.pte`` program. Its method :data:`METHOD_NAME` takes float32 images
        ``[batch, C, H, W]`` and int64 labels ``[batch]`` and returns the mean loss,
        the logits, then one gradient and one parameter per ``state_dict`` key.

    Raises
    ------
    ImportError
        If ExecuTorch is not installed (the message gives the install command).
    ValueError
        If the model has buffers or non-float32 parameters, ``max_batch_size < 2``,
        or the program's parameter names differ from the model's ``state_dict``.
    """
    if max_batch_size < 2:
        raise ValueError(f"max_batch_size must be >= 2, got {max_batch_size}")
    _check_exportable(model)
    try:
        from executorch.exir import to_edge
    except ImportError as err:
        raise ImportError(
            f"export-android needs ExecuTorch, which is not installed ({err}); "
            f"install it with: {EXECUTORCH_INSTALL}"
        ) from err
    from torch.export import Dim, export
    from torch.export.experimental import _export_forward_backward
    from torch.export.graph_signature import OutputKind

    program = _with_cross_entropy(model)
    batch = min(max_batch_size, 8)
    example = (
        torch.zeros(batch, shape.in_channels, shape.image_size, shape.image_size),
        torch.zeros(batch, dtype=torch.int64),
    )
    size = Dim("batch", min=1, max=max_batch_size)
    exported = export(
        program, example, dynamic_shapes=({0: size}, {0: size}), strict=True
    )
    joint = _export_forward_backward(exported, joint_loss_index=0)
    joint = _decompose_pool_backward(joint)
    names = [
        spec.target
        for spec in joint.graph_signature.output_specs
        if spec.kind == OutputKind.GRADIENT_TO_PARAMETER
    ]
    if names != list(model.state_dict()):
        raise ValueError(
            f"program parameter names {names} differ from the model's state_dict "
            f"keys {list(model.state_dict())}"
        )
    return bytes(to_edge(joint).to_executorch().buffer)
