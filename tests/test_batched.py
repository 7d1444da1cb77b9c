"""Batched training of many nodes equals training each node on its own."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flowerbed.clients.training import (
    TrainStats,
    log_softmax,
    minibatch_table,
    minibatches,
    train_steps,
)
from flowerbed.data import load_dataset
from flowerbed.models import build_model
from flowerbed.sims import node
from flowerbed.sims.batched import NodeJob, batchable, grouped_forward, train_many
from flowerbed.sims.config import Scenario
from flowerbed.sims.conv_kernels import CACHE_ENV, ENABLE_ENV, ConvShape, kernels_for
from flowerbed.sims.engine import MIN_TASKS_PER_WORKER
from flowerbed.sims.grouped_sgd import Rates, grouped_sgd
from flowerbed.sims.numba_kernels import ENABLE_ENV as NUMBA_ENV
from flowerbed.sims.scenario import build_fleet_grid, run_scenario, run_server
from flowerbed.sims.vclock import NodeDropout
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from torch import nn

pytestmark = pytest.mark.usefixtures("quiet_single_threaded")
"""Per-node training as the simulated nodes run it."""


@pytest.fixture(autouse=True)
def _default_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default path (the numba kernels, not opted in to the C ones) unless
    a test asks for another."""
    monkeypatch.delenv(ENABLE_ENV, raising=False)
    monkeypatch.delenv(NUMBA_ENV, raising=False)


def _digits_jobs(model: nn.Module) -> list[NodeJob]:
    data = load_dataset("digits", "")
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    # (samples, steps, batch size, learning rate, proximal mu): a full group, a
    # node with fewer samples than a batch (its own group), a node that stops
    # early, a node that does nothing, and FedProx.
    shapes = [(40, 6, 16, 0.05, 0.0), (40, 6, 16, 0.1, 0.0), (9, 4, 16, 0.05, 0.0)]
    shapes += [(40, 2, 16, 0.05, 0.0), (40, 0, 16, 0.05, 0.0), (40, 6, 16, 0.05, 0.5)]
    jobs = []
    for i, (n, steps, batch, lr, mu) in enumerate(shapes):
        sl = slice(50 * i, 50 * i + n)
        jobs.append(
            NodeJob(
                weights, data.x_train[sl], data.y_train[sl], steps, batch, lr, i, mu
            )
        )
    return jobs


def _with_onednn(
    fn: Callable[..., TrainStats], *args: Any, **kwargs: Any
) -> TrainStats:
    """Run ``fn`` with oneDNN on, as train_many runs.

    PyTorch's two CPU convolution paths differ by ~1e-3 in MobileNet's weights
    after one SGD step on digits (measured), whether batched or not: the
    comparison is only meaningful on the same path.
    """
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = True  # type: ignore[assignment]
    try:
        return fn(*args, **kwargs)
    finally:
        torch.backends.mkldnn.enabled = before  # type: ignore[assignment]


@pytest.mark.parametrize("name", ["lenet", "mobilenet"])
def test_batched_training_equals_training_each_node_alone(name: str) -> None:
    # A fixed initialisation: the two paths sum in different orders (~1e-7 apart),
    # and on about 2 of 30 random MobileNet initialisations that difference grew
    # to ~1e-3 in the weights after 6 SGD steps (measured), failing atol 1e-5
    # at random; with a seed the comparison is the same on every run.
    torch.manual_seed(0)
    model = build_model(name, 1, 8, 10)
    jobs = _digits_jobs(model)
    batched = train_many(model, jobs)
    for job, (weights, stats) in zip(jobs, batched, strict=True):
        alone = build_model(name, 1, 8, 10)
        alone.load_state_dict(job.weights)
        expected = _with_onednn(
            train_steps,
            alone,
            job.x,
            job.y,
            steps=job.steps,
            batch_size=job.batch_size,
            lr=job.lr,
            seed=job.seed,
            proximal_mu=job.proximal_mu,
        )
        assert (stats.num_steps, stats.num_examples) == (
            expected.num_steps,
            expected.num_examples,
        )
        if job.steps:
            assert stats.mean_loss == pytest.approx(expected.mean_loss, abs=1e-5)
        else:
            assert np.isnan(stats.mean_loss)
        for key, value in alone.state_dict().items():
            assert torch.allclose(torch.from_numpy(weights[key]), value, atol=1e-5), key
    # the node that did no step still holds the weights it was given
    assert all(
        np.array_equal(batched[4][0][k], v.numpy()) for k, v in jobs[4].weights.items()
    )


@pytest.mark.parametrize(
    ("samples", "batch", "steps"), [(40, 16, 6), (9, 16, 4), (33, 4, 25), (5, 5, 3)]
)
def test_minibatch_table_holds_the_batches_minibatches_yields(
    samples: int, batch: int, steps: int
) -> None:
    # across reshuffles (40 samples: 2 batches of 16 a pass), a batch larger
    # than the data (9 samples), exact passes (5 of 5)
    order = minibatches(samples, batch, seed=3)
    expected = np.stack([next(order) for _ in range(steps)])
    assert np.array_equal(minibatch_table(samples, batch, 3, steps), expected)


@pytest.mark.parametrize(
    ("name", "sample"),
    [
        ("lenet", (1, 8, 8)),
        ("mobilenet", (1, 8, 8)),
        ("mobilenetv2", (3, 16, 16)),  # group norm, residual additions
        ("cnn1d", (1, 40)),
        ("mlp", (1, 40)),
        ("logreg", (1, 40)),
    ],
)
def test_grouped_forward_gives_each_node_its_own_models_output(
    name: str, sample: tuple[int, ...]
) -> None:
    torch.manual_seed(0)
    models = [build_model(name, sample[0], sample[-1], 10) for _ in range(3)]
    params = {
        key: torch.stack([dict(m.named_parameters())[key].detach() for m in models])
        for key, _ in models[0].named_parameters()
    }
    x = torch.randn(3, 4, *sample)
    grouped = grouped_forward(models[0])
    assert grouped is not None
    got = _with_onednn(grouped, params, x)
    assert got.shape == (3, 4, 10)
    for i, model in enumerate(models):
        model.eval()
        with torch.no_grad():
            expected = _with_onednn(model, x[i])
        assert torch.allclose(got[i], expected, atol=1e-5), i


@pytest.mark.parametrize(
    ("name", "sample"),
    [("lenet", (1, 8, 8)), ("cnn1d", (1, 40)), ("mlp", (1, 40)), ("logreg", (1, 40))],
)
def test_written_out_sgd_step_equals_autograds(
    name: str, sample: tuple[int, ...]
) -> None:
    # a batch of 5 (not whole vectors of samples): oneDNN runs the convolutions
    _step_against_autograd(
        lambda: build_model(name, sample[0], sample[-1], 10), sample, 5, kernels=False
    )


def _small_chain() -> nn.Module:
    """Convolutions without bias and without padding, pooling, two vectors of
    samples: what LeNet does not cover of the compiled kernels' layout."""
    return nn.Sequential(
        nn.Conv2d(2, 5, 3, bias=False),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(5, 4, (2, 3), padding=(1, 1)),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 5 * 3, 10),
    )


def _overlapping_pools() -> nn.Module:
    """Pooling windows that overlap: PyTorch pools the kernels' layout."""
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(3, stride=2),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 10),
    )


CHAINS = [
    (lambda: build_model("lenet", 1, 8, 10), (1, 8, 8), 16),
    (lambda: build_model("lenet", 1, 8, 10), (1, 8, 8), 32),
    (_small_chain, (2, 10, 8), 32),
    (_overlapping_pools, (1, 9, 9), 16),
    # for the kernels, padded with zero images to whole vectors (16, 32): no
    # gradient from them
    (lambda: build_model("lenet", 1, 8, 10), (1, 8, 8), 13),
    (_small_chain, (2, 10, 8), 20),
]
CHAIN_IDS = ["lenet-16", "lenet-32", "small-32", "overlapping-pools-16"]
CHAIN_IDS += ["lenet-13-padded", "small-20-padded"]


@pytest.mark.parametrize(("make", "sample", "batch"), CHAINS, ids=CHAIN_IDS)
def test_default_step_equals_autograds(
    make: Callable[[], nn.Module], sample: tuple[int, ...], batch: int
) -> None:
    # the default: numba's kernels (flowerbed.sims.numba_kernels) run the
    # convolutions and poolings in the node layout
    _step_against_autograd(make, sample, batch, kernels=True)


@pytest.mark.parametrize(("make", "sample", "batch"), CHAINS, ids=CHAIN_IDS)
def test_onednn_step_equals_autograds(
    monkeypatch: pytest.MonkeyPatch,
    make: Callable[[], nn.Module],
    sample: tuple[int, ...],
    batch: int,
) -> None:
    # the numba kernels turned off: PyTorch (oneDNN) runs the layers
    monkeypatch.setenv(NUMBA_ENV, "0")
    _step_against_autograd(make, sample, batch, kernels=False)


@pytest.mark.parametrize(("make", "sample", "batch"), CHAINS, ids=CHAIN_IDS)
@pytest.mark.usefixtures("c_kernels")
def test_compiled_convolutions_step_equals_autograds(
    make: Callable[[], nn.Module], sample: tuple[int, ...], batch: int
) -> None:
    # opted in, batches of whole vectors of samples: the compiled kernels
    # (flowerbed.sims.conv_kernels) run the convolutions
    _step_against_autograd(make, sample, batch, kernels=True)


@pytest.mark.usefixtures("c_kernels")
def test_batches_padding_would_more_than_double_keep_onednn() -> None:
    step = grouped_sgd(grouped_forward(build_model("lenet", 1, 8, 10)))
    assert step is not None
    assert step.pack(torch.zeros(1, 2, 7, 1, 8, 8))[0][0].dim() == 4  # 7 -> 16
    assert step.pack(torch.zeros(1, 2, 8, 1, 8, 8))[0][0].shape == (2, 8, 8, 1, 16)


def _step_against_autograd(
    make: Callable[[], nn.Module], sample: tuple[int, ...], batch: int, kernels: bool
) -> None:
    """Three nodes with their own weights, rates and FedProx terms: one step of
    the written-out backward pass against autograd's gradient of each node's
    mean cross-entropy plus mu/2 ||w - w0||^2, w -= lr * grad."""
    torch.manual_seed(0)
    models = [make() for _ in range(3)]
    names = [key for key, _ in models[0].named_parameters()]
    start = {
        key: torch.stack([dict(m.named_parameters())[key].detach() for m in models])
        for key in names
    }
    anchors = {key: w + 0.01 * torch.randn_like(w) for key, w in start.items()}
    lr, mu = torch.tensor([0.05, 0.1, 0.2]), torch.tensor([0.0, 0.5, 2.0])
    x, y = torch.randn(3, batch, *sample), torch.randint(0, 10, (3, batch))
    expected_losses = []
    expected: dict[str, list[torch.Tensor]] = {key: [] for key in names}
    for i, model in enumerate(models):
        loss = nn.functional.cross_entropy(model(x[i]), y[i])
        drift = sum(
            ((p - anchors[key][i]) ** 2).sum() for key, p in model.named_parameters()
        )
        grads = torch.autograd.grad(
            loss + 0.5 * mu[i] * drift, list(model.parameters())
        )
        expected_losses.append(loss.item())
        for key, p, g in zip(names, model.parameters(), grads, strict=True):
            expected[key].append(p.detach() - lr[i] * g)
    step = grouped_sgd(grouped_forward(models[0]))
    assert step is not None
    params = step.lay_out({key: w.clone() for key, w in start.items()})
    packed = step.pack(x[None])[0]  # as train_many lays them out
    # (nodes, H, W, C, batch): the kernels' layout; else oneDNN's
    assert (packed[0].dim() == 5) == kernels
    losses = _with_onednn(step.step, params, packed, y, Rates(lr, mu, anchors))
    assert losses.mean(dim=1).tolist() == pytest.approx(expected_losses, abs=1e-6)
    for key in names:
        assert torch.allclose(params[key], torch.stack(expected[key]), atol=1e-6), key


@pytest.fixture(scope="module")
def kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernels") / "cache"


@pytest.fixture
def c_kernels(monkeypatch: pytest.MonkeyPatch, kernel_cache: Path) -> None:
    """Opted in to the compiled kernels (a cache of the module's own); skipped
    where no C compiler builds them."""
    monkeypatch.setenv(ENABLE_ENV, "1")
    monkeypatch.setenv(CACHE_ENV, str(kernel_cache))
    if kernels_for(ConvShape(1, 6, 8, 8, 5, 5, 2, 2, batch=16)) is None:
        pytest.skip("no C compiler to build the kernels")


@pytest.mark.parametrize("shape", [(10, 16, 10), (3, 5, 10), (2, 7, 40)])
def test_log_softmax_over_columns_is_pytorchs(shape: tuple[int, int, int]) -> None:
    # over classes taken column-wise, rows padded to whole vectors or not; its
    # own seed (the global generator's state depends on the tests run before),
    # and a relative tolerance: at |value| ~16 a float32 step is 1.9e-6
    logits = 4 * torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    expected = torch.log_softmax(logits, dim=-1)
    got = log_softmax(logits)
    assert got.is_contiguous()
    assert torch.allclose(got, expected, atol=1e-6, rtol=1e-6)


def test_models_with_residuals_or_other_layers_keep_autograd() -> None:
    for name, shape in [("mobilenet", (1, 8)), ("mobilenetv2", (3, 16))]:
        model = build_model(name, shape[0], shape[1], 10)
        assert grouped_forward(model) is not None
        assert grouped_sgd(grouped_forward(model)) is None


class _Concat(nn.Module):
    """A forward torch.fx traces to a function the grouped pass does not know."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.a(x.flatten(1)), self.b(x.flatten(1))], dim=1)


def test_a_model_the_layer_library_does_not_run_is_trained_per_node() -> None:
    model = _Concat()  # torch.cat: not in the library's table
    assert grouped_forward(model) is None
    assert not batchable(model)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = np.zeros((4, 1, 2, 2), np.float32), np.zeros(4, np.int64)
    with pytest.raises(ValueError, match="train it per node"):
        train_many(model, [NodeJob(weights, x, y, 1, 2, 0.1, 0)])


def test_a_model_with_frozen_parameters_is_trained_per_node() -> None:
    model = build_model("logreg", 1, 40, 10)
    assert batchable(model)
    next(model.parameters()).requires_grad_(False)
    assert not batchable(model)


def test_models_with_buffers_or_random_layers_are_not_batched() -> None:
    assert batchable(build_model("lenet", 1, 8, 10))
    assert batchable(build_model("mobilenet", 1, 8, 10))
    with_norm = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    with_dropout = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
    assert not batchable(with_norm) and not batchable(with_dropout)
    with pytest.raises(ValueError, match="train it per node"):
        train_many(with_dropout, [])


RUN = {
    "fleet": "mixed",
    "num-nodes": 8,
    "num-rounds": 2,
    "dropout": 0.3,
    "local-steps": 4,
    "seed": 3,
}


def _train_messages(grid: object, server_round: int) -> list[Message]:
    model = build_model("lenet", 1, 8, 10)
    arrays = ArrayRecord(model.state_dict())
    config = ConfigRecord({"server-round": server_round, "local-steps": 4})
    return [
        Message(
            RecordDict({"arrays": arrays, "config": config}),
            node_id,
            MessageType.TRAIN,
            group_id=str(server_round),
        )
        for node_id in grid.get_node_ids()  # type: ignore[attr-defined]
    ]


def test_train_batch_answers_each_message_as_train_does() -> None:
    # the global generator's state (the tests run before) otherwise sets the
    # model's initial weights; on some the two paths end ~7e-5 apart in a loss
    torch.manual_seed(0)
    grid = build_fleet_grid(RUN, batch=False)
    contexts = {n: grid.context(n) for n in grid.get_node_ids()}
    messages = _train_messages(grid, server_round=1)
    tasks = [(m, contexts[m.metadata.dst_node_id]) for m in messages]
    batched = node.train_batch(tasks)
    dropped = 0
    for (message, context), got in zip(tasks, batched, strict=True):
        try:
            expected = node.train(message, context)
        except NodeDropout as drop:
            dropped += 1
            assert isinstance(got, NodeDropout) and str(got) == str(drop)
            assert (got.silent, got.after_s) == (drop.silent, drop.after_s)
            continue
        assert isinstance(got, Message)
        want = expected.content["metrics"]
        have = got.content["metrics"]
        assert set(have) == set(want)
        for key in want:
            assert have[key] == pytest.approx(want[key], abs=1e-5), key
        for key, array in expected.content["arrays"].items():
            assert np.allclose(
                got.content["arrays"][key].numpy(), array.numpy(), atol=1e-5
            )
    assert 0 < dropped < len(tasks)  # the seed drops some nodes, not all


def test_batched_and_worker_runs_match_the_per_node_run() -> None:
    # enough nodes that a round's push is split over the two workers
    run = {**RUN, "num-nodes": 2 * MIN_TASKS_PER_WORKER}
    per_node = run_scenario(run, write=False, batch=False).results
    batched = run_scenario(run, write=False, batch=True).results
    grid = build_fleet_grid(run, workers=2)
    try:
        scenario = Scenario.from_run_config(run)
        workers = run_server(grid, scenario, write=False).results
        assert grid.worker_processes == 2
    finally:
        grid.close()
    rounds = [[r["participants"], r["virtual_time_s"]] for r in per_node["rounds"]]
    for other in (batched, workers):
        assert [
            [r["participants"], r["virtual_time_s"]] for r in other["rounds"]
        ] == rounds
        assert abs(other["final_accuracy"] - per_node["final_accuracy"]) <= 0.01
    # where a task runs does not change it: workers and in-process batching agree
    assert workers["final_accuracy"] == batched["final_accuracy"]
