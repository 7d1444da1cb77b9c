"""Model zoo shared by simulation, board clients and the Android export.

Two families, chosen by the run config key ``model``:

- ``lenet``: LeNet-5-style CNN (LeCun et al., "Gradient-based learning applied to
  document recognition", Proc. IEEE 1998), two 5x5 conv + pool stages, three FC layers.
- ``mobilenet``: MobileNet-v1-style CNN of depthwise-separable blocks (Howard et al.,
  "MobileNets", arXiv:1704.04861, Sec. 3.1), narrow enough for phones. No batch
  norm: with a handful of samples per node, batch statistics are noise, and
  federated averaging of running statistics is ill-defined.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

ModelFactory = Callable[[int, int, int], nn.Module]
"""(in_channels, image_size, num_classes) -> model."""


class LeNet(nn.Module):
    """LeNet-5-style CNN; padding keeps it valid for 8x8 digits up to 32x32 CIFAR."""

    def __init__(self, in_channels: int, image_size: int, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 6, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        side = image_size // 4
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(16 * side * side, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def _separable(in_ch: int, out_ch: int, stride: int) -> nn.Sequential:
    """Depthwise 3x3 then pointwise 1x1 convolution (MobileNets, Sec. 3.1)."""
    return nn.Sequential(
        nn.Conv2d(in_ch, in_ch, 3, stride=stride, padding=1, groups=in_ch),
        nn.ReLU6(),
        nn.Conv2d(in_ch, out_ch, 1),
        nn.ReLU6(),
    )


class MobileNetV1Small(nn.Module):
    """MobileNet-v1-style network: a 3x3 stem then depthwise-separable blocks."""

    def __init__(self, in_channels: int, image_size: int, num_classes: int) -> None:
        super().__init__()
        del image_size  # global average pooling makes the head size-independent
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 16, 3, padding=1),
            nn.ReLU6(),
            _separable(16, 32, 1),
            _separable(32, 64, 2),
            _separable(64, 64, 1),
            _separable(64, 128, 2),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(128, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


MODELS: dict[str, ModelFactory] = {"lenet": LeNet, "mobilenet": MobileNetV1Small}
REFERENCE_MODEL = ("lenet", 1, 28, 10)
"""The model device profiles quote per-sample seconds for: LeNet on 28x28x1 MNIST."""


def he_init(model: nn.Module) -> nn.Module:
    """He (Kaiming) normal weights and zero biases for conv and linear layers.

    He et al., "Delving deep into rectifiers", ICCV 2015, Sec. 2.2: variance 2/fan_in
    keeps activations from vanishing through ReLU layers. PyTorch's default
    (uniform with a=sqrt(5)) leaves these small networks stuck at chance for
    hundreds of plain-SGD steps.
    """
    for mod in model.modules():
        if isinstance(mod, (nn.Conv2d, nn.Linear)):
            nn.init.kaiming_normal_(mod.weight, nonlinearity="relu")
            if mod.bias is not None:
                nn.init.zeros_(mod.bias)
    return model


def build_model(
    name: str, in_channels: int, image_size: int, num_classes: int
) -> nn.Module:
    """Build a He-initialised model by name; unknown names list the choices."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}; valid choices: {', '.join(sorted(MODELS))}"
        ) from None
    return he_init(factory(in_channels, image_size, num_classes))


def forward_macs(model: nn.Module, in_channels: int, image_size: int) -> int:
    """Multiply-accumulates of one forward pass on one sample (conv and linear).

    Conv: out_elements x (in_channels / groups) x kernel_h x kernel_w;
    linear: in_features x out_features (the standard count, e.g. MobileNets Sec. 3.1).
    """
    total = 0

    def conv_hook(mod: nn.Module, _inp: object, out: torch.Tensor) -> None:
        nonlocal total
        assert isinstance(mod, nn.Conv2d)
        kh, kw = mod.kernel_size
        total += out.numel() * (mod.in_channels // mod.groups) * kh * kw

    def linear_hook(mod: nn.Module, _inp: object, _out: torch.Tensor) -> None:
        nonlocal total
        assert isinstance(mod, nn.Linear)
        total += mod.in_features * mod.out_features

    handles = []
    for mod in model.modules():
        if isinstance(mod, nn.Conv2d):
            handles.append(mod.register_forward_hook(conv_hook))
        elif isinstance(mod, nn.Linear):
            handles.append(mod.register_forward_hook(linear_hook))
    try:
        with torch.no_grad():
            model(torch.zeros(1, in_channels, image_size, image_size))
    finally:
        for handle in handles:
            handle.remove()
    return total


def cost_factor(
    name: str, in_channels: int, image_size: int, num_classes: int
) -> float:
    """Training cost of a model per sample relative to :data:`REFERENCE_MODEL`.

    Training (forward + backward) costs about 3x the forward MACs for both, so the
    ratio of forward MACs is the ratio of training time (Kaplan et al. 2020,
    "Scaling laws", Sec. 2.1 use the same 3x rule).
    """
    ref_name, ref_c, ref_s, ref_k = REFERENCE_MODEL
    ref = forward_macs(build_model(ref_name, ref_c, ref_s, ref_k), ref_c, ref_s)
    this = forward_macs(
        build_model(name, in_channels, image_size, num_classes), in_channels, image_size
    )
    return this / ref


def model_num_bytes(model: nn.Module) -> int:
    """Bytes of the model's state (what travels down and up each round)."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())
