"""Datasets and partitions shared by simulation and board clients.

The embedded default is scikit-learn's ``digits`` (1,797 real 8x8 handwritten digits
shipped inside scikit-learn; no download). MNIST and CIFAR-10 are opt-in: they are
read from a local folder in their published file formats (MNIST's IDX files, LeCun
et al.; CIFAR-10's "python version" pickled batches, Krizhevsky 2009), and the
``vision`` extra (torchvision) can download that folder once.
"""

from __future__ import annotations

import gzip
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DATASETS = ("digits", "mnist", "cifar10")
PARTITIONS = ("iid", "dirichlet")
TEST_FRACTION = 0.2
"""Share of ``digits`` held out as the central test set (stratified, fixed seed)."""


@dataclass(frozen=True)
class Dataset:
    """Standardised float32 NCHW images and int64 labels, split train/test.

    Pixels are scaled to [0, 1], then standardised with the training split's mean
    and standard deviation (one pair per dataset, as is usual for MNIST/CIFAR).
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def in_channels(self) -> int:
        return int(self.x_train.shape[1])

    @property
    def image_size(self) -> int:
        return int(self.x_train.shape[2])

    @property
    def num_classes(self) -> int:
        return int(max(self.y_train.max(), self.y_test.max()) + 1)


class DataError(ValueError):
    """A dataset that is missing, empty or malformed; the message names the path."""


def check_dataset_name(name: str) -> None:
    if name not in DATASETS:
        raise ValueError(
            f"unknown dataset {name!r}; valid choices: {', '.join(DATASETS)}"
        )


def load_dataset(name: str, data_dir: str | Path = "") -> Dataset:
    """Load a dataset by name (``digits``, ``mnist`` or ``cifar10``), standardised."""
    raw = _load_raw(name, data_dir)
    mean, std = float(raw.x_train.mean()), float(raw.x_train.std()) or 1.0
    return Dataset(
        raw.name,
        ((raw.x_train - mean) / std).astype(np.float32),
        raw.y_train,
        ((raw.x_test - mean) / std).astype(np.float32),
        raw.y_test,
    )


def _load_raw(name: str, data_dir: str | Path) -> Dataset:
    check_dataset_name(name)
    if name == "digits":
        return _load_digits()
    if not str(data_dir):
        raise DataError(
            f"dataset {name!r} is read from a local folder: set run config "
            f"'data-dir' (download it once with `flowerbed download {name} DIR`, "
            "which needs the 'vision' extra)"
        )
    root = Path(data_dir).expanduser()
    if name == "mnist":
        return _load_mnist(root)
    return _load_cifar10(root)


def _load_digits() -> Dataset:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = (bunch.images.astype(np.float32) / 16.0)[:, None, :, :]
    y = bunch.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(
        x, y, test_size=TEST_FRACTION, random_state=0, stratify=y
    )
    return Dataset("digits", x_tr, y_tr, x_te, y_te)


def _find(root: Path, stem: str) -> Path:
    for sub in (root, root / "MNIST" / "raw", root / "raw"):
        for candidate in (sub / stem, sub / f"{stem}.gz"):
            if candidate.is_file():
                return candidate
    raise DataError(f"MNIST file {stem}(.gz) not found under {root}")


def _read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (MNIST's format: magic, dims as big-endian uint32, data)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        raw = fh.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise DataError(f"{path} is not an unsigned-byte IDX file")
    ndim = raw[3]
    dims = np.frombuffer(raw, dtype=">u4", count=ndim, offset=4).astype(int)
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise DataError(f"{path} is truncated: {data.size} of {np.prod(dims)} bytes")
    return data.reshape(tuple(dims))


def _load_mnist(root: Path) -> Dataset:
    parts = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        images = _read_idx(_find(root, f"{prefix}-images-idx3-ubyte"))
        labels = _read_idx(_find(root, f"{prefix}-labels-idx1-ubyte"))
        if len(images) != len(labels):
            raise DataError(f"MNIST {split} under {root}: images/labels differ")
        parts[split] = (
            (images.astype(np.float32) / 255.0)[:, None, :, :],
            labels.astype(np.int64),
        )
    return Dataset("mnist", *parts["train"], *parts["test"])


def _load_cifar10(root: Path) -> Dataset:
    base = (
        root / "cifar-10-batches-py"
        if (root / "cifar-10-batches-py").is_dir()
        else root
    )

    def batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
        if not path.is_file():
            raise DataError(f"CIFAR-10 batch {path} not found")
        try:
            with open(path, "rb") as fh:
                obj = pickle.load(fh, encoding="bytes")
            data = np.asarray(obj[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
            labels = np.asarray(obj[b"labels"], dtype=np.int64)
        except (pickle.UnpicklingError, KeyError, ValueError, EOFError) as err:
            raise DataError(f"CIFAR-10 batch {path} is malformed: {err}") from err
        return data.astype(np.float32) / 255.0, labels

    train = [batch(p) for p in sorted(base.glob("data_batch_*"))]
    if not train:
        raise DataError(f"no CIFAR-10 data_batch_* files under {base}")
    x_te, y_te = batch(base / "test_batch")
    x_tr = np.concatenate([x for x, _ in train])
    y_tr = np.concatenate([y for _, y in train])
    return Dataset("cifar10", x_tr, y_tr, x_te, y_te)


def partition(
    labels: np.ndarray,
    num_partitions: int,
    scheme: str = "iid",
    alpha: float = 0.5,
    seed: int = 0,
    min_size: int = 2,
) -> list[np.ndarray]:
    """Split sample indices across ``num_partitions`` nodes.

    ``iid``: a seeded permutation cut into near-equal parts.
    ``dirichlet``: label skew as in Hsu, Qi, Brown, "Measuring the effects of
    non-identical data distribution for federated visual classification"
    (arXiv:1909.06335, Sec. 3): for each class k draw q_k ~ Dir(alpha * 1) over the
    nodes and give node i the share q_k[i] of class k's samples. Redrawn (up to 100
    times) until every node has at least ``min_size`` samples.
    """
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    if scheme not in PARTITIONS:
        raise ValueError(
            f"unknown partition {scheme!r}; valid choices: {', '.join(PARTITIONS)}"
        )
    if len(labels) < num_partitions * min_size:
        raise ValueError(
            f"{len(labels)} samples cannot give {num_partitions} nodes "
            f"{min_size} samples each; use fewer nodes"
        )
    rng = np.random.default_rng(seed)
    if scheme == "iid":
        return [
            np.sort(p)
            for p in np.array_split(rng.permutation(len(labels)), num_partitions)
        ]
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    classes = np.unique(labels)
    for _ in range(100):
        parts: list[list[int]] = [[] for _ in range(num_partitions)]
        for k in classes:
            idx = rng.permutation(np.flatnonzero(labels == k))
            shares = rng.dirichlet(np.full(num_partitions, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(idx)).astype(int)
            for node, chunk in enumerate(np.split(idx, cuts)):
                parts[node].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    raise ValueError(
        f"Dirichlet(alpha={alpha}) left a node with fewer than {min_size} samples "
        f"in 100 draws; raise alpha or use fewer nodes"
    )


def _download_mnist(root: Path) -> None:
    from torchvision.datasets import MNIST

    for train in (True, False):
        MNIST(str(root), train=train, download=True)


def _download_cifar10(root: Path) -> None:
    from torchvision.datasets import CIFAR10

    for train in (True, False):
        CIFAR10(str(root), train=train, download=True)


DOWNLOADERS = {"mnist": _download_mnist, "cifar10": _download_cifar10}
"""Fetch an online dataset once into a folder ``load_dataset`` reads (needs the
``vision`` extra: torchvision writes MNIST's IDX files and CIFAR-10's batches)."""


def download(name: str, data_dir: str | Path) -> Path:
    """Download ``mnist`` or ``cifar10`` into ``data_dir`` with torchvision."""
    if name not in DOWNLOADERS:
        raise ValueError(
            f"nothing to download for {name!r}; valid choices: {', '.join(DOWNLOADERS)}"
        )
    try:
        import torchvision  # noqa: F401
    except Exception as err:
        raise DataError(
            f"downloading {name} needs torchvision: pip install 'flowerbed[vision]' "
            f"({err})"
        ) from err
    root = Path(data_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    DOWNLOADERS[name](root)
    return root
