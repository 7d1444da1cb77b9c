"""Why MobileNetV2's gradients in ExecuTorch's runtime differ from torch's.

Reproduces docs/export-android.md, "How exact the gradients are": exports the paper's
MobileNetV2 (batch norm) for digits, takes one training step in ExecuTorch's Python
runtime on the first 12 training digits, and compares its gradients (relative L2 over
all parameters) with torch float32 and float64; then looks for ReLU6 inputs near a
kink (0 or 6) in float64 and forces the derivative of those, one at a time
(greedily, nearest first), keeping each that brings torch float64 closer to the
runtime. Run: ``python docs/scripts/mobilenetv2_relu6_kinks.py`` (5 CPU minutes).
"""

import copy

import torch
from flowerbed.clients.export_android import (
    DATASET_SHAPES,
    METHOD_NAME,
    export_training_program,
    load_program,
)
from flowerbed.data import load_dataset
from flowerbed.models import mobilenetv2_batchnorm
from torch import nn
from torch.nn import functional as F


class ForcedReLU6(nn.Module):
    """ReLU6 whose derivative can be flipped for chosen elements (``flip``)."""

    def __init__(self) -> None:
        super().__init__()
        self.flip: torch.Tensor | None = None
        self.inputs = torch.empty(0)

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        self.inputs = v.detach().clone()
        passes = (v > 0) & (v < 6)
        if self.flip is not None:
            passes = passes ^ self.flip
        return torch.where(passes, v, v.clamp(0, 6).detach())


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


torch.manual_seed(0)
model = mobilenetv2_batchnorm(1, 8, 10)
result = export_training_program(model, DATASET_SHAPES["digits"], max_batch_size=16)
names = [n for n, _ in result.parameters]
digits = load_dataset("digits")
x, y = torch.from_numpy(digits.x_train[:12]), torch.from_numpy(digits.y_train[:12])
module = load_program(result.data)
buffers = dict(model.named_buffers())
state = [buffers[n].clone() for n, _ in result.state]
module.forward_backward(METHOD_NAME, (x, y, *state))
runtime = torch.cat([module.named_gradients()[n].flatten() for n in names]).double()


def gradients(
    dtype: torch.dtype, flips: dict[int, torch.Tensor] | None = None
) -> tuple[torch.Tensor, list[ForcedReLU6], list[str]]:
    """All gradients of ``model`` in ``dtype`` on the batch, some derivatives forced."""
    reference = copy.deepcopy(model).to(dtype).train()
    activations, where = [], []
    for parent_name, parent in list(reference.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.ReLU6):
                forced = ForcedReLU6()
                setattr(parent, name, forced)
                activations.append(forced)
                where.append(f"{parent_name}.{name}")
    for index, flip in (flips or {}).items():
        activations[index].flip = flip
    F.cross_entropy(reference(x.to(dtype)), y).backward()
    params = dict(reference.named_parameters())
    grads = [params[n].grad.flatten() for n in names]  # type: ignore[union-attr]
    return torch.cat(grads).double(), activations, where


exact, activations, where = gradients(torch.float64)
single, _, _ = gradients(torch.float32)
print(f"runtime vs torch float64: {relative(runtime, exact):.3g}")
print(f"torch float32 vs torch float64: {relative(single, exact):.3g}")
near = []
for index, act in enumerate(activations):
    distance = torch.minimum(act.inputs.abs(), (act.inputs - 6).abs())
    for element in (distance < 1e-4).nonzero():
        near.append((float(distance[tuple(element)]), index, tuple(element.tolist())))
near.sort()
total = sum(a.inputs.numel() for a in activations)
within = sum(d < 1e-5 for d, _, _ in near)
print(f"{total} ReLU6 inputs; {within} within 1e-5 of a kink, {len(near)} within 1e-4")
chosen: dict[int, torch.Tensor] = {}
best = relative(runtime, exact)
for distance, index, element in near:
    trial = {k: v.clone() for k, v in chosen.items()}
    flip = trial.setdefault(
        index, torch.zeros_like(activations[index].inputs, dtype=torch.bool)
    )
    flip[element] = True
    forced, _, _ = gradients(torch.float64, trial)
    if relative(runtime, forced) < 0.9 * best:
        best, chosen = relative(runtime, forced), trial
        print(
            f"forcing {where[index]} {element} ({distance:.2g} from a kink): "
            f"runtime vs "
            f"torch float64 {best:.3g}",
            flush=True,
        )
count = sum(int(f.sum()) for f in chosen.values())
print(f"{count} forced derivatives leave the runtime {best:.3g} from torch float64")
