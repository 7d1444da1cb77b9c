"""`flowerbed export-android`: flowerbed models as ExecuTorch training programs.

The programs are run with ExecuTorch's own Python runtime (the training module and
its SGD), the same runtime the phone app drives through Java.
"""

from __future__ import annotations

import copy
import importlib.util
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flowerbed.cli import main as cli_main
from flowerbed.clients.export_android import (
    DATASET_SHAPES,
    DEFAULT_MAX_BATCH_SIZE,
    EVALUATE_METHOD,
    EXPORT_MODELS,
    METHOD_NAME,
    ExportError,
    _statistics_scale,
    build_export_model,
    close_arrays,
    export_training_program,
    load_arrays,
    prepare_batchnorm,
    run_evaluation,
)
from flowerbed.data import load_dataset
from fresh import python_prints
from torch import nn
from torch.nn import functional as F

_executorch_installed = pytest.mark.skipif(
    importlib.util.find_spec("executorch") is None,
    reason="ExecuTorch is not installed: pip install --no-deps executorch==1.5.1 "
    "&& pip install flatbuffers pyyaml ruamel.yaml packaging numpy tabulate",
)


def needs_executorch(test: Callable[..., None]) -> Callable[..., None]:
    """A test of programs run in ExecuTorch's runtime: skipped without it, and in
    the integration lane (``slow``: each export takes seconds)."""
    return pytest.mark.slow(_executorch_installed(test))


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

    def step(self, x: torch.Tensor, y: torch.Tensor, *state: torch.Tensor) -> Any:
        """Forward and backward on one batch; returns the loss (and, for a program
        that carries state, the updated state after it)."""
        out = self.module.forward_backward(METHOD_NAME, (x, y, *state))
        return (out[0], out[2:]) if state else out[0]

    def evaluate(
        self, x: torch.Tensor, y: torch.Tensor, names: list[str], *state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The evaluation method on the program's current parameters."""
        params = self.parameters()
        return run_evaluation(self.module, [params[n] for n in names], x, y, state)

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


def _assert_step_matches_autograd(
    program: Program, model: nn.Module, batch: Batch, keys: list[str] | None = None
) -> None:
    """One step of ``program`` on ``batch`` gives torch autograd's loss on ``model``
    (to rel 1e-5) and its gradients of ``keys`` (every parameter's by default; to
    rtol 1e-4 and atol 1e-5)."""
    x, y = batch
    want_loss, want_grads = _torch_grads(model, x, y)
    assert float(program.step(x, y)) == pytest.approx(want_loss, rel=1e-5)
    for key in list(want_grads) if keys is None else keys:
        torch.testing.assert_close(
            program.gradients()[key], want_grads[key], rtol=1e-4, atol=1e-5, msg=key
        )


FAST_EXPORT_MODELS = [m for m in EXPORT_MODELS if m != "mobilenetv2"]
"""MobileNetV2 takes minutes to export; it has its own (slow) test below, with the
paper's batch norm."""


@pytest.fixture(params=FAST_EXPORT_MODELS)
def stepped(
    request: pytest.FixtureRequest, exported: ExportedModels, digits_batch: Batch
) -> tuple[str, nn.Module, Program]:
    """A fast model's name, the model (seeded with 0) and a program of it after one
    step on the digits batch (the Python runtime names parameters after a first
    step)."""
    model, pte = exported[request.param]
    program = Program(pte)
    program.step(*digits_batch)
    return request.param, model, program


@needs_executorch
def test_parameter_names_are_the_state_dict_keys(
    stepped: tuple[str, nn.Module, Program],
) -> None:
    _, model, program = stepped
    assert sorted(program.parameters()) == sorted(model.state_dict())
    assert list(program.gradients()) == list(program.parameters())
    for key, value in model.state_dict().items():
        assert program.parameters()[key].shape == value.shape


@needs_executorch
def test_loss_and_gradients_match_torch_autograd(
    stepped: tuple[str, nn.Module, Program], digits_batch: Batch
) -> None:
    _, model, program = stepped
    # A second pass: it runs over memory the first one left behind, where an
    # accumulating kernel that forgets to zero its output shows up.
    _assert_step_matches_autograd(program, model, digits_batch)


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
    stepped: tuple[str, nn.Module, Program], digits_batch: Batch
) -> None:
    _, model, program = stepped
    arrays = _special_arrays(model, seed=1)
    for key, param in program.parameters().items():
        param.copy_(torch.from_numpy(arrays[key]))
    program.step(*digits_batch)  # a pass between writing and reading
    for key, param in program.parameters().items():
        assert param.numpy().tobytes() == arrays[key].tobytes(), key


@needs_executorch
@pytest.mark.parametrize("stepped", ["lenet"], indirect=True)
def test_program_trains_with_the_weights_written_into_it(
    stepped: tuple[str, nn.Module, Program], digits_batch: Batch
) -> None:
    _, _, program = stepped
    torch.manual_seed(7)
    other, _ = build_export_model("lenet", "digits")
    for key, param in program.parameters().items():
        param.copy_(other.state_dict()[key])
    _assert_step_matches_autograd(
        program, other, digits_batch, keys=["classifier.5.weight"]
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


def test_model_with_batch_norm_is_refused_when_asked() -> None:
    model = nn.Sequential(nn.Flatten(), nn.BatchNorm1d(64), nn.Linear(64, 10))
    with pytest.raises(ValueError, match=r"batch norm layers \['1'\]"):
        export_training_program(model, DATASET_SHAPES["digits"], batchnorm="refuse")


class Counter(nn.Module):
    """Running state that is not batch norm: phones cannot carry it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 10)
        self.register_buffer("seen", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(x, 1))


def test_running_state_other_than_batch_norm_is_refused() -> None:
    with pytest.raises(ValueError, match=r"buffers \['seen'\]"):
        export_training_program(Counter(), DATASET_SHAPES["digits"])


def test_statistics_are_compared_at_the_scale_of_the_whole_array() -> None:
    """A running mean with an element near zero: 2.5e-5 off there is 2.5e-3 of that
    element (an element-wise rtol of 1e-3 fails it) but 2.5e-6 of the array's norm
    (sqrt(0.01^2 + 10^2) = 10.000005), so it passes; 2e-2 off is 2e-3 of the norm."""
    want = torch.tensor([0.01, 10.0])
    assert close_arrays(torch.tensor([0.01 + 2.5e-5, 10.0]), want)
    assert not torch.allclose(torch.tensor([0.01 + 2.5e-5, 10.0]), want, 1e-3, 1e-5)
    assert not close_arrays(torch.tensor([0.01, 10.02]), want)
    assert not close_arrays(torch.tensor([0.01]), want)  # another shape
    # A running mean that is zero but for rounding is judged in units of the
    # channels' standard deviation, sqrt(running_var): 1e-8 off is 1e-8 of ||[1, 1]||.
    zero = torch.tensor([1e-9, -2e-9])
    assert not close_arrays(torch.tensor([1e-8, 0.0]), zero)
    assert close_arrays(torch.tensor([1e-8, 0.0]), zero, scale=torch.ones(2))
    statistics = {"bn.running_mean": zero, "bn.running_var": torch.tensor([4.0, 9.0])}
    assert _statistics_scale("bn.running_mean", statistics).tolist() == [2.0, 3.0]
    assert _statistics_scale("bn.running_var", statistics).tolist() == [4.0, 9.0]
    nan = torch.tensor([math.nan, 1.0])
    assert close_arrays(nan.clone(), nan)
    assert not close_arrays(torch.tensor([0.0, 1.0]), nan)
    assert not close_arrays(nan.clone(), torch.tensor([0.0, 1.0]))


def test_batch_norm_with_a_cumulative_average_is_refused_with_the_choices() -> None:
    model = nn.Sequential(nn.Flatten(), nn.BatchNorm1d(64, momentum=None))
    with pytest.raises(ValueError, match=r"\['1'\] have momentum=None.*groupnorm"):
        prepare_batchnorm(model, "train")
    with pytest.raises(ValueError, match="one of train, groupnorm, refuse"):
        prepare_batchnorm(model, "instance")  # type: ignore[arg-type]


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
    result = export_training_program(
        model, DATASET_SHAPES["digits"], batchnorm="groupnorm"
    )
    assert result.replaced_batchnorm == ["bn"] and result.state == []
    # 8 channels: fewer than 16 per group, so one group; weight and bias carried over.
    assert isinstance(model.bn, nn.GroupNorm) and model.bn.num_groups == 1
    assert list(model.state_dict()) == list(before)  # no running statistics left
    torch.testing.assert_close(model.bn.weight, before["bn.weight"])
    assert sorted(n for n, _ in result.parameters) == sorted(before)
    program = Program(result.data)
    _assert_step_matches_autograd(program, model, digits_batch, keys=["bn.weight"])


@needs_executorch
def test_batch_norm_trains_as_it_is_with_its_running_statistics_as_state(
    digits_batch: Batch,
) -> None:
    """The default: batch statistics in the training step, exactly as torch's
    ``model.train()``; the running statistics go in and come out of every step,
    updated as torch updates them; the evaluation method normalises with them."""
    from executorch.extension.training import get_sgd_optimizer

    torch.manual_seed(0)
    model = BatchNormNet()
    with torch.no_grad():
        model.bn.weight.uniform_(0.5, 1.5)
        model.bn.running_var.fill_(2.0)  # not the initial 1: the state must be used
    result = export_training_program(model, DATASET_SHAPES["digits"])
    assert isinstance(model.bn, nn.BatchNorm2d)
    assert result.batchnorm == "train" and result.batchnorm_layers == ["bn"]
    assert result.state == [("bn.running_mean", (8,)), ("bn.running_var", (8,))]
    # What phones exchange: the parameters and the float32 running statistics.
    assert list(model.state_dict()) == [
        "conv.weight",
        "bn.weight",
        "bn.bias",
        "bn.running_mean",
        "bn.running_var",
        "head.1.weight",
        "head.1.bias",
    ]
    meta = result.metadata("bn-net", "digits", DATASET_SHAPES["digits"], 64)
    assert meta["state"] == [
        {"name": "bn.running_mean", "shape": [8]},
        {"name": "bn.running_var", "shape": [8]},
    ]
    assert (meta["min_batch_size"], meta["evaluate_method"]) == (2, EVALUATE_METHOD)
    x, y = digits_batch
    program = Program(result.data)
    reference = copy.deepcopy(model).train()
    torch_sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    state = (model.bn.running_mean.clone(), model.bn.running_var.clone())
    optimiser = None
    for _ in range(3):
        loss, state = program.step(x, y, *state)
        torch_sgd.zero_grad()
        want = F.cross_entropy(reference(x), y)
        want.backward()
        assert float(loss) == pytest.approx(float(want), rel=1e-5)
        for key, param in reference.named_parameters():
            torch.testing.assert_close(
                program.gradients()[key], param.grad, rtol=1e-4, atol=1e-5, msg=key
            )
        torch.testing.assert_close(state[0], reference.bn.running_mean)
        torch.testing.assert_close(state[1], reference.bn.running_var)
        if optimiser is None:
            optimiser = get_sgd_optimizer(program.parameters(), 0.1)
        optimiser.step(program.gradients())
        torch_sgd.step()
    reference.eval()
    with torch.no_grad():
        logits = reference(x)
    names = [n for n, _ in result.parameters]
    eval_loss, eval_logits = program.evaluate(x, y, names, *state)
    torch.testing.assert_close(eval_logits, logits, rtol=1e-4, atol=1e-5)
    assert float(eval_loss) == pytest.approx(float(F.cross_entropy(logits, y)), 1e-5)


@needs_executorch
def test_the_evaluation_method_is_torchs_eval_without_a_backward_pass(
    stepped: tuple[str, nn.Module, Program], digits_batch: Batch
) -> None:
    """Evaluation runs a method of its own: a function of the batch and the weights it
    is given, with no gradient outputs, so it needs no training step first and
    changes nothing in the program."""
    name, _, program = stepped
    x, y = digits_batch
    before = {k: v.clone() for k, v in program.parameters().items()}
    torch.manual_seed(5)
    other, _ = build_export_model(name, "digits")
    weights = [p.detach() for p in other.parameters()]
    loss, logits = run_evaluation(program.module, weights, x, y)
    with torch.no_grad():
        want = other.eval()(x)
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-5)
    assert float(loss) == pytest.approx(float(F.cross_entropy(want, y)), rel=1e-5)
    for key, value in program.parameters().items():
        assert torch.equal(value, before[key]), key
    methods = set(program.module.model.method_names())
    assert {METHOD_NAME, EVALUATE_METHOD} <= methods
    assert f"__et_training_gradients_index_{EVALUATE_METHOD}" not in methods
    assert len(program.module.model.run_method(EVALUATE_METHOD, (x, y, *weights))) == 2


@needs_executorch
def test_the_evaluation_method_stores_no_second_copy_of_the_weights() -> None:
    torch.manual_seed(0)
    model, shape = build_export_model("mlp", "mnist", hidden=256)
    weight_bytes = 4 * sum(p.numel() for p in model.parameters())  # 0.8 MB
    result = export_training_program(model, shape)
    assert weight_bytes < len(result.data) < 1.25 * weight_bytes


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
    _assert_step_matches_autograd(program, model, digits_batch)
    assert [n for n, _ in result.parameters] == list(program.gradients())


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
    for attr, names, state in [
        ("build", ["1.weight", "1.bias"], []),
        (
            "instance",
            ["1.weight", "1.bias", "2.weight", "2.bias"],
            ["1.running_mean", "1.running_var"],  # batch norm trained as it is
        ),
    ]:
        out = tmp_path / f"{attr}.pte"
        argv = ["export-android", "--model", f"my_models:{attr}", "--dataset", "digits"]
        assert cli_main([*argv, "--out", str(out), "--profile", "4"]) == 0
        served = load_program(out)  # what `flowerbed bridge --program` does
        assert served.name == f"my_models:{attr}"
        assert [n for n, _ in served.parameters] == names
        assert [n for n, _ in served.state] == state
        assert served.evaluate_method == EVALUATE_METHOD
        assert served.min_runtime == "1.5.1"
    printed = capsys.readouterr().out
    assert "BatchNorm trained as it is in 1 layers" in printed
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
def test_mobilenetv2_with_batch_norm_trains_in_the_runtime_like_torch(
    digits_batch: Batch,
) -> None:
    """The paper's MobileNetV2 (2.2 M parameters, batch norm trained as it is) exports
    and trains three SGD steps in the runtime. At each step torch float64 is run at
    the runtime's own weights and statistics: the loss matches to 1e-5, the updated
    running statistics to 1e-4, the classifier's gradients to 1e-4 (relative L2) and
    the whole gradient within 5 %; the runtime's SGD update is exactly w - lr * g;
    the loss falls; the evaluation method gives torch's ``model.eval()`` loss (an
    export takes minutes).

    Why not every gradient to 1e-4: the 2.6 % of the issue. ReLU6's derivative
    jumps at 0 and 6, and of the 1.1 M ReLU6 inputs of this batch some lie within
    float32 rounding of a kink (6 within 1e-5, 107 within 1e-4, in float64).
    ExecuTorch's portable kernels round differently from torch's (another
    accumulation order): its inputs to two of those ReLU6 (features.13.conv.2 and
    features.19.conv.5; 6e-6 and 3e-5 from a kink) fall on the other side, each
    passes or stops one element's
    gradient, and batch norm's backward spreads it over the channel and every layer
    before. Forcing those two derivatives in torch float64 brings the runtime's
    whole gradient from 1.7 % to 4e-4 of torch float64's (docs/export-android.md,
    "How exact the gradients are"). The classifier is after the last ReLU6, so its
    gradient is unaffected and must match.
    """
    from executorch.extension.training import get_sgd_optimizer
    from flowerbed.models import mobilenetv2_batchnorm

    torch.manual_seed(0)
    model = mobilenetv2_batchnorm(1, 8, 10)
    assert sum(p.numel() for p in model.parameters()) > 2_000_000
    assert not any(isinstance(m, nn.Dropout) for m in model.modules())
    result = export_training_program(model, DATASET_SHAPES["digits"], max_batch_size=16)
    assert len(result.batchnorm_layers) == 52 and len(result.state) == 104
    x, y = digits_batch
    program = Program(result.data)
    names = [n for n, _ in result.parameters]
    buffers = dict(model.named_buffers())
    state = tuple(buffers[n].clone() for n, _ in result.state)
    lr = 0.05
    optimiser = None
    losses = []
    for step in range(3):
        # torch float64 at the program's current weights and statistics
        reference = copy.deepcopy(model).double().train()
        with torch.no_grad():
            weights = program.parameters() if step else dict(model.named_parameters())
            for name, param in reference.named_parameters():
                param.copy_(weights[name])
            statistics = dict(reference.named_buffers())
            for (name, _), value in zip(result.state, state, strict=True):
                statistics[name].copy_(value)
        before = {n: program.parameters()[n].clone() for n in names} if step else None
        loss, state = program.step(x, y, *state)
        want = F.cross_entropy(reference(x.double()), y)
        want.backward()
        losses.append(float(loss))
        assert float(loss) == pytest.approx(float(want), rel=1e-5), step
        got = program.gradients()
        grads = {n: p.grad for n, p in reference.named_parameters()}
        for name in ("classifier.1.weight", "classifier.1.bias"):
            # In L2: the feature at a kink is ~0, so is its column of the gradient.
            assert close_arrays(got[name].double(), grads[name], 1e-4), (step, name)
        flat = torch.cat([got[n].flatten() for n in names]).double()
        ref = torch.cat([grads[n].flatten() for n in names])
        assert float((flat - ref).norm() / ref.norm()) < 0.05, step
        trained = dict(reference.named_buffers())
        for (name, _), value in zip(result.state, state, strict=True):
            scale = _statistics_scale(name, trained)
            assert close_arrays(value.double(), trained[name], 1e-4, scale), name
        if optimiser is None:
            optimiser = get_sgd_optimizer(program.parameters(), lr)
        gradients = {n: g.clone() for n, g in program.gradients().items()}
        optimiser.step(program.gradients())
        if before is not None:
            for name in names:
                torch.testing.assert_close(
                    program.parameters()[name],
                    before[name] - lr * gradients[name],
                    # a few float32 ulps (another rounding of w - lr g; an ulp
                    # of 1 is 1.2e-7)
                    rtol=1e-6,
                    atol=1e-7,
                    msg=lambda text, name=name: f"{name}: {text}",
                )
    assert losses[-1] < losses[0]
    eval_loss, _ = program.evaluate(x, y, names, *state)
    evaluator = copy.deepcopy(model).double().eval()
    with torch.no_grad():
        for name, param in evaluator.named_parameters():
            param.copy_(program.parameters()[name])
        statistics = dict(evaluator.named_buffers())
        for (name, _), value in zip(result.state, state, strict=True):
            statistics[name].copy_(value)
        want_eval = F.cross_entropy(evaluator(x.double()), y)
    assert float(eval_loss) == pytest.approx(float(want_eval), rel=1e-4)


def test_importing_flowerbed_and_its_cli_does_not_import_executorch() -> None:
    code = (
        "import sys, flowerbed.cli; flowerbed.cli.build_parser(); "
        "print('executorch' in sys.modules)"
    )
    assert python_prints(code).strip() == "False"
