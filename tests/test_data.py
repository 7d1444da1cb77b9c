"""Datasets and partitions: the embedded default and the opt-in local-file path."""

import gzip
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
from flowerbed.data import DataError, load_dataset, partition
from flowerbed.models import MODELS, build_model


def test_digits_ship_with_scikit_learn_and_are_standardised() -> None:
    d = load_dataset("digits")
    assert d.x_train.shape == (1437, 1, 8, 8) and d.x_test.shape == (360, 1, 8, 8)
    assert d.num_classes == 10 and d.x_train.dtype == np.float32
    assert abs(float(d.x_train.mean())) < 1e-4
    assert float(d.x_train.std()) == pytest.approx(1.0, abs=1e-3)


def test_iid_partition_covers_every_sample_once_in_near_equal_parts() -> None:
    labels = np.arange(103) % 10
    parts = partition(labels, 10, "iid", seed=0)
    assert sorted(len(p) for p in parts) == [10] * 7 + [11] * 3
    assert sorted(np.concatenate(parts).tolist()) == list(range(103))


def test_dirichlet_partition_is_skewed_for_small_alpha_and_seeded() -> None:
    labels = np.repeat(np.arange(10), 100)
    skewed = partition(labels, 5, "dirichlet", alpha=0.1, seed=1)
    flat = partition(labels, 5, "dirichlet", alpha=100.0, seed=1)
    assert sorted(np.concatenate(skewed).tolist()) == list(range(1000))

    def classes_per_node(parts: list[np.ndarray]) -> float:
        return float(np.mean([len(np.unique(labels[p])) for p in parts]))

    assert classes_per_node(skewed) < classes_per_node(flat) == 10
    again = partition(labels, 5, "dirichlet", alpha=0.1, seed=1)
    assert all((a == b).all() for a, b in zip(skewed, again, strict=True))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_partitions": 0}, "num_partitions must be >= 1"),
        ({"num_partitions": 4, "scheme": "shards"}, "valid choices: iid, dirichlet"),
        (
            {"num_partitions": 4, "scheme": "dirichlet", "alpha": 0.0},
            "alpha must be > 0",
        ),
        ({"num_partitions": 60}, "cannot give 60 nodes 2 samples each"),
    ],
)
def test_bad_partition_requests_say_what_is_wrong(kwargs, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        partition(np.zeros(100, dtype=np.int64), **kwargs)


def _idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(
        f">{array.ndim}I", *array.shape
    )
    with gzip.open(path, "wb") as fh:
        fh.write(header + array.astype(np.uint8).tobytes())


def test_mnist_reads_idx_files_from_a_local_folder(tmp_path: Path) -> None:
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 30), ("t10k", 10)):
        _idx(raw / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        _idx(raw / f"{prefix}-labels-idx1-ubyte.gz", np.arange(n) % 10)
    d = load_dataset("mnist", tmp_path)
    assert d.x_train.shape == (30, 1, 28, 28) and d.x_test.shape == (10, 1, 28, 28)
    assert d.y_train.tolist() == [i % 10 for i in range(30)]
    model = build_model("lenet", d.in_channels, d.image_size, d.num_classes)
    assert model(__import__("torch").from_numpy(d.x_test)).shape == (10, 10)


def test_cifar10_reads_python_batches_from_a_local_folder(tmp_path: Path) -> None:
    base = tmp_path / "cifar-10-batches-py"
    base.mkdir()
    rng = np.random.default_rng(0)
    for name, n in (("data_batch_1", 20), ("data_batch_2", 20), ("test_batch", 10)):
        batch = {
            b"data": rng.integers(0, 256, (n, 3072)).astype(np.uint8),
            b"labels": list(np.arange(n) % 10),
        }
        (base / name).write_bytes(pickle.dumps(batch))
    d = load_dataset("cifar10", tmp_path)
    assert d.x_train.shape == (40, 3, 32, 32) and d.num_classes == 10


def test_online_datasets_need_a_folder_and_say_how_to_get_one() -> None:
    with pytest.raises(DataError, match="set run config 'data-dir'"):
        load_dataset("mnist")


def test_truncated_idx_file_is_named(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    path = raw / "train-images-idx3-ubyte"
    path.write_bytes(bytes([0, 0, 8, 3]) + struct.pack(">3I", 5, 28, 28) + b"\x00" * 10)
    with pytest.raises(DataError, match="train-images-idx3-ubyte is truncated"):
        load_dataset("mnist", tmp_path)


def test_torchvision_download_path() -> None:
    try:
        import torchvision  # noqa: F401
    except Exception as err:  # the registry's torchvision needs CUDA torch here
        pytest.skip(f"torchvision does not import with this torch: {err}")
    from flowerbed.data import DOWNLOADERS

    assert set(DOWNLOADERS) == {"mnist", "cifar10"}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize(("channels", "size"), [(1, 8), (1, 28), (3, 32)])
def test_models_fit_every_dataset_shape(name: str, channels: int, size: int) -> None:
    import torch
    from flowerbed.models import model_dims

    model = build_model(name, channels, size, 10)
    shape = (2, channels, *([size] * model_dims(name)))
    assert model(torch.zeros(shape)).shape == (2, 10)


def test_mnist1d_is_generated_locally_with_more_samples_and_repeats() -> None:
    import random

    from flowerbed.data import make_mnist1d

    np.random.seed(123)
    random.seed(123)
    before = (np.random.random(), random.random())
    np.random.seed(123)
    random.seed(123)
    d = make_mnist1d(num_samples=600, num_test=100)
    assert d.x_train.shape == (500, 1, 40) and d.x_test.shape == (100, 1, 40)
    assert d.x_train.dtype == np.float32 and d.y_train.dtype == np.int64
    # balanced over the ten templates: 60 signals per class in all
    counts = np.bincount(np.concatenate([d.y_train, d.y_test]), minlength=10)
    assert counts.tolist() == [60] * 10
    again = make_mnist1d(num_samples=600, num_test=100)
    assert np.array_equal(d.x_train, again.x_train)
    assert np.array_equal(d.y_test, again.y_test)
    # the package seeds the global generators; they are given back untouched
    np.random.seed(123)
    random.seed(123)
    make_mnist1d(num_samples=600, num_test=100)
    assert (np.random.random(), random.random()) == before


def test_synthetic_follows_fedprox_recipe_per_writer() -> None:
    from flowerbed.data import make_synthetic

    d = make_synthetic(1.0, 1.0, 5, seed=3, max_samples=100)
    rng = np.random.default_rng(3)
    sizes = np.minimum(50 + rng.lognormal(4.0, 2.0, 5).astype(np.int64), 100)
    assert d.train_writers is not None and d.test_writers is not None
    for k in range(5):
        n_test = round(0.2 * sizes[k])
        assert int((d.test_writers == k).sum()) == n_test
        assert int((d.train_writers == k).sum()) == sizes[k] - n_test
    assert d.x_train.shape[1:] == (1, 60) and set(np.unique(d.y_train)) <= set(
        range(10)
    )
    again = make_synthetic(1.0, 1.0, 5, seed=3, max_samples=100)
    assert np.array_equal(d.x_train, again.x_train)


def test_synthetic_inputs_have_the_papers_diagonal_covariance() -> None:
    from flowerbed.data import make_synthetic

    # One writer with many samples: per-coordinate variance is j ** -1.2. The
    # first seed whose power-law size is >= 5,000 (the generator's first draw).
    seed = next(
        s
        for s in range(1000)
        if 50 + int(np.random.default_rng(s).lognormal(4.0, 2.0)) >= 5_000
    )
    d = make_synthetic(0.0, 0.0, 1, seed=seed, max_samples=20_000)
    x = np.concatenate([d.x_train, d.x_test])[:, 0, :]
    assert len(x) >= 5_000
    expected = np.arange(1, 61) ** -1.2
    assert np.allclose(x.var(axis=0), expected, rtol=0.25)


def test_synthetic_as_loaded_has_its_writers_shapes_and_seed() -> None:
    from flowerbed.data import (
        SYNTHETIC_MAX_SAMPLES,
        SYNTHETIC_WRITERS,
        load_dataset,
        make_synthetic,
    )

    d = load_dataset("synthetic")
    assert d.x_train.shape[1:] == d.x_test.shape[1:] == (1, 60)
    assert d.x_train.dtype == np.float32 and d.num_classes == 10
    assert len(d.y_test) >= 5_000  # a test set of at least 5,000 samples
    assert d.train_writers is not None and d.test_writers is not None
    assert set(np.unique(d.train_writers)) == set(range(SYNTHETIC_WRITERS))
    assert np.bincount(d.train_writers).max() <= SYNTHETIC_MAX_SAMPLES
    again = make_synthetic(1.0, 1.0, 20, seed=5)
    assert np.array_equal(again.y_train, make_synthetic(1.0, 1.0, 20, seed=5).y_train)
    assert not np.array_equal(again.x_train, make_synthetic(1.0, 1.0, 20).x_train)


def test_synthetic_writers_hold_different_labels() -> None:
    from flowerbed.data import load_dataset

    d = load_dataset("synthetic")
    assert d.train_writers is not None
    counts = np.zeros((int(d.train_writers.max()) + 1, 10))
    np.add.at(counts, (d.train_writers, d.y_train), 1)
    shares = counts / counts.sum(axis=1, keepdims=True)
    pooled = np.bincount(d.y_train, minlength=10) / len(d.y_train)
    # each writer's labels are far from the pooled mix (total variation), and
    # writers do not all favour one class
    assert np.median(0.5 * np.abs(shares - pooled).sum(axis=1)) > 0.5
    assert len(set(shares.argmax(axis=1).tolist())) >= 8


def test_one_global_linear_model_fits_synthetic_far_above_chance() -> None:
    from flowerbed.bench.suite import centralised_accuracy
    from flowerbed.data import load_dataset

    d = load_dataset("synthetic")
    largest_class = np.bincount(d.y_test).max() / len(d.y_test)
    assert largest_class < 0.2
    # one writer per device of 1,000 left this at ~35%: no global model could
    # then tell strategies apart
    assert centralised_accuracy(d) > 0.7


def test_group_label_shares_by_hand() -> None:
    from flowerbed.data import group_label_shares

    pi = group_label_shares(10, 2, 0.9)
    assert pi[0].tolist() == pytest.approx([0.18] * 5 + [0.02] * 5)
    assert pi[1].tolist() == pytest.approx([0.02] * 5 + [0.18] * 5)
    with pytest.raises(ValueError, match="affinity must be in"):
        group_label_shares(10, 2, 0.0)


def test_device_partition_puts_the_slow_classes_on_the_slow_devices() -> None:
    labels = np.repeat(np.arange(10), 100)
    groups = [0, 0, 0, 0, 1, 1, 1, 1, 1, 1]
    parts = partition(labels, 10, "device", seed=2, groups=groups)
    assert sorted(np.concatenate(parts).tolist()) == list(range(1000))
    slow = np.concatenate(parts[:4])
    fast = np.concatenate(parts[4:])
    # classes 0-4: slow demand 4 x 0.18 = 0.72, fast 6 x 0.02 = 0.12, so the slow
    # devices hold 0.72 / 0.84 = 85.7% of each of those classes
    held = np.bincount(labels[slow], minlength=10)[:5] / 100
    assert held == pytest.approx([0.72 / 0.84] * 5, abs=0.02)
    # classes 5-9: slow demand 4 x 0.02 = 0.08 of 1.16 -> 6.9%
    assert np.bincount(labels[slow], minlength=10)[5:] / 100 == pytest.approx(
        [0.08 / 1.16] * 5, abs=0.02
    )
    # the fast devices' data: 5 x 100 x 0.12/0.84 slow-class samples of
    # 5 x 100 x (0.12/0.84 + 1.08/1.16) in all = 13.3%, rarely seen
    fast_share_of_slow_classes = np.isin(labels[fast], range(5)).mean()
    expected = (0.12 / 0.84) / (0.12 / 0.84 + 1.08 / 1.16)
    assert fast_share_of_slow_classes == pytest.approx(expected, abs=0.01)
    again = partition(labels, 10, "device", seed=2, groups=groups)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    with pytest.raises(ValueError, match="needs one group per node"):
        partition(labels, 10, "device", seed=2, groups=[0, 1])


def test_natural_partition_keeps_each_writer_whole() -> None:
    labels = np.zeros(8, dtype=np.int64)
    writers = np.array([0, 0, 1, 1, 2, 2, 3, 3])
    parts = partition(labels, 2, "natural", writers=writers, min_size=1)
    assert [p.tolist() for p in parts] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    with pytest.raises(ValueError, match="needs the data's writers"):
        partition(labels, 2, "natural")


def test_natural_partition_shares_a_writer_between_nodes_when_writers_are_few() -> None:
    labels = np.zeros(9, dtype=np.int64)
    writers = np.array([0, 0, 0, 0, 0, 1, 1, 1, 1])
    parts = partition(labels, 5, "natural", writers=writers, min_size=1)
    # writer 0 -> nodes 0, 2, 4; writer 1 -> nodes 1, 3
    assert [p.tolist() for p in parts] == [[0, 1], [5, 6], [2, 3], [7, 8], [4]]
    # writer 1's 3 samples over nodes 1 and 3 leave node 3 one
    few = np.array([0] * 9 + [1] * 3)
    with pytest.raises(ValueError, match="1 of 5 nodes would hold fewer than 2"):
        partition(np.zeros(12, dtype=np.int64), 5, "natural", writers=few)


def test_one_dimensional_models_count_their_work() -> None:
    from flowerbed.models import charged_costs, forward_macs

    logreg = build_model("logreg", 1, 40, 10)
    assert forward_macs(logreg, 1, 40) == 400  # 40 inputs x 10 outputs
    cnn = build_model("cnn1d", 1, 40, 10)
    # conv1: 19 x 5 x 1, conv2: 10 x 3 x 25 (x25 out), conv3: 5 x 3 x 25, head 125x10
    assert forward_macs(cnn, 1, 40) == 25 * 19 * 5 + 25 * 10 * 75 + 25 * 5 * 75 + 1250
    factor, nbytes = charged_costs("mobilenet-v1")
    assert nbytes == 4 * 4_200_000
    lenet = forward_macs(build_model("lenet", 1, 28, 10), 1, 28)
    assert factor == pytest.approx(569_000_000 / lenet)
    with pytest.raises(ValueError, match="unknown charged model 'vgg'"):
        charged_costs("vgg")
