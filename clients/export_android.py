"""``flowerbed export-android``: a flowerbed model as an ExecuTorch training program.

Phones train on-device with ExecuTorch's training runtime
(``org.pytorch.executorch.training.TrainingModule`` and ``SGD``). That runtime runs a
*joint* program: one method that takes a batch and returns the loss, the logits, the
gradient of every parameter and the parameters themselves. This module builds that
program from a flowerbed torch model:

1. a copy of the model is given a forward that ends in its loss (mean cross-entropy
   over the batch, the loss of :func:`flowerbed.clients.training.train_steps`),
   returning ``(loss, logits, *state)``; the loss must be the first output, which
   the runtime differentiates; ``state`` is the batch-norm running statistics,
   inputs and outputs of every step (:mod:`.export_android_norm`);
2. ``torch.export.export`` captures it with a dynamic batch dimension,
   ``torch.export.experimental._export_forward_backward`` adds the backward pass;
3. a second method, :data:`EVALUATE_METHOD`, evaluates without a backward pass: a
   function of the batch, the parameters and the state;
4. ``executorch.exir.to_edge({...}).to_executorch()`` lowers both to one ``.pte``,
   which is loaded and stepped once in ExecuTorch's Python runtime before success.

The names contract: the program names each parameter by its key in the model's
``state_dict`` (for example ``features.0.weight``), which is also its name in the
Flower ``ArrayRecord`` the gateway relays, so the phone loads the global model into the
program by name and sends its update back under the same names. To keep the names
free of a wrapper prefix, the loss is added by giving a copy of the model a
subclass of its own class (same parameter names, new ``forward``), not by nesting
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
from flowerbed.clients.export_android_norm import (
    BatchNormMode,
    PrimitiveBatchNorm,
    feed_state,
    prepare_batchnorm,
    state_names,
    to_primitive_batchnorm,
    updated_state,
)
from flowerbed.clients.export_android_norm import (
    replace_batchnorm as replace_batchnorm,
)
from flowerbed.data import check_dataset_name
from flowerbed.models import build_model, he_init
from torch import nn
from torch.nn import functional as F

METHOD_NAME = "forward"
"""The program's training (joint) method: ``forward(images, labels, *state) -> loss,
logits, *new_state, *gradients, *parameters``."""
EVALUATE_METHOD = "evaluate"
"""The program's evaluation method, without a backward pass:
``evaluate(images, labels, *parameters, *state) -> loss, logits``."""


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


def _training_program(model: nn.Module, layers: list[PrimitiveBatchNorm]) -> nn.Module:
    """``model`` (a private copy) turned into the training method, in place.

    Its forward becomes ``(images, labels, *state) -> (loss, logits, *new_state)``:
    the mean cross-entropy first (the output the runtime differentiates), the logits
    detached, then the running statistics of ``layers`` updated by this batch. Its
    class becomes a subclass of its own, so every parameter keeps its ``state_dict``
    name (a wrapper module would prefix them all).
    """
    base = type(model)

    def forward(
        self: nn.Module, images: torch.Tensor, labels: torch.Tensor, *state: Any
    ) -> Any:
        feed_state(layers, state, evaluating=False)
        logits = base.forward(self, images)
        loss = F.cross_entropy(logits, labels)
        return (loss, logits.detach(), *updated_state(layers))

    model.__class__ = type(f"{base.__name__}Training", (base,), {"forward": forward})
    return model.train()


class _Evaluation(nn.Module):
    """The evaluation method: a stateless function of the batch and the weights.

    ``forward(images, labels, *parameters, *state) -> (loss, logits)`` runs the model
    in evaluation mode (dropout off, batch norm on the running statistics) with the
    parameters and state it is given, through :func:`torch.func.functional_call`. The
    program therefore stores no second copy of the weights (the lowering drops the
    unused ones), and the phone evaluates whatever weights it holds without a
    backward pass.
    """

    def __init__(
        self, model: nn.Module, names: list[str], layers: list[PrimitiveBatchNorm]
    ) -> None:
        super().__init__()
        self.model = model.eval()
        self.names = names
        self.layers = layers

    def forward(self, images: torch.Tensor, labels: torch.Tensor, *tensors: Any) -> Any:
        count = len(self.names)
        feed_state(self.layers, tensors[count:], evaluating=True)
        weights = dict(zip(self.names, tensors[:count], strict=True))
        logits = torch.func.functional_call(self.model, weights, (images,))
        return F.cross_entropy(logits, labels), logits


def _varargs(names: list[str]) -> tuple[tuple[None, ...], ...]:
    """``dynamic_shapes`` of a ``*args`` of fixed-shape tensors (none when empty)."""
    return (tuple(None for _ in names),) if names else ()


def _check_exportable(model: nn.Module, state: list[str]) -> None:
    """Every ``state_dict`` entry must be a float32 parameter or, for batch norm
    trained as it is, a float32 running statistic (what phones exchange)."""
    buffers = [name for name, _ in model.named_buffers() if name not in state]
    if buffers:
        raise ValueError(
            f"model has buffers {buffers}: a phone program exchanges parameters and "
            "batch-norm running statistics only; remove the other running state"
        )
    wrong = [n for n, p in model.named_parameters() if p.dtype != torch.float32]
    wrong += [n for n, b in model.named_buffers() if b.dtype != torch.float32]
    if wrong:
        raise ValueError(f"parameters or statistics {wrong} are not float32")


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


CHECK_BATCH_NORM_BATCH = 12
"""Samples in the verification step of a program that trains batch norm (at most
``max_batch_size``); other programs are checked on 2."""


class ExportError(RuntimeError):
    """The program was built but does not run in ExecuTorch's runtime (e.g. an
    operator without a kernel); nothing is written."""


Layout = list[tuple[str, tuple[int, ...]]]


@dataclass(frozen=True)
class ExportedProgram:
    """A training program that was loaded and stepped once in ExecuTorch's runtime."""

    data: bytes
    """The ``.pte`` bytes."""
    parameters: Layout
    """Parameter names and shapes in the program's own order (its gradients' order)."""
    executorch_version: str
    """Version of the ExecuTorch that exported it: the oldest runtime that loads it."""
    check_loss: float
    """Loss of the verification step in ExecuTorch's runtime."""
    torch_loss: float | None
    """Loss of the same step in torch (None when the model has active dropout)."""
    check_eval_loss: float = math.nan
    """Loss of the evaluation method on the verification batch."""
    torch_eval_loss: float = math.nan
    """Loss of the same batch in torch with the model in evaluation mode."""
    state: Layout = field(default_factory=list)
    """Running statistics the training method carries (batch norm trained as it is),
    in the program's order: its inputs and outputs after the batch."""
    batchnorm: str = "train"
    """How batch norm was handled (:data:`BATCHNORM_MODES`)."""
    batchnorm_layers: list[str] = field(default_factory=list)
    """BatchNorm layers trained as they are (``"train"``) or replaced by GroupNorm."""

    @property
    def replaced_batchnorm(self) -> list[str]:
        """BatchNorm layers replaced by GroupNorm before export."""
        return self.batchnorm_layers if self.batchnorm == "groupnorm" else []

    @property
    def min_batch_size(self) -> int:
        """Smallest training batch: 2 with batch statistics (one sample has no
        variance on a 1x1 feature map, where torch refuses it too), else 1."""
        return 2 if self.state else 1

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
            "evaluate_method": EVALUATE_METHOD,
            "min_batch_size": self.min_batch_size,
            "max_batch_size": max_batch_size,
            "parameters": [{"name": n, "shape": list(s)} for n, s in self.parameters],
            "state": [{"name": n, "shape": list(s)} for n, s in self.state],
            "sha256": self.sha256,
            "bytes": len(self.data),
            "executorch": self.executorch_version,
            "min_runtime": self.executorch_version,
            "batchnorm": self.batchnorm,
            "batchnorm_layers": self.batchnorm_layers,
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
    Its ``forward_backward(METHOD_NAME, (images, labels, *state))`` runs a training
    step; :func:`run_evaluation` runs the evaluation method.
    """
    from executorch.extension.training import (
        _load_for_executorch_for_training_from_buffer,
    )

    return _load_for_executorch_for_training_from_buffer(pte)


def run_evaluation(
    module: Any,
    parameters: list[torch.Tensor],
    images: torch.Tensor,
    labels: torch.Tensor,
    state: list[torch.Tensor] | tuple[torch.Tensor, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the evaluation method of a program loaded by :func:`load_program`.

    ``parameters`` and ``state`` are in the program's order (``<out>.json``). Returns
    the mean loss and the logits; no gradient is computed.
    """
    out = module.model.run_method(
        EVALUATE_METHOD, (images, labels, *parameters, *state)
    )
    return out[0], out[1]


def _close(got: float, want: float) -> bool:
    """Equal within 1e-3 relative (or both NaN: weights written in on purpose may be
    NaN or infinite, and then so is torch's loss)."""
    if got == want or (math.isnan(got) and math.isnan(want)):
        return True
    return abs(got - want) <= 1e-3 * max(1.0, abs(want))


def close_arrays(
    got: torch.Tensor,
    want: torch.Tensor,
    rel: float = 1e-3,
    scale: torch.Tensor | None = None,
) -> bool:
    """Whether ``got`` is ``want`` to ``rel`` in L2 over the whole array:
    ``||got - want|| <= rel * ||scale||`` (``scale`` defaults to ``want``), NaN where
    ``want`` has NaN.

    For batch-norm statistics the scale is the array's, not each element's, and a
    running mean's scale is the channels' standard deviation (``sqrt`` of the running
    variance): after a normalised layer and a bias-free convolution a channel's batch
    mean is zero up to float32 rounding, which another summation order in another
    runtime changes by far more than 1e-3 of itself, but not of the channel's spread.
    """
    if got.shape != want.shape:
        return False
    nan = torch.isnan(want)
    if not torch.equal(torch.isnan(got), nan):
        return False
    reference = want if scale is None else scale
    a, b = got[~nan].double(), want[~nan].double()
    norm = torch.linalg.vector_norm(reference[~nan].double())
    return bool(torch.linalg.vector_norm(a - b) <= rel * norm)


def _statistics_scale(name: str, statistics: dict[str, torch.Tensor]) -> torch.Tensor:
    """The scale :func:`close_arrays` judges batch-norm statistic ``name`` at: a
    running mean's is the square root of its layer's running variance."""
    if name.endswith(".running_mean"):
        variance = statistics[name.removesuffix("mean") + "var"]
        return variance.clamp(min=0).sqrt()
    return statistics[name]


def _verify(
    pte: bytes,
    model: nn.Module,
    example: tuple[torch.Tensor, torch.Tensor],
    names: list[str],
    state: list[str],
) -> tuple[float, float | None, float, float]:
    """Load ``pte``, run one training step and one evaluation in ExecuTorch's runtime.

    Raises :class:`ExportError` if it does not load or run (a missing kernel such as
    ``aten::avg_pool2d_backward`` shows here, not on the phone), if its gradients
    are not named as ``names``, or if its training loss (skipped for models with
    active dropout), its updated running statistics or its evaluation loss differ
    from torch's on the same batch (rel. 1e-3; for the statistics, in L2 over each
    array, a running mean in units of its channels' standard deviation:
    :func:`close_arrays`). Returns the runtime's and torch's
    training and evaluation losses.
    """
    buffers = dict(model.named_buffers())
    inputs = [buffers[n].detach().clone() for n in state]
    try:
        module = load_program(pte)
        outputs = module.forward_backward(METHOD_NAME, (*example, *inputs))
        loss = float(outputs[0])
        grads = list(module.named_gradients())
        params = module.named_parameters()
        eval_loss = float(
            run_evaluation(module, [params[n] for n in names], *example, inputs)[0]
        )
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
    reference = copy.deepcopy(model)
    with torch.no_grad():
        reference.eval()
        torch_eval = float(F.cross_entropy(reference(example[0]), example[1]))
        reference.train()
        torch_loss = float(F.cross_entropy(reference(example[0]), example[1]))
    if not _close(eval_loss, torch_eval):
        raise ExportError(
            f"the evaluation method's loss {eval_loss:.6f} differs from torch's "
            f"{torch_eval:.6f} (model.eval()) on the same batch"
        )
    trained = dict(reference.named_buffers())
    for name, got in zip(state, outputs[2:], strict=True):
        if not close_arrays(got, trained[name], scale=_statistics_scale(name, trained)):
            raise ExportError(
                f"the program's updated {name} differs from torch's by "
                f"{float((got - trained[name]).abs().max()):.3g} (max), more than "
                "1e-3 of its scale in L2 (a running mean's: the channels' standard "
                "deviation)"
            )
    if _has_active_dropout(model):
        if not math.isfinite(loss) and all(
            bool(torch.isfinite(p).all()) for p in model.parameters()
        ):
            raise ExportError(f"the verification step's loss is {loss}")
        return loss, None, eval_loss, torch_eval
    if not _close(loss, torch_loss):
        raise ExportError(
            f"the program's loss {loss:.6f} differs from torch's {torch_loss:.6f} on "
            "the same batch; the program computes something else than the model"
        )
    return loss, torch_loss, eval_loss, torch_eval


def export_training_program(
    model: nn.Module,
    shape: InputShape,
    *,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    batchnorm: BatchNormMode = "train",
    arrays: str | Path | None = None,
) -> ExportedProgram:
    """Export ``model`` with its cross-entropy loss as an ExecuTorch training program.

    The program is then loaded and stepped once in ExecuTorch's Python runtime on a
    fixed batch, and its losses compared with torch's: an export reports success only
    for a program that runs.

    Parameters
    ----------
    model : torch.nn.Module
        A float32 model mapping ``[batch, C, H, W]`` images to ``[batch, classes]``
        logits. Its current weights (and batch-norm statistics) become the program's
        initial ones. Its batch norm is prepared in place by
        :func:`prepare_batchnorm` (``"train"`` drops ``num_batches_tracked``,
        ``"groupnorm"`` replaces the layers); apply the same to the ServerApp's model.
    shape : InputShape
        Sample shape and number of classes.
    max_batch_size : int, default DEFAULT_MAX_BATCH_SIZE
        Largest batch the program accepts (at least 2); any batch from
        :attr:`ExportedProgram.min_batch_size` to this size works, and memory is
        planned for this size.
    batchnorm : {"train", "groupnorm", "refuse"}, default "train"
        What to do with BatchNorm layers (see :mod:`.export_android_norm`).
    arrays : path, optional
        An ``.npz`` of initial weights loaded (:func:`load_arrays`) after the batch
        norm is prepared, so it holds exactly what the phones exchange.

    Returns
    -------
    ExportedProgram
        The ``.pte`` bytes, its parameters and state in the program's own order. Its
        training method :data:`METHOD_NAME` takes float32 images ``[batch, C, H, W]``,
        int64 labels ``[batch]`` and the state, and returns the mean loss, the
        logits, the updated state, then one gradient and one parameter per model
        parameter. Its evaluation method :data:`EVALUATE_METHOD` takes images,
        labels, the parameters and the state and returns the mean loss and the logits.

    Raises
    ------
    ImportError
        If ExecuTorch is not installed (the message gives the install command).
    ValueError
        If the model has other buffers than batch-norm statistics, non-float32
        parameters, ``max_batch_size < 2``, an unknown ``batchnorm`` choice (or batch
        norm it cannot handle), an arrays file that does not fit, or the program's
        parameters are not the model's.
    ExportError
        If the program does not run in ExecuTorch's runtime or computes another
        loss than torch.
    """
    if max_batch_size < 2:
        raise ValueError(f"max_batch_size must be >= 2, got {max_batch_size}")
    layers = prepare_batchnorm(model, batchnorm)
    if arrays is not None:
        load_arrays(model, arrays)
    state = state_names(model) if batchnorm == "train" else []
    _check_exportable(model, state)
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

    buffers = dict(model.named_buffers())
    initial_state = tuple(buffers[n].detach().clone() for n in state)
    trainer = copy.deepcopy(model)
    program = _training_program(trainer, to_primitive_batchnorm(trainer))
    evaluator = copy.deepcopy(model)
    params = dict(model.named_parameters())
    batch = min(max_batch_size, 8)
    example = (
        torch.zeros(batch, shape.in_channels, shape.image_size, shape.image_size),
        torch.zeros(batch, dtype=torch.int64),
    )
    size = Dim("batch", min=2 if state else 1, max=max_batch_size)
    eval_size = Dim("eval_batch", min=1, max=max_batch_size)
    # Attention in its plain math form: the fused CPU kernels' backward ops have no
    # ExecuTorch kernels (and are not core ATen).
    with sdpa_kernel(SDPBackend.MATH):
        exported = export(
            program,
            (*example, *initial_state),
            dynamic_shapes=({0: size}, {0: size}, *_varargs(state)),
            strict=False,
        )
        joint = _export_forward_backward(exported, joint_loss_index=0)
    joint = _decompose_pool_backward(joint)
    # The program's own order: the order of its gradient outputs.
    names = [
        spec.target
        for spec in joint.graph_signature.output_specs
        if spec.kind == OutputKind.GRADIENT_TO_PARAMETER
    ]
    if sorted(names) != sorted(params):
        raise ValueError(
            f"program parameters {sorted(names)} differ from the model's "
            f"{sorted(params)}"
        )
    evaluation = _Evaluation(evaluator, names, to_primitive_batchnorm(evaluator))
    weights = tuple(params[n].detach() for n in names)
    with sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        evaluate = export(
            evaluation,
            (*example, *weights, *initial_state),
            dynamic_shapes=(
                {0: eval_size},
                {0: eval_size},
                tuple(None for _ in (*names, *state)),
            ),
            strict=False,
        )
    try:
        methods = {METHOD_NAME: joint, EVALUATE_METHOD: evaluate}
        data = bytes(to_edge(methods).to_executorch().buffer)
    except Exception as err:  # exir raises its own verifier and lowering errors
        raise ExportError(
            f"the model cannot be lowered to an ExecuTorch program: {err}"
        ) from err
    # Another batch size than the export's example (the batch dimension is dynamic).
    # Batch statistics of two samples are ill-conditioned on the 1x1 feature maps of
    # a deep network (variance of two nearly equal values): MobileNetV2's loss then
    # differs from float64 torch's by ~1e-3 in float32 in either runtime, and by
    # ~3e-6 with 8 or 12 samples; so a program that trains batch norm is checked on
    # up to 12.
    check_size = 2 if not state else min(max_batch_size, CHECK_BATCH_NORM_BATCH)
    generator = torch.Generator().manual_seed(0)
    check = (
        torch.randn(
            check_size,
            shape.in_channels,
            shape.image_size,
            shape.image_size,
            generator=generator,
        ),
        torch.randint(0, shape.num_classes, (check_size,), generator=generator),
    )
    loss, reference, eval_loss, torch_eval = _verify(data, model, check, names, state)
    return ExportedProgram(
        data=data,
        parameters=[(n, tuple(params[n].shape)) for n in names],
        executorch_version=version("executorch"),
        check_loss=loss,
        torch_loss=reference,
        check_eval_loss=eval_loss,
        torch_eval_loss=torch_eval,
        state=[(n, tuple(buffers[n].shape)) for n in state],
        batchnorm=batchnorm,
        batchnorm_layers=layers,
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
    evaluate_s: float = math.nan
    """Median seconds per batch of the program's evaluation method (no backward)."""
    evaluate_cpu_s: float = math.nan
    """Median CPU seconds per batch of the evaluation method."""

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
    """Time ``steps`` training steps (after one warm-up) in both runtimes, same batch,
    and as many batches of the program's evaluation method.

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
    buffers = dict(model.named_buffers())
    state = [buffers[n].detach().clone() for n, _ in program.state]
    before = _rss_bytes()
    module = load_program(program.data)
    et, et_cpu = [], []
    for _ in range(steps + 1):
        start, cpu = time.perf_counter(), time.process_time()
        module.forward_backward(METHOD_NAME, (x, y, *state))
        et.append(time.perf_counter() - start)
        et_cpu.append(time.process_time() - cpu)
    params = module.named_parameters()
    weights = [params[n] for n, _ in program.parameters]
    ev, ev_cpu = [], []
    for _ in range(steps + 1):
        start, cpu = time.perf_counter(), time.process_time()
        run_evaluation(module, weights, x, y, state)
        ev.append(time.perf_counter() - start)
        ev_cpu.append(time.process_time() - cpu)
    growth = max(0, _rss_bytes() - before)
    reference = copy.deepcopy(model).train()
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
        statistics.median(ev[1:]),
        statistics.median(ev_cpu[1:]),
    )
