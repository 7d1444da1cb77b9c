"""A board's own training data: an image folder or an ``.npz`` file.

``dataset-path`` (node_config) points to either

- a folder with one subfolder per class (``digits/0/*.png``, ``digits/1/*.png``;
  any format PIL reads). Labels: the subfolder names as integers when every name
  is an integer, else the position of the name in the run config's
  ``class-names`` (comma-separated), else the position in the sorted names (then
  every node must hold every class, or labels disagree between nodes);
- an ``.npz`` file with arrays ``x`` (images: N x H x W, N x C x H x W or
  N x H x W x C with C in {1, 3}; uint8 is scaled by 1/255) and ``y`` (N integer
  labels).

Images come out as float32 N x C x H x W in [0, 1] and labels as int64, the layout
of :mod:`flowerbed.data`. Anything missing, empty or malformed raises
:class:`flowerbed.data.DataError` naming the path and the problem.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from flowerbed.data import DataError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".pgm", ".ppm", ".webp")
CHANNEL_MODES = {1: "L", 3: "RGB"}
"""PIL mode for each supported channel count."""


@dataclass(frozen=True)
class LocalData:
    """A node's samples (float32 NCHW in [0, 1], int64 labels)."""

    path: Path
    x: np.ndarray
    y: np.ndarray

    @property
    def in_channels(self) -> int:
        return int(self.x.shape[1])

    @property
    def image_size(self) -> int:
        return int(self.x.shape[2])

    def __len__(self) -> int:
        return len(self.y)


def load_local_data(
    path: str | Path,
    *,
    image_size: int | None = None,
    in_channels: int | None = None,
    class_names: list[str] | None = None,
    num_classes: int | None = None,
) -> LocalData:
    """Load a node's data from an image folder or an ``.npz`` file.

    Parameters
    ----------
    path : str or Path
        The folder or file (``dataset-path`` in node_config).
    image_size : int, optional
        Side in pixels to resize folder images to (default: the first image's
        width). Also checked against ``.npz`` images when given.
    in_channels : int, optional
        1 (grayscale) or 3 (RGB) for folder images (default: 1 when the first image
        is grayscale, else 3). Also checked against ``.npz`` images when given.
    class_names : list of str, optional
        Folder label order (see the module docstring).
    num_classes : int, optional
        When given, every label must lie in ``[0, num_classes)``.
    """
    if not str(path):
        raise DataError(
            "no dataset path: set node_config 'dataset-path' to an image folder "
            "(one subfolder per class) or an .npz file with arrays x and y"
        )
    root = Path(path).expanduser()
    if not root.exists():
        raise DataError(f"dataset path {root} does not exist")
    if in_channels is not None and in_channels not in CHANNEL_MODES:
        raise DataError(
            f"in-channels must be one of {sorted(CHANNEL_MODES)}, got {in_channels}"
        )
    if root.is_dir():
        data = _load_folder(root, image_size, in_channels, class_names)
    elif root.suffix == ".npz":
        data = _load_npz(root)
    else:
        raise DataError(
            f"dataset path {root} is neither a folder nor an .npz file "
            "(valid: an image folder with one subfolder per class, or x/y in .npz)"
        )
    _check(data, image_size, in_channels, num_classes)
    return data


def _check(
    data: LocalData,
    image_size: int | None,
    in_channels: int | None,
    num_classes: int | None,
) -> None:
    if len(data) == 0:
        raise DataError(f"dataset {data.path} holds no samples")
    if not np.isfinite(data.x).all():
        raise DataError(f"dataset {data.path} has NaN or infinite pixel values")
    if data.y.min() < 0:
        raise DataError(f"dataset {data.path} has negative labels")
    if num_classes is not None and data.y.max() >= num_classes:
        raise DataError(
            f"dataset {data.path} has label {int(data.y.max())} but the run has "
            f"num-classes={num_classes} (labels must be 0..{num_classes - 1})"
        )
    if image_size is not None and data.image_size != image_size:
        raise DataError(
            f"dataset {data.path} has {data.image_size}-pixel images but the run "
            f"expects image-size={image_size}"
        )
    if in_channels is not None and data.in_channels != in_channels:
        raise DataError(
            f"dataset {data.path} has {data.in_channels}-channel images but the run "
            f"expects in-channels={in_channels}"
        )


def _load_npz(path: Path) -> LocalData:
    try:
        with np.load(path, allow_pickle=False) as archive:
            missing = [k for k in ("x", "y") if k not in archive.files]
            if missing:
                raise DataError(
                    f"{path} lacks array(s) {', '.join(missing)}; it holds "
                    f"{', '.join(archive.files) or 'nothing'} (need x and y)"
                )
            x = np.asarray(archive["x"])
            y = np.asarray(archive["y"])
    except DataError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as err:
        raise DataError(f"{path} is not a readable .npz file: {err}") from err
    if y.ndim != 1:
        raise DataError(f"{path}: y must be one label per sample, got shape {y.shape}")
    if len(x) != len(y):
        raise DataError(f"{path}: x has {len(x)} samples but y has {len(y)} labels")
    if not np.issubdtype(y.dtype, np.integer):
        raise DataError(f"{path}: y must hold integer labels, got {y.dtype}")
    return LocalData(path, _to_nchw(x, path), y.astype(np.int64))


def _to_nchw(x: np.ndarray, path: Path) -> np.ndarray:
    if not (np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)):
        raise DataError(f"{path}: x must be numeric images, got {x.dtype}")
    if x.ndim == 3:
        x = x[:, None, :, :]
    elif (
        x.ndim == 4 and x.shape[1] not in CHANNEL_MODES and x.shape[3] in CHANNEL_MODES
    ):
        x = x.transpose(0, 3, 1, 2)
    if x.ndim != 4 or x.shape[1] not in CHANNEL_MODES or x.shape[2] != x.shape[3]:
        raise DataError(
            f"{path}: x has shape {x.shape}; expected square images as N x H x W, "
            "N x C x H x W or N x H x W x C with C in {1, 3}"
        )
    scale = 1.0 / 255.0 if x.dtype == np.uint8 else 1.0
    return np.ascontiguousarray(x.astype(np.float32) * np.float32(scale))


def _folder_labels(
    root: Path, names: list[str], class_names: list[str] | None
) -> dict[str, int]:
    if class_names:
        unknown = [n for n in names if n not in class_names]
        if unknown:
            raise DataError(
                f"{root}: class folder(s) {', '.join(unknown)} are not in "
                f"class-names ({', '.join(class_names)})"
            )
        return {n: class_names.index(n) for n in names}
    if all(n.isdigit() for n in names):
        return {n: int(n) for n in names}
    return {n: i for i, n in enumerate(sorted(names))}


def _load_folder(
    root: Path,
    image_size: int | None,
    in_channels: int | None,
    class_names: list[str] | None,
) -> LocalData:
    from PIL import Image, UnidentifiedImageError

    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    if not classes:
        raise DataError(
            f"image folder {root} has no class subfolders (expected one subfolder "
            f"per class, e.g. {root}/0/*.png)"
        )
    labels = _folder_labels(root, classes, class_names)
    files = [
        (f, labels[c])
        for c in classes
        for f in sorted((root / c).iterdir())
        if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES
    ]
    if not files:
        raise DataError(
            f"image folder {root} has class subfolders but no images "
            f"({', '.join(IMAGE_SUFFIXES)})"
        )
    images: list[np.ndarray] = []
    for file, _ in files:
        try:
            with Image.open(file) as img:
                if in_channels is None:
                    in_channels = 1 if img.mode in ("1", "L", "I", "I;16", "F") else 3
                if image_size is None:
                    image_size = img.width
                converted = img.convert(CHANNEL_MODES[in_channels])
                if converted.size != (image_size, image_size):
                    converted = converted.resize((image_size, image_size))
                array = np.asarray(converted, dtype=np.uint8)
        except (UnidentifiedImageError, OSError, ValueError) as err:
            raise DataError(f"image {file} cannot be read: {err}") from err
        images.append(array if array.ndim == 3 else array[:, :, None])
    x = np.stack(images).transpose(0, 3, 1, 2).astype(np.float32) / np.float32(255.0)
    y = np.asarray([label for _, label in files], dtype=np.int64)
    return LocalData(root, np.ascontiguousarray(x), y)
