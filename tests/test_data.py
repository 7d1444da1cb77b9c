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

    model = build_model(name, channels, size, 10)
    assert model(torch.zeros(2, channels, size, size)).shape == (2, 10)
