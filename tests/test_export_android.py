"""`flowerbed export-android`: flowerbed models as ExecuTorch training programs.

The programs are run with ExecuTorch's own Python runtime (the training module and
its SGD), the same runtime the phone app drives through Java.
"""

from __future__ import annotations

import copy
import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flowerbed.cli import main as cli_main
from flowerbed.clients.export_android import (
    DATASET_SHAPES,
    DEFAULT_MAX_BATCH_SIZE,
    EXPORT_MODELS,
    METHOD_NAME,
    ExportError,
    build_export_model,
    export_training_program,
    load_arrays,
)
from flowerbed.data import load_dataset
from torch import nn
from torch.nn import functional as F

needs_executorch = pytest.mark.skipif(
    importlib.util.find_spec("executorch") is None,
    reason="ExecuTorch is not installed: pip install --no-deps executorch==1.5.1 "
    "&& pip install flatbuffers pyyaml ruamel.yaml packaging numpy tabulate",
)


class Program:
    """A .pte loaded into ExecuTorch's Python training runtime.

    Holds the bytes it was loaded from: the runtime reads them in place, and freeing
    them under a live module crashes the process.
    """

    def __init__(self, pte: bytes) -> None:
        from executorch.extension.training import (
            _load_for_executorch_for_training_from_buffer,
        )

        self.pte = pte
        self.module = _load_for_executorch_for_training_from_buffer(pte)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward on one batch; returns the loss."""
        return self.module.forward_backward(METHOD_NAME, (x, y))[0]

    def parameters(self) -> dict[str, torch.Tensor]:
        """The program's own parameter tensors (writing them writes the program)."""
        return self.module.named_parameters()

    def gradients(self) -> dict[str, torch.Tensor]:
        return self.module.named_gradients()


Batch = tuple[torch.Tensor, torch.Tensor]


@pytest.fixture(scope="module")
def digits_batch() -> Batch:
    """A fixed batch of 12 real digits (not the export's example batch size, 8)."""
    data = load_dataset("digits")
    return torch.from_numpy(data.x_train[:12]), torch.from_numpy(data.y_train[:12])


class ExportedModels(dict[str, tuple[nn.Module, bytes]]):
    """Model name -> (model seeded with 0, its .pte for digits), exported on demand."""

    def __missing__(self, name: str) -> tuple[nn.Module, bytes]:
        torch.manual_seed(0)
        model, shape = build_export_model(name, "digits")
        self[name] = (model, export_training_program(model, shape).data)
        return self[name]


@pytest.fixture(scope="module")
def exported() -> ExportedModels:
    """Each model is exported once per test module (an export takes seconds)."""
    return ExportedModels()


def _torch_grads(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor
) -> tuple[float, dict[str, torch.Tensor]]:
    model = copy.deepcopy(model)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}  # type: ignore[misc]


FAST_EXPORT_MODELS = [m for m in EXPORT_MODELS if m != "mobilenetv2"]
"""MobileNetV2 takes minutes to export; it has its own (slow) test below."""


@needs_executorch
@pytest.mark.parametrize("name", FAST_EXPORT_MODELS)
def test_parameter_names_are_the_state_dict_keys(
    name: str, exported: ExportedModels, digits_batch: Batch
) -> None:
    model, pte = exported[name]
    program = Program(pte)
    program.step(*digits_batch)
    assert sorted(program.parameters()) == sorted(model.state_dict())
    assert list(program.gradients()) == list(program.parameters())
    for key, value in model.state_dict().items():
        assert program.parameters()[key].shape == value.shape


@needs_executorch
@pytest.mark.parametrize("name", FAST_EXPORT_MODELS)
def test_loss_and_gradients_match_torch_autograd(
    name: str, exported: ExportedModels, digits_batch: Batch
) -> None:
    model, pte = exported[name]
    x, y = digits_batch
    program = Program(pte)
    # Twice: the second pass runs over memory the first one left behind, where an
    # accumulating kernel that forgets to zero its output shows up.
    program.step(x, y)
    loss = program.step(x, y)
    want_loss, want_grads = _torch_grads(model, x, y)
    assert float(loss) == pytest.approx(want_loss, rel=1e-5)
    for key, want in want_grads.items():
        torch.testing.assert_close(
            program.gradients()[key], want, rtol=1e-4, atol=1e-5, msg=key
        )


@needs_executorch
def test_sgd_steps_through_the_program_lower_the_loss_like_torch_sgd(
    exported: ExportedModels, digits_batch: Batch
) -> None:
    from executorch.extension.training import get_sgd_optimizer

    model, pte = exported["lenet"]
    x, y = digits_batch
    lr, steps = 0.05, 5
    program = Program(pte)
    losses = [float(program.step(x, y))]
    optimiser = get_sgd_optimizer(program.parameters(), lr)
    reference = copy.deepcopy(model)
    torch_sgd = torch.optim.SGD(reference.parameters(), lr=lr)
    torch_losses = []
    for _ in range(steps):
        optimiser.step(program.gradients())
        losses.append(float(program.step(x, y)))
        torch_sgd.zero_grad()
        loss = F.cross_entropy(reference(x), y)
        torch_losses.append(float(loss))
        loss.backward()
        torch_sgd.step()
    torch_losses.append(float(F.cross_entropy(reference(x), y)))
    assert losses[-1] < losses[0]
    assert losses == pytest.approx(torch_losses, rel=1e-4)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(
            program.parameters()[key], value, rtol=1e-4, atol=1e-5, msg=key
        )


def _special_arrays(model: nn.Module, seed: int) -> dict[str, np.ndarray]:
    """Seeded float32 arrays shaped like the model's, starting with edge values."""
    rng = np.random.default_rng(seed)
    specials = np.array(
        [-0.0, 1e-45, -3.4028235e38, np.nan, np.inf, 0.1], dtype=np.float32
    )
    arrays = {}
    for key, value in model.state_dict().items():
        flat = rng.standard_normal(value.numel()).astype(np.float32)
        count = min(len(specials), flat.size)
        flat[:count] = specials[:count]
        arrays[key] = flat.reshape(tuple(value.shape))
    return arrays


@needs_executorch
def test_weights_written_into_the_program_read_back_bit_for_bit(
    exported: ExportedModels, digits_batch: Batch
) -> None:
    model, pte = exported["lenet"]
    program = Program(pte)
    program.step(*digits_batch)
    arrays = _special_arrays(model, seed=1)
    for key, param in program.parameters().items():
        param.copy_(torch.from_numpy(arrays[key]))
    program.step(*digits_batch)  # a pass between writing and reading
    for key, param in program.parameters().items():
        assert param.numpy().tobytes() == arrays[key].tobytes(), key


@needs_executorch
def test_program_trains_with_the_weights_written_into_it(
    exported: ExportedModels, digits_batch: Batch
) -> None:
    _, pte = exported["lenet"]
    x, y = digits_batch
    program = Program(pte)
    program.step(x, y)
    torch.manual_seed(7)
    other, _ = build_export_model("lenet", "digits")
    for key, param in program.parameters().items():
        param.copy_(other.state_dict()[key])
    want_loss, want_grads = _torch_grads(other, x, y)
    assert float(program.step(x, y)) == pytest.approx(want_loss, rel=1e-5)
    torch.testing.assert_close(
        program.gradients()["classifier.5.weight"],
        want_grads["classifier.5.weight"],
        rtol=1e-4,
        atol=1e-5,
    )


@needs_executorch
def test_program_takes_any_batch_up_to_its_maximum_and_refuses_larger(
    exported: ExportedModels,
) -> None:
    model, pte = exported["softmax"]
    program = Program(pte)
    generator = torch.Generator().manual_seed(3)
    x = torch.rand(DEFAULT_MAX_BATCH_SIZE + 1, 1, 8, 8, generator=generator)
    y = torch.arange(DEFAULT_MAX_BATCH_SIZE + 1) % 10
    for n in (1, DEFAULT_MAX_BATCH_SIZE):
        want = F.cross_entropy(model(x[:n]), y[:n]).item()
        assert program.step(x[:n], y[:n]).item() == pytest.approx(want, rel=1e-5)
    with pytest.raises(RuntimeError):
        program.step(x, y)


@needs_executorch
def test_cli_writes_a_program_starting_from_the_arrays_file(
    tmp_path: Path, digits_batch: Batch
) -> None:
    model, _ = build_export_model("mlp", "digits", hidden=5)
    # Any: numpy types np.savez(**kwds) as its bool allow_pickle flag.
    arrays: dict[str, Any] = _special_arrays(model, seed=2)
    np.savez(tmp_path / "initial.npz", **arrays)
    out = tmp_path / "out" / "model.pte"
    argv = ["export-android", "--model", "mlp", "--dataset", "digits", "--hidden", "5"]
    argv += ["--out", str(out), "--arrays", str(tmp_path / "initial.npz")]
    assert cli_main(argv) == 0
    program = Program(out.read_bytes())
    program.step(*digits_batch)
    assert list(program.parameters()) == [
        "fc1.weight",
        "fc1.bias",
        "fc2.weight",
        "fc2.bias",
    ]
    for key, param in program.parameters().items():
        assert param.numpy().tobytes() == arrays[key].tobytes(), key


def test_export_models_are_the_zoos_image_models_and_the_phone_models() -> None:
    from flowerbed.models import MODELS, model_dims
    from flowerbed.zoo import ONE_D_MODELS

    assert set(ONE_D_MODELS) == {n for n in MODELS if model_dims(n) == 1}
    assert EXPORT_MODELS == ("lenet", "mobilenet", "mobilenetv2", "mlp", "softmax")


def test_phone_models_use_the_java_trainers_linear_layout() -> None:
    mlp, _ = build_export_model("mlp", "mnist", hidden=32)
    softmax, _ = build_export_model("softmax", "cifar10")
    assert {k: tuple(v.shape) for k, v in mlp.state_dict().items()} == {
        "fc1.weight": (32, 28 * 28),
        "fc1.bias": (32,),
        "fc2.weight": (10, 32),
        "fc2.bias": (10,),
    }
    assert {k: tuple(v.shape) for k, v in softmax.state_dict().items()} == {
        "fc.weight": (10, 3 * 32 * 32),
        "fc.bias": (10,),
    }


def test_dataset_shapes_match_the_digits_data() -> None:
    data = load_dataset("digits")
    _, shape = build_export_model("softmax", "digits")
    assert (shape.in_channels, shape.image_size, shape.num_classes) == (
        data.in_channels,
        data.image_size,
        data.num_classes,
    )


def test_unknown_model_name_is_refused_with_the_choices() -> None:
    with pytest.raises(
        ValueError,
        match=r"unknown model 'resnet'.*lenet, mobilenet, mobilenetv2, mlp, softmax",
    ):
        build_export_model("resnet", "digits")


def test_unknown_dataset_name_is_refused_with_the_choices() -> None:
    with pytest.raises(
        ValueError, match=r"unknown dataset 'svhn'.*digits, mnist, cifar10"
    ):
        build_export_model("lenet", "svhn")


def test_cli_reports_a_bad_name_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model.pte"
    argv = ["export-android", "--model", "resnet", "--dataset", "digits"]
    assert cli_main([*argv, "--out", str(out)]) == 2
    assert "unknown model 'resnet'" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.pop("fc.bias"), r"missing \['fc.bias'\]"),
        (
            lambda a: a.update({"fc.extra": np.zeros(1, np.float32)}),
            r"unexpected \['fc.extra'\]",
        ),
        (
            lambda a: a.update({"fc.bias": np.zeros(9, np.float32)}),
            r"'fc.bias'.*shape \(9,\).*\(10,\)",
        ),
        (
            lambda a: a.update({"fc.bias": np.zeros(10, np.float64)}),
            r"'fc.bias'.*float64, not float32",
        ),
    ],
)
def test_arrays_file_that_does_not_fit_the_model_is_refused(
    tmp_path: Path, change: Any, message: str
) -> None:
    model, _ = build_export_model("softmax", "digits")
    arrays = {k: v.numpy() for k, v in model.state_dict().items()}
    change(arrays)
    np.savez(tmp_path / "a.npz", **arrays)
    with pytest.raises(ValueError, match=message):
        load_arrays(model, tmp_path / "a.npz")


def test_model_with_running_state_is_refused_when_asked() -> None:
    model = nn.Sequential(nn.Flatten(), nn.BatchNorm1d(64), nn.Linear(64, 10))
    with pytest.raises(ValueError, match=r"buffers \['1.running_mean'"):
        export_training_program(model, DATASET_SHAPES["digits"], batchnorm="refuse")


class BatchNormNet(nn.Module):
    """A conv net with batch norm, as most MobileNets are written."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))))


@needs_executorch
def test_batchnorm_becomes_groupnorm_with_the_same_parameter_names(
    digits_batch: Batch,
) -> None:
    torch.manual_seed(0)
    model = BatchNormNet()
    with torch.no_grad():
        model.bn.weight.uniform_(0.5, 1.5)
    before = {k: v.clone() for k, v in model.named_parameters()}
    result = export_training_program(model, DATASET_SHAPES["digits"])
    assert result.replaced_batchnorm == ["bn"]
    # 8 channels: fewer than 16 per group, so one group; weight and bias carried over.
    assert isinstance(model.bn, nn.GroupNorm) and model.bn.num_groups == 1
    assert list(model.state_dict()) == list(before)  # no running statistics left
    torch.testing.assert_close(model.bn.weight, before["bn.weight"])
    assert sorted(n for n, _ in result.parameters) == sorted(before)
    x, y = digits_batch
    want_loss, want_grads = _torch_grads(model, x, y)
    program = Program(result.data)
    assert float(program.step(x, y)) == pytest.approx(want_loss, rel=1e-5)
    torch.testing.assert_close(
        program.gradients()["bn.weight"], want_grads["bn.weight"], rtol=1e-4, atol=1e-5
    )


class AvgPoolNet(nn.Module):
    """AvgPool2d: exports, but ExecuTorch 1.5.1 has no avg_pool2d_backward kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.pool = nn.AvgPool2d(2)
        self.fc = nn.Linear(4 * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.conv(x)), 1))


@needs_executorch
def test_a_program_that_does_not_run_in_the_runtime_is_refused() -> None:
    with pytest.raises(ExportError, match="does not run in ExecuTorch's runtime"):
        export_training_program(AvgPoolNet(), DATASET_SHAPES["digits"])


class AttentionNet(nn.Module):
    """Eight rows of the digit as tokens, one multi-head attention layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.reshape(x.shape[0], 8, 8))
        a, _ = self.attention(h, h, h, need_weights=False)
        return self.fc(a.mean(1))


@needs_executorch
def test_attention_exports_with_the_parameter_order_of_the_program(
    digits_batch: Batch,
) -> None:
    torch.manual_seed(0)
    model = AttentionNet()
    result = export_training_program(model, DATASET_SHAPES["digits"])
    program = Program(result.data)
    x, y = digits_batch
    want_loss, want_grads = _torch_grads(model, x, y)
    assert float(program.step(x, y)) == pytest.approx(want_loss, rel=1e-5)
    assert [n for n, _ in result.parameters] == list(program.gradients())
    for key, want in want_grads.items():
        torch.testing.assert_close(
            program.gradients()[key], want, rtol=1e-4, atol=1e-5, msg=key
        )


USER_MODULE = """
from torch import nn

def build(in_channels, image_size, num_classes):
    return nn.Sequential(
        nn.Flatten(), nn.Linear(in_channels * image_size * image_size, num_classes)
    )

instance = nn.Sequential(nn.Flatten(), nn.BatchNorm1d(64), nn.Linear(64, 10))
"""


@needs_executorch
def test_cli_exports_a_users_model_with_metadata_the_gateway_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from flowerbed.clients.bridge.programs import load_program

    (tmp_path / "my_models.py").write_text(USER_MODULE)
    monkeypatch.chdir(tmp_path)
    for attr, names in [
        ("build", ["1.weight", "1.bias"]),
        ("instance", ["1.weight", "1.bias", "2.weight", "2.bias"]),  # BN -> GN
    ]:
        out = tmp_path / f"{attr}.pte"
        argv = ["export-android", "--model", f"my_models:{attr}", "--dataset", "digits"]
        assert cli_main([*argv, "--out", str(out), "--profile", "4"]) == 0
        served = load_program(out)  # what `flowerbed bridge --program` does
        assert served.name == f"my_models:{attr}"
        assert [n for n, _ in served.parameters] == names
        assert served.min_runtime == "1.5.1"
    printed = capsys.readouterr().out
    assert "BatchNorm replaced by GroupNorm in 1 layers" in printed
    assert "ratio" in printed and "step of 4: ExecuTorch" in printed


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("no_such_module:build", "cannot import no_such_module"),
        ("json:no_attr", "json has no no_attr"),
        ("json:__doc__", "neither an nn.Module nor callable"),
        ("json:dumps", "a model factory takes (in_channels, image_size, num_classes)"),
        ("builtins:max", "returned int, not an nn.Module"),
        ("cnn1d", "unknown model 'cnn1d'"),
    ],
)
def test_cli_refuses_models_it_cannot_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: str, message: str
) -> None:
    out = tmp_path / "m.pte"
    argv = [
        "export-android",
        "--model",
        model,
        "--dataset",
        "digits",
        "--out",
        str(out),
    ]
    assert cli_main(argv) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


@needs_executorch
@pytest.mark.slow
def test_mobilenetv2_trains_in_the_runtime_like_torch(digits_batch: Batch) -> None:
    """The zoo's 2.2 M-parameter MobileNetV2 (group norm) exports; its first step's
    loss and gradients are torch's, and three SGD steps lower the loss as torch's do
    (an export takes minutes).

    Known gap, measured here: the first step's loss is torch's to 1e-5 but its
    gradients, as one vector, differ from torch's by 2.6 % (relative L2), largest in
    the last blocks (1x1 feature maps on digits). Every layer kind of the model
    (depthwise and pointwise convolutions, group norm with 1 to 32 groups, ReLU6,
    residual blocks, pooling) matches torch exactly when exported alone, so the
    source is not found yet; the test bounds it (5 %) so that it cannot grow
    unnoticed, and the fast-fitted 12-sample batch makes later losses drift, so
    they are compared within 10 %. docs/export-android.md states the gap.
    """
    from executorch.extension.training import get_sgd_optimizer

    torch.manual_seed(0)
    model, shape = build_export_model("mobilenetv2", "digits")
    assert sum(p.numel() for p in model.parameters()) > 2_000_000
    result = export_training_program(model, shape, max_batch_size=16)
    assert result.replaced_batchnorm == []
    x, y = digits_batch
    program = Program(result.data)
    first = float(program.step(x, y))
    want_loss, want_grads = _torch_grads(model, x, y)
    assert first == pytest.approx(want_loss, rel=1e-5)
    got = torch.cat([program.gradients()[n].flatten() for n in want_grads])
    want = torch.cat([g.flatten() for g in want_grads.values()])
    assert float((got - want).norm() / want.norm()) < 0.05
    lr = 0.005
    optimiser = get_sgd_optimizer(program.parameters(), lr)
    reference = copy.deepcopy(model)
    torch_sgd = torch.optim.SGD(reference.parameters(), lr=lr)
    losses, torch_losses = [first], []
    for _ in range(3):
        optimiser.step(program.gradients())
        losses.append(float(program.step(x, y)))
        torch_sgd.zero_grad()
        loss = F.cross_entropy(reference(x), y)
        torch_losses.append(float(loss))
        loss.backward()
        torch_sgd.step()
    torch_losses.append(float(F.cross_entropy(reference(x), y)))
    assert losses[-1] < losses[0] and torch_losses[-1] < torch_losses[0]
    assert losses == pytest.approx(torch_losses, rel=0.1)


def test_importing_flowerbed_and_its_cli_does_not_import_executorch() -> None:
    code = (
        "import sys, flowerbed.cli; flowerbed.cli.build_parser(); "
        "print('executorch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"
