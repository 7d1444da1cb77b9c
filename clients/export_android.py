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
import hashlib
import importlib
import math
import os
import sys
from dataclasses import dataclass, field
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
from flowerbed.models import build_model, group_norm, he_init
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
    if name not in EXPORT_MODELS:
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


def replace_batchnorm(model: nn.Module) -> list[str]:
    """Replace every BatchNorm1d/2d/3d of ``model`` by a GroupNorm, in place.

    Batch norm keeps running statistics (buffers) that a phone program cannot carry
    as trainable state, and with the few samples a phone trains on per step its batch
    statistics are noise; group norm normalises each sample on its own (Wu & He,
    ECCV 2018) and has the same ``weight`` and ``bias`` parameters under the same
    names, which are copied. The running statistics are dropped. Call it on the
    ServerApp's model too, so the arrays Flower sends are the program's parameters.

    Returns the names of the layers replaced.
    """
    replaced = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.modules.batchnorm._BatchNorm):
                norm = group_norm(child.num_features, child.affine, child.eps)
                if child.affine:
                    with torch.no_grad():
                        norm.weight.copy_(child.weight)
                        norm.bias.copy_(child.bias)
                setattr(module, child_name, norm)
                replaced.append(f"{name}.{child_name}" if name else child_name)
    return replaced


def _check_exportable(model: nn.Module) -> None:
    """Every ``state_dict`` entry must be a float32 parameter (what phones exchange)."""
    buffers = [name for name, _ in model.named_buffers()]
    if buffers:
        raise ValueError(
            f"model has buffers {buffers}: a phone program exchanges parameters "
            "only; replace batch norm by group norm (replace_batchnorm, the default "
            "of export-android) or remove the running state"
        )
    wrong = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
    if wrong:
        raise ValueError(f"parameters {wrong} are not float32")


def _decompose_pool_backward(joint: Any) -> Any:
    """Replace ``max_pool2d_with_indices_backward`` by PyTorch's decomposition of it.

    ExecuTorch's portable kernel for that op does not zero its output (see the
    module docstring); the decomposition scatter-adds into a fresh zero tensor.
    PyTorch's decomposition declines to run in deterministic-algorithms mode, so the
    mode is lifted for the call and restored after it. A graph without the op is
    returned as it is (decomposing a large graph costs tens of seconds).
    """
    from torch._decomp import decomposition_table

    pool_backward = torch.ops.aten.max_pool2d_with_indices_backward.default
    if not any(node.target == pool_backward for node in joint.graph.nodes):
        return joint
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


class ExportError(RuntimeError):
    """The program was built but does not run in ExecuTorch's runtime (e.g. an
    operator without a kernel); nothing is written."""


@dataclass(frozen=True)
class ExportedProgram:
    """A training program that was loaded and stepped once in ExecuTorch's runtime."""

    data: bytes
    """The ``.pte`` bytes."""
    parameters: list[tuple[str, tuple[int, ...]]]
    """Parameter names and shapes in the program's own order (its gradients' order)."""
    executorch_version: str
    """Version of the ExecuTorch that exported it: the oldest runtime that loads it."""
    check_loss: float
    """Loss of the verification step in ExecuTorch's runtime."""
    torch_loss: float | None
    """Loss of the same step in torch (None when the model has active dropout)."""
    replaced_batchnorm: list[str] = field(default_factory=list)
    """BatchNorm layers replaced by GroupNorm before export."""

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    def metadata(
        self, model_name: str, dataset: str, shape: InputShape, max_batch_size: int
    ) -> dict[str, Any]:
        """The ``<program>.pte.json`` the gateway serves it with (see
        :mod:`flowerbed.clients.bridge.programs`)."""
        return {
            "model": model_name,
            "dataset": dataset,
            "input": [shape.in_channels, shape.image_size, shape.image_size],
            "num_classes": shape.num_classes,
            "method": METHOD_NAME,
            "max_batch_size": max_batch_size,
            "parameters": [{"name": n, "shape": list(s)} for n, s in self.parameters],
            "sha256": self.sha256,
            "bytes": len(self.data),
            "executorch": self.executorch_version,
            "min_runtime": self.executorch_version,
            "replaced_batchnorm": self.replaced_batchnorm,
        }


def _has_active_dropout(model: nn.Module) -> bool:
    return any(
        isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0
        for m in model.modules()
    )


def load_program(pte: bytes) -> Any:
    """``pte`` loaded into ExecuTorch's Python training runtime.

    The returned module reads ``pte`` in place: keep the bytes alive as long as it.
    """
    from executorch.extension.training import (
        _load_for_executorch_for_training_from_buffer,
    )

    return _load_for_executorch_for_training_from_buffer(pte)


def _verify(
    pte: bytes,
    model: nn.Module,
    example: tuple[torch.Tensor, torch.Tensor],
    names: list[str],
) -> tuple[float, float | None]:
    """Load ``pte`` and run one forward/backward step in ExecuTorch's runtime.

    Raises :class:`ExportError` if it does not load or run (a missing kernel such as
    ``aten::avg_pool2d_backward`` shows here, not on the phone), if its gradients
    are not named as ``names``, or if its loss differs from torch's on the same
    batch (rel. 1e-3; skipped for models with active dropout).
    """
    try:
        module = load_program(pte)
        loss = float(module.forward_backward(METHOD_NAME, example)[0])
        grads = list(module.named_gradients())
    except Exception as err:  # the runtime raises RuntimeError, or worse, for a bad op
        raise ExportError(
            f"the exported program does not run in ExecuTorch's runtime: {err}; the "
            "model likely uses an operator (or its backward) without a portable "
            "kernel; replace that layer (e.g. AvgPool2d by AdaptiveAvgPool2d(1) or a "
            "strided convolution)"
        ) from err
    if sorted(grads) != sorted(names):
        raise ExportError(
            f"the runtime's gradients {grads} are not the parameters {names}"
        )
    if _has_active_dropout(model):
        if not math.isfinite(loss) and all(
            bool(torch.isfinite(p).all()) for p in model.parameters()
        ):
            raise ExportError(f"the verification step's loss is {loss}")
        return loss, None
    with torch.no_grad():
        reference = float(F.cross_entropy(model(example[0]), example[1]))
    # Weights written in on purpose may be NaN or infinite: then so is torch's loss.
    same = loss == reference or (math.isnan(loss) and math.isnan(reference))
    if not same and not abs(loss - reference) <= 1e-3 * max(1.0, abs(reference)):
        raise ExportError(
            f"the program's loss {loss:.6f} differs from torch's {reference:.6f} on "
            "the same batch; the program computes something else than the model"
        )
    return loss, reference


def export_training_program(
    model: nn.Module,
    shape: InputShape,
    *,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    batchnorm: str = "groupnorm",
) -> ExportedProgram:
    """Export ``model`` with its cross-entropy loss as an ExecuTorch training program.

    The program is then loaded and stepped once in ExecuTorch's Python runtime on a
    fixed batch, and its loss compared with torch's: an export reports success only
    for a program that runs.

    Parameters
    ----------
    model : torch.nn.Module
        A float32 model mapping ``[batch, C, H, W]`` images to ``[batch, classes]``
        logits. Its current weights become the program's initial weights. With
        ``batchnorm="groupnorm"`` its BatchNorm layers are replaced in place by
        GroupNorm (:func:`replace_batchnorm`); otherwise the model is not modified.
    shape : InputShape
        Sample shape and number of classes.
    max_batch_size : int, default DEFAULT_MAX_BATCH_SIZE
        Largest batch the program accepts (at least 2); any batch from 1 to this
        size works, and memory is planned for this size.
    batchnorm : {"groupnorm", "refuse"}, default "groupnorm"
        What to do with BatchNorm layers.

    Returns
    -------
    ExportedProgram
        The ``.pte`` bytes and its parameters in the program's own order. Its method
        :data:`METHOD_NAME` takes float32 images ``[batch, C, H, W]`` and int64 labels
        ``[batch]`` and returns the mean loss, the logits, then one gradient and one
        parameter per model parameter.

    Raises
    ------
    ImportError
        If ExecuTorch is not installed (the message gives the install command).
    ValueError
        If the model has buffers (other than replaced batch norm) or non-float32
        parameters, ``max_batch_size < 2``, an unknown ``batchnorm`` choice, or the
        program's parameters are not the model's.
    ExportError
        If the program does not run in ExecuTorch's runtime or computes another
        loss than torch.
    """
    if max_batch_size < 2:
        raise ValueError(f"max_batch_size must be >= 2, got {max_batch_size}")
    if batchnorm not in ("groupnorm", "refuse"):
        raise ValueError(
            f"batchnorm must be 'groupnorm' or 'refuse', got {batchnorm!r}"
        )
    replaced = replace_batchnorm(model) if batchnorm == "groupnorm" else []
    _check_exportable(model)
    try:
        from executorch.exir import to_edge
    except ImportError as err:
        raise ImportError(
            f"export-android needs ExecuTorch, which is not installed ({err}); "
            f"install it with: {EXECUTORCH_INSTALL}"
        ) from err
    from importlib.metadata import version

    from torch.export import Dim, export
    from torch.export.experimental import _export_forward_backward
    from torch.export.graph_signature import OutputKind
    from torch.nn.attention import SDPBackend, sdpa_kernel

    program = _with_cross_entropy(model)
    batch = min(max_batch_size, 8)
    example = (
        torch.zeros(batch, shape.in_channels, shape.image_size, shape.image_size),
        torch.zeros(batch, dtype=torch.int64),
    )
    size = Dim("batch", min=1, max=max_batch_size)
    # Attention in its plain math form: the fused CPU kernels' backward ops have no
    # ExecuTorch kernels (and are not core ATen).
    with sdpa_kernel(SDPBackend.MATH):
        exported = export(
            program, example, dynamic_shapes=({0: size}, {0: size}), strict=False
        )
        joint = _export_forward_backward(exported, joint_loss_index=0)
    joint = _decompose_pool_backward(joint)
    # The program's own order: the order of its gradient outputs.
    names = [
        spec.target
        for spec in joint.graph_signature.output_specs
        if spec.kind == OutputKind.GRADIENT_TO_PARAMETER
    ]
    params = dict(model.named_parameters())
    if sorted(names) != sorted(params):
        raise ValueError(
            f"program parameters {sorted(names)} differ from the model's "
            f"{sorted(params)}"
        )
    try:
        data = bytes(to_edge(joint).to_executorch().buffer)
    except Exception as err:  # exir raises its own verifier and lowering errors
        raise ExportError(
            f"the model cannot be lowered to an ExecuTorch program: {err}"
        ) from err
    generator = torch.Generator().manual_seed(0)
    check = (
        torch.randn(
            2,
            shape.in_channels,
            shape.image_size,
            shape.image_size,
            generator=generator,
        ),
        torch.randint(0, shape.num_classes, (2,), generator=generator),
    )
    loss, reference = _verify(data, model, check, names)
    return ExportedProgram(
        data=data,
        parameters=[(n, tuple(params[n].shape)) for n in names],
        executorch_version=version("executorch"),
        check_loss=loss,
        torch_loss=reference,
        replaced_batchnorm=replaced,
    )


def resolve_model(
    spec: str, dataset: str, *, hidden: int = DEFAULT_HIDDEN
) -> tuple[nn.Module, InputShape]:
    """A model by zoo name, or a user's own as ``module:attr``.

    ``module:attr`` imports ``module`` (the current directory is searched first) and
    takes ``attr`` (dots reach nested attributes): an ``nn.Module`` instance is used
    as it is; anything else callable is called as a model factory with
    ``(in_channels, image_size, num_classes)`` of the dataset, like the zoo's.

    Raises ``ValueError`` naming what could not be imported or used.
    """
    if ":" not in spec:
        return build_export_model(spec, dataset, hidden=hidden)
    check_dataset_name(dataset)
    shape = DATASET_SHAPES[dataset]
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"--model {spec!r}: a user model is given as module:attr")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except ImportError as err:
        raise ValueError(
            f"--model {spec!r}: cannot import {module_name}: {err}"
        ) from err
    except AttributeError as err:
        raise ValueError(f"--model {spec!r}: {module_name} has no {attr}") from err
    if not isinstance(obj, nn.Module):
        if not callable(obj):
            raise ValueError(f"--model {spec!r} is neither an nn.Module nor callable")
        try:
            obj = obj(shape.in_channels, shape.image_size, shape.num_classes)
        except TypeError as err:
            raise ValueError(
                f"--model {spec!r}: a model factory takes (in_channels, image_size, "
                f"num_classes): {err}"
            ) from err
    if not isinstance(obj, nn.Module):
        raise ValueError(
            f"--model {spec!r} returned {type(obj).__name__}, not an nn.Module"
        )
    return obj, shape


@dataclass(frozen=True)
class StepProfile:
    """Seconds per training step of a program in ExecuTorch's runtime and in torch."""

    batch_size: int
    executorch_s: float
    """Median seconds per forward/backward step in ExecuTorch's portable runtime."""
    torch_s: float
    """Median seconds per forward/backward step of the same model in torch (eager)."""
    executorch_cpu_s: float
    """Median CPU seconds (all threads of this process) per ExecuTorch step: less
    sensitive than wall time to other load on the machine."""
    torch_cpu_s: float
    """Median CPU seconds per torch step (torch may use several threads)."""
    rss_growth_bytes: int
    """Growth of this process's resident memory while loading and stepping it."""

    @property
    def ratio(self) -> float:
        """ExecuTorch seconds per torch second."""
        return self.executorch_s / self.torch_s


def _rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def profile_program(
    program: ExportedProgram,
    model: nn.Module,
    shape: InputShape,
    batch_size: int,
    steps: int = 3,
) -> StepProfile:
    """Time ``steps`` training steps (after one warm-up) in both runtimes, same batch.

    Both run on this machine's CPU: the ratio carries over to a phone better than
    the seconds do (a phone core is typically 2-4x slower than a laptop core).
    """
    import statistics
    import time

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(
        batch_size,
        shape.in_channels,
        shape.image_size,
        shape.image_size,
        generator=generator,
    )
    y = torch.randint(0, shape.num_classes, (batch_size,), generator=generator)
    before = _rss_bytes()
    module = load_program(program.data)
    et, et_cpu = [], []
    for _ in range(steps + 1):
        start, cpu = time.perf_counter(), time.process_time()
        module.forward_backward(METHOD_NAME, (x, y))
        et.append(time.perf_counter() - start)
        et_cpu.append(time.process_time() - cpu)
    growth = max(0, _rss_bytes() - before)
    reference = copy.deepcopy(model)
    eager, eager_cpu = [], []
    for _ in range(steps + 1):
        start, cpu = time.perf_counter(), time.process_time()
        reference.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        eager.append(time.perf_counter() - start)
        eager_cpu.append(time.process_time() - cpu)
    return StepProfile(
        batch_size,
        statistics.median(et[1:]),
        statistics.median(eager[1:]),
        statistics.median(et_cpu[1:]),
        statistics.median(eager_cpu[1:]),
        growth,
    )
