"""Model zoo shared by simulation, board clients and the Android export.

Image models, chosen by the run config key ``model``:

- ``lenet``: LeNet-5-style CNN (LeCun et al., "Gradient-based learning applied to
  document recognition", Proc. IEEE 1998), two 5x5 conv + pool stages, three FC layers.
- ``mobilenet``: MobileNet-v1-style CNN of depthwise-separable blocks (Howard et al.,
  "MobileNets", arXiv:1704.04861, Sec. 3.1), narrow enough for phones (18.6 K
  parameters). No batch norm: with a handful of samples per node, batch statistics
  are noise, and federated averaging of running statistics is ill-defined.
- ``mobilenetv2``: the real MobileNetV2 (Sandler et al., CVPR 2018; 2.2 M
  parameters) with group norm in place of batch norm, for the same reasons;
  :func:`mobilenetv2_batchnorm` builds it with the paper's batch norm (for phones:
  ``flowerbed export-android --model flowerbed.models:mobilenetv2_batchnorm``).

Models for 1-D data (N x C x L, ``mnist1d`` and ``synthetic``):

- ``cnn1d``: three 1-D convolutions and a linear head, the CNN family Greydanus
  ("Scaling down deep learning", 2020, Sec. 3) trains on MNIST-1D.
- ``mlp``: two hidden layers of 100 ReLU units (the same paper's MLP baseline).
- ``logreg``: multinomial logistic regression, FedProx's model for its Synthetic
  data (Li et al., MLSys 2020, Sec. 5.1).

``CHARGED_MODELS`` are published architectures whose byte size and compute the
virtual clock can charge in place of the small model actually trained.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

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


GROUPS = 32
"""GroupNorm's default group count (Wu & He, "Group Normalization", ECCV 2018,
Sec. 3.1)."""
CHANNELS_PER_GROUP = 16
"""Fewest channels per group: Wu & He's Table 3 (b) fixes 16 channels per group as
the other good setting; with fewer (G = 32 on a 16- or 32-channel layer is one or two
channels per group, instance norm) a small network trained here on digits lost half
its accuracy (docs/export-android.md, "Batch norm")."""


def group_norm(channels: int, affine: bool = True, eps: float = 1e-5) -> nn.GroupNorm:
    """GroupNorm over ``channels``: :data:`GROUPS` groups, but at least
    :data:`CHANNELS_PER_GROUP` channels in each, and a group count that divides
    ``channels``: gcd(channels, min(32, max(1, channels // 16)))."""
    groups = math.gcd(channels, min(GROUPS, max(1, channels // CHANNELS_PER_GROUP)))
    return nn.GroupNorm(groups, channels, eps=eps, affine=affine)


class InvertedResidual(nn.Module):
    """MobileNetV2's block (Sandler et al., CVPR 2018, Sec. 3.3 and Table 1): a 1x1
    expansion by ``t``, a 3x3 depthwise convolution, a linear 1x1 projection, and a
    skip connection when the shape allows."""

    def __init__(
        self,
        in_ch: int,
        out_ch: int,
        stride: int,
        t: int,
        norm: Callable[[int], nn.Module] = group_norm,
    ) -> None:
        super().__init__()
        hidden = in_ch * t
        layers: list[nn.Module] = []
        if t != 1:
            layers += [nn.Conv2d(in_ch, hidden, 1, bias=False), norm(hidden)]
            layers.append(nn.ReLU6())
        layers += [
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
            norm(hidden),
            nn.ReLU6(),
            nn.Conv2d(hidden, out_ch, 1, bias=False),
            norm(out_ch),
        ]
        self.conv = nn.Sequential(*layers)
        self.residual = stride == 1 and in_ch == out_ch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.residual else self.conv(x)


class MobileNetV2(nn.Module):
    """MobileNetV2 at width 1.0 (Sandler et al., CVPR 2018, Table 2): 17 inverted
    residual blocks, 2.2 M parameters with 10 classes.

    Group norm instead of batch norm: a phone trains on a few samples per step, where
    batch statistics are noise, and a training program cannot carry running
    statistics; group norm (Wu & He, ECCV 2018) normalises each sample alone. For
    inputs of 32 pixels or less (CIFAR, MNIST, digits) the stem and the first
    stride-2 stage keep their resolution, the usual adaptation to small images.
    ``norm`` builds each normalisation layer from its channel count
    (``nn.BatchNorm2d`` for the paper's network).
    """

    # (expansion t, channels c, repeats n, stride s) of the paper's Table 2.
    STAGES: tuple[tuple[int, int, int, int], ...] = (
        (1, 16, 1, 1),
        (6, 24, 2, 2),
        (6, 32, 3, 2),
        (6, 64, 4, 2),
        (6, 96, 3, 1),
        (6, 160, 3, 2),
        (6, 320, 1, 1),
    )

    def __init__(
        self,
        in_channels: int,
        image_size: int,
        num_classes: int,
        norm: Callable[[int], nn.Module] = group_norm,
    ) -> None:
        super().__init__()
        small = image_size <= 32
        layers: list[nn.Module] = [
            nn.Conv2d(in_channels, 32, 3, 1 if small else 2, 1, bias=False),
            norm(32),
            nn.ReLU6(),
        ]
        channels = 32
        for index, (t, c, n, s) in enumerate(self.STAGES):
            stride = 1 if small and index == 1 else s
            for i in range(n):
                block = InvertedResidual(channels, c, stride if i == 0 else 1, t, norm)
                layers.append(block)
                channels = c
        layers += [
            nn.Conv2d(channels, 1280, 1, bias=False),
            norm(1280),
            nn.ReLU6(),
            nn.AdaptiveAvgPool2d(1),
        ]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(1280, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def mobilenetv2_batchnorm(
    in_channels: int, image_size: int, num_classes: int
) -> MobileNetV2:
    """:class:`MobileNetV2` with batch norm, as Sandler et al. train it,
    He-initialised like the zoo's models (:func:`he_init`)."""
    model = MobileNetV2(in_channels, image_size, num_classes, norm=nn.BatchNorm2d)
    he_init(model)
    return model


class ConvNet1D(nn.Module):
    """Three 1-D convolutions (25 channels, kernel 5, stride 2) and a linear head."""

    input_dims = 1

    def __init__(self, in_channels: int, length: int, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv1d(in_channels, 25, 5, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv1d(25, 25, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv1d(25, 25, 3, stride=2, padding=1),
            nn.ReLU(),
        )
        with torch.no_grad():
            flat = self.features(torch.zeros(1, in_channels, length)).numel()
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(flat, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class MLP1D(nn.Module):
    """Two hidden layers of 100 ReLU units over the flattened sequence."""

    input_dims = 1

    def __init__(self, in_channels: int, length: int, num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_channels * length, 100),
            nn.ReLU(),
            nn.Linear(100, 100),
            nn.ReLU(),
            nn.Linear(100, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class LogReg1D(nn.Module):
    """Multinomial logistic regression over the flattened sequence."""

    input_dims = 1

    def __init__(self, in_channels: int, length: int, num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(in_channels * length, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


MODELS: dict[str, ModelFactory] = {
    "lenet": LeNet,
    "mobilenet": MobileNetV1Small,
    "mobilenetv2": MobileNetV2,
    "cnn1d": ConvNet1D,
    "mlp": MLP1D,
    "logreg": LogReg1D,
}


def model_dims(name: str) -> int:
    """Spatial dimensions a model takes (2: images, 1: sequences)."""
    return int(getattr(MODELS[name], "input_dims", 2))


CHARGED_MODELS: dict[str, tuple[int, int, str]] = {
    "mobilenet-v1": (
        4_200_000,
        569_000_000,
        "1.0 MobileNet-224: 4.2 M parameters, 569 M multiply-adds per 224x224 image "
        "(Howard et al., arXiv:1704.04861, Table 8)",
    ),
    "mobilenet-v1-0.5-160": (
        1_320_000,
        76_000_000,
        "0.5 MobileNet-160: 1.32 M parameters, 76 M multiply-adds per 160x160 image "
        "(Howard et al., arXiv:1704.04861, Table 9)",
    ),
    "resnet-50": (
        25_600_000,
        3_800_000_000,
        "ResNet-50: 25.6 M parameters, 3.8 G multiply-adds per 224x224 image "
        "(He et al., CVPR 2016, Table 1, whose 'FLOPs' count multiply-adds)",
    ),
    "resnet-18": (
        11_700_000,
        1_800_000_000,
        "ResNet-18: 11.7 M parameters, 1.8 G multiply-adds per 224x224 image "
        "(He et al., CVPR 2016, Table 1; parameters as torchvision's resnet18)",
    ),
}
"""Published architectures the virtual clock can charge instead of the trained
model: name -> (parameters, forward multiply-adds per sample, source). Bytes are
4 x parameters (float32)."""


def charged_costs(name: str) -> tuple[float, int]:
    """(cost factor relative to :data:`REFERENCE_MODEL`, bytes) of a charged model.

    cost factor = forward MACs / the reference's forward MACs (training is ~3x the
    forward pass for both, see :func:`cost_factor`); bytes = 4 x parameters.
    """
    try:
        params, macs, _ = CHARGED_MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown charged model {name!r}; valid choices: "
            f"{', '.join(CHARGED_MODELS)}"
        ) from None
    ref_name, ref_c, ref_s, ref_k = REFERENCE_MODEL
    ref = forward_macs(build_model(ref_name, ref_c, ref_s, ref_k), ref_c, ref_s)
    return macs / ref, 4 * params


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
        if isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Linear)):
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


def count_macs(module: nn.Module, x: torch.Tensor) -> int:
    """Multiply-accumulates of ``module(x)`` for the whole input batch.

    Conv (1-D and 2-D): output elements x (in_channels / groups) x kernel size;
    linear: output elements x in_features (the standard count, e.g. MobileNets
    Sec. 3.1). Other layers (activations, pooling, normalisation) count 0.
    """
    total = 0

    def conv_hook(mod: nn.Module, _inp: object, out: torch.Tensor) -> None:
        nonlocal total
        assert isinstance(mod, nn.Conv1d | nn.Conv2d)
        kernel = math.prod(mod.kernel_size)
        total += out.numel() * (mod.in_channels // mod.groups) * kernel

    def linear_hook(mod: nn.Module, _inp: object, out: torch.Tensor) -> None:
        nonlocal total
        assert isinstance(mod, nn.Linear)
        total += out.numel() * mod.in_features

    handles = []
    for mod in module.modules():
        if isinstance(mod, nn.Conv1d | nn.Conv2d):
            handles.append(mod.register_forward_hook(conv_hook))
        elif isinstance(mod, nn.Linear):
            handles.append(mod.register_forward_hook(linear_hook))
    try:
        with torch.no_grad():
            module(x)
    finally:
        for handle in handles:
            handle.remove()
    return total


def forward_macs(model: nn.Module, in_channels: int, image_size: int) -> int:
    """Multiply-accumulates of one forward pass on one sample (:func:`count_macs`).

    A 1-D model (``input_dims = 1``) is fed a sequence of length ``image_size``.
    """
    dims = int(getattr(model, "input_dims", 2))
    return count_macs(model, torch.zeros(1, in_channels, *([image_size] * dims)))


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


# ---------------------------------------------------------------------------------
# Layered models for pipeline training (flowerbed.parallel)
# ---------------------------------------------------------------------------------
#
# A pipeline cuts a model between its top-level layers, so these are
# ``nn.Sequential`` whose children are the units a stage may hold. Each child
# takes one tensor and returns one tensor; anything that must stay together
# (a residual block, a conv with its activation and pooling) is one child.


def _conv_block(in_ch: int, out_ch: int, pool: bool) -> nn.Sequential:
    parts: list[nn.Module] = [nn.Conv2d(in_ch, out_ch, 3, padding=1), nn.ReLU()]
    if pool:
        parts.append(nn.MaxPool2d(2))
    return nn.Sequential(*parts)


def vgg_small(
    in_channels: int = 3, image_size: int = 32, num_classes: int = 10, width: int = 16
) -> nn.Sequential:
    """VGG-style CNN for 32x32 images: 8 conv layers in 4 stages, 2 FC layers.

    Simonyan and Zisserman, "Very deep convolutional networks", ICLR 2015: stacks
    of 3x3 convolutions, channels doubling after each 2x2 max-pool; here widths
    ``w, w | 2w, 2w | 4w, 4w | 8w, 8w`` (w = ``width``) and a 2-layer classifier,
    11 top-level layers (conv blocks keep their ReLU and pool). No batch norm (see
    the module docstring).
    """
    if image_size % 16:
        raise ValueError(
            f"vgg_small needs an image size divisible by 16, got {image_size}"
        )
    w = width
    plan = [
        (in_channels, w, False),
        (w, w, True),
        (w, 2 * w, False),
        (2 * w, 2 * w, True),
    ]
    plan += [
        (2 * w, 4 * w, False),
        (4 * w, 4 * w, True),
        (4 * w, 8 * w, False),
        (8 * w, 8 * w, True),
    ]
    side = image_size // 16
    return nn.Sequential(
        *(_conv_block(i, o, p) for i, o, p in plan),
        nn.Flatten(),
        nn.Sequential(nn.Linear(8 * w * side * side, 16 * w), nn.ReLU()),
        nn.Linear(16 * w, num_classes),
    )


def har_cnn(
    in_channels: int = 9, length: int = 128, num_classes: int = 6, width: int = 32
) -> nn.Sequential:
    """1-D CNN for inertial time series (human-activity recognition).

    Six 1-D convolution blocks (kernel 5, ReLU, stride-2 pooling after every
    second), global average pooling and a linear head, in the manner of the 1-D
    CNNs for HAR (Ignatov, "Real-time human activity recognition from accelerometer
    data using CNNs", Applied Soft Computing 2018), deep enough to pipeline: 8
    top-level layers.
    """
    if length % 8:
        raise ValueError(f"har_cnn needs a length divisible by 8, got {length}")
    w = width
    chans = [
        (in_channels, w),
        (w, w),
        (w, 2 * w),
        (2 * w, 2 * w),
        (2 * w, 4 * w),
        (4 * w, 4 * w),
    ]
    blocks: list[nn.Module] = []
    for index, (i, o) in enumerate(chans):
        parts: list[nn.Module] = [nn.Conv1d(i, o, 5, padding=2), nn.ReLU()]
        if index % 2 == 1:
            parts.append(nn.MaxPool1d(2))
        blocks.append(nn.Sequential(*parts))
    return nn.Sequential(
        *blocks,
        nn.Sequential(nn.AdaptiveAvgPool1d(1), nn.Flatten()),
        nn.Linear(4 * w, num_classes),
    )


def deep_mlp(
    in_features: int = 64, num_classes: int = 10, hidden: int = 64, depth: int = 6
) -> nn.Sequential:
    """A flatten layer, ``depth`` hidden linear+ReLU layers and a linear head.

    The cheapest model with enough layers to pipeline (tests, quick local runs).
    """
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for _ in range(depth):
        layers.append(nn.Sequential(nn.Linear(width, hidden), nn.ReLU()))
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def yolo_tiny(
    in_channels: int = 3,
    image_size: int = 416,
    num_classes: int = 20,
    width: int = 16,
    norm: str = "none",
) -> nn.Sequential:
    """A YOLOv2-tiny-style CNN with a classification head (fused-tile training).

    After darknet's yolov2-tiny (Redmon and Farhadi, "YOLO9000: Better, Faster,
    Stronger", CVPR 2017), the network Rama et al. (arXiv 2409.09083) train on
    Raspberry Pi clusters: six 3x3 conv + leaky-ReLU(0.1) layers, channels
    ``w, 2w, .., 32w`` with a 2x2 max-pool after each of the first five, then a
    weight-heavy 3x3 conv to ``64w`` channels at 1/32 of the input size (4.7 M
    parameters for ``w = 16``), and a head of a 1x1 conv to ``num_classes``,
    global average pooling and flatten (classification instead of the detection
    head, so offline labels train it). Conv and pool are separate top-level
    layers (the cuts a tile plan may group). ``norm``: ``"none"``, ``"batch"``
    (YOLOv2's) or ``"group"`` (8 groups) after each conv. 13 top-level layers.
    """
    if image_size % 32:
        raise ValueError(
            f"yolo_tiny needs an image size divisible by 32, got {image_size}"
        )
    norms: dict[str, Callable[[int], nn.Module]] = {
        "none": lambda c: nn.Identity(),
        "batch": nn.BatchNorm2d,
        "group": lambda c: nn.GroupNorm(min(8, c), c),
    }
    if norm not in norms:
        raise ValueError(f"norm {norm!r}; valid choices: {', '.join(norms)}")

    def block(i: int, o: int) -> nn.Sequential:
        return nn.Sequential(
            nn.Conv2d(i, o, 3, padding=1, bias=norm == "none"),
            norms[norm](o),
            nn.LeakyReLU(0.1),
        )

    w = width
    layers: list[nn.Module] = []
    channels = in_channels
    for k in range(5):
        layers += [block(channels, w << k), nn.MaxPool2d(2)]
        channels = w << k
    layers += [block(channels, 32 * w), block(32 * w, 64 * w)]
    layers.append(
        nn.Sequential(
            nn.Conv2d(64 * w, num_classes, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten()
        )
    )
    return nn.Sequential(*layers)


SEQUENTIAL_MODELS: dict[str, Callable[..., nn.Sequential]] = {
    "vgg": vgg_small,
    "har-cnn": har_cnn,
    "deep-mlp": deep_mlp,
    "yolo-tiny": yolo_tiny,
}
"""Layered models by name; ``build_sequential`` also takes ``"module:function"``."""


class ModelCutError(ValueError):
    """A model that cannot be cut into pipeline stages as asked."""


def build_named_module(
    name: str,
    args: Mapping[str, object] | None = None,
    seed: int | None = None,
    importer: Callable[[str], Callable[..., object]] | None = None,
    error: type[ValueError] = ValueError,
) -> nn.Module:
    """Any ``nn.Module``: a name from :data:`SEQUENTIAL_MODELS` or ``"pkg.mod:fn"``.

    ``fn(**args)`` builds it; conv and linear layers are He-initialised, from
    ``seed`` if given, so every process building the same spec gets the same
    weights. ``importer`` resolves a ``"pkg.mod:fn"`` name (default: import the
    module, take the attribute). An unknown name, arguments the factory refuses,
    or a factory that returns no ``nn.Module`` raise ``error``.
    """
    arguments = dict(args or {})
    if name in SEQUENTIAL_MODELS:
        factory: Callable[..., object] = SEQUENTIAL_MODELS[name]
    elif ":" in name:
        factory = (importer or _import_factory)(name)
    else:
        raise error(
            f"unknown model {name!r}; valid choices: "
            f"{', '.join(sorted(SEQUENTIAL_MODELS))}, or 'package.module:function'"
        )
    if seed is not None:
        torch.manual_seed(seed)
    try:
        model = factory(**arguments)
    except TypeError as err:
        raise error(
            f"model {name!r} does not accept arguments {arguments}: {err}"
        ) from err
    if not isinstance(model, nn.Module):
        raise error(
            f"model {name!r} returned a {type(model).__name__}, not an nn.Module"
        )
    return he_init(model)


def _import_factory(name: str) -> Callable[..., object]:
    import importlib

    module, _, attr = name.partition(":")
    try:
        factory: Callable[..., object] = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"model {name!r} cannot be imported: {err}") from err
    return factory


def build_sequential(
    name: str, args: Mapping[str, object] | None = None, seed: int | None = None
) -> nn.Sequential:
    """A layered model (:func:`build_named_module`) that a pipeline can cut.

    The model must be an ``nn.Sequential`` (raises :class:`ModelCutError`
    otherwise).
    """
    model = build_named_module(name, args, seed)
    if not isinstance(model, nn.Sequential):
        raise ModelCutError(
            f"model {name!r} is a {type(model).__name__}, not an nn.Sequential: a "
            "pipeline cuts between top-level layers, so wrap the model's parts in "
            "an nn.Sequential (keep each residual block whole as one layer)"
        )
    return model


def layer_shapes(model: nn.Sequential, sample: torch.Tensor) -> list[tuple[int, ...]]:
    """Shapes of the input and of every layer's output for ``sample`` (a batch).

    Entry ``i`` is the input of layer ``i``; the last is the model's output. Raises
    :class:`ModelCutError` naming the layer whose output is not a single tensor
    (such a layer cannot end a stage).
    """
    shapes = [tuple(sample.shape)]
    x = sample
    with torch.no_grad():
        for index, layer in enumerate(model):
            x = layer(x)
            if not isinstance(x, torch.Tensor):
                raise ModelCutError(
                    f"layer {index} ({type(layer).__name__}) returns a "
                    f"{type(x).__name__}, not one tensor: it cannot be a cut point; "
                    "merge it with the layer that consumes its outputs"
                )
            shapes.append(tuple(x.shape))
    return shapes
