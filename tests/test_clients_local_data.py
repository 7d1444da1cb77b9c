"""A board's local data: image folders and .npz files, and every way they go wrong."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flowerbed.clients.local_data import load_local_data
from flowerbed.data import DataError
from PIL import Image


def save_gray(path: Path, value: int, side: int = 4) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((side, side), value, dtype=np.uint8), mode="L").save(path)


def test_folder_with_numeric_class_names_uses_them_as_labels(tmp_path: Path) -> None:
    save_gray(tmp_path / "digits" / "3" / "a.png", 255)
    save_gray(tmp_path / "digits" / "7" / "b.png", 51)
    save_gray(tmp_path / "digits" / "7" / "c.png", 0)
    data = load_local_data(tmp_path / "digits")
    assert data.x.shape == (3, 1, 4, 4)
    assert data.x.dtype == np.float32
    assert data.y.tolist() == [3, 7, 7]
    # pixel 255 -> 1.0, 51 -> 0.2, 0 -> 0.0
    assert data.x[:, 0, 0, 0].tolist() == pytest.approx([1.0, 0.2, 0.0])


def test_folder_labels_follow_class_names_order(tmp_path: Path) -> None:
    save_gray(tmp_path / "f" / "cat" / "a.png", 0)
    save_gray(tmp_path / "f" / "dog" / "b.png", 0)
    data = load_local_data(tmp_path / "f", class_names=["dog", "bird", "cat"])
    assert data.y.tolist() == [2, 0]


def test_folder_names_without_class_names_are_sorted(tmp_path: Path) -> None:
    save_gray(tmp_path / "f" / "dog" / "a.png", 0)
    save_gray(tmp_path / "f" / "cat" / "b.png", 0)
    assert load_local_data(tmp_path / "f").y.tolist() == [0, 1]  # cat, dog


def test_folder_images_resized_and_converted(tmp_path: Path) -> None:
    rgb = np.zeros((6, 6, 3), dtype=np.uint8)
    rgb[..., 0] = 255
    (tmp_path / "f" / "0").mkdir(parents=True)
    Image.fromarray(rgb, mode="RGB").save(tmp_path / "f" / "0" / "red.png")
    data = load_local_data(tmp_path / "f", image_size=3, in_channels=3)
    assert data.x.shape == (1, 3, 3, 3)
    assert data.x[0, :, 1, 1].tolist() == pytest.approx([1.0, 0.0, 0.0])
    gray = load_local_data(tmp_path / "f", in_channels=1)
    # PIL's L = 0.299 R + 0.587 G + 0.114 B -> 0.299 x 255 = 76.2 -> 76
    assert gray.x[0, 0, 0, 0] == pytest.approx(76 / 255)


def test_npz_uint8_nhwc_becomes_nchw_in_unit_range(tmp_path: Path) -> None:
    x = np.zeros((2, 5, 5, 3), dtype=np.uint8)
    x[1, :, :, 2] = 255
    np.savez(tmp_path / "d.npz", x=x, y=np.array([4, 9]))
    data = load_local_data(tmp_path / "d.npz", num_classes=10)
    assert data.x.shape == (2, 3, 5, 5)
    assert data.x[1, 2].max() == 1.0 and data.x[1, :2].max() == 0.0
    assert data.y.dtype == np.int64 and data.y.tolist() == [4, 9]
    assert (data.in_channels, data.image_size, len(data)) == (3, 5, 2)


def test_npz_float_nhw_gets_a_channel_and_keeps_values(tmp_path: Path) -> None:
    x = np.full((3, 8, 8), 0.25, dtype=np.float64)
    np.savez(tmp_path / "d.npz", x=x, y=np.arange(3))
    data = load_local_data(tmp_path / "d.npz")
    assert data.x.shape == (3, 1, 8, 8)
    assert float(data.x.max()) == 0.25


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: None, "does not exist"),
        (lambda p: p.mkdir(), "no class subfolders"),
        (lambda p: (p / "0").mkdir(parents=True), "no images"),
    ],
)
def test_missing_or_empty_folder_names_path_and_problem(
    tmp_path: Path, make: object, message: str
) -> None:
    path = tmp_path / "data"
    make(path)  # type: ignore[operator]
    with pytest.raises(DataError, match=message) as err:
        load_local_data(path)
    assert str(path) in str(err.value)


def test_corrupt_image_names_the_file(tmp_path: Path) -> None:
    save_gray(tmp_path / "f" / "0" / "ok.png", 0)
    bad = tmp_path / "f" / "1" / "bad.png"
    bad.parent.mkdir()
    bad.write_bytes(b"not a png at all")
    with pytest.raises(DataError, match="cannot be read") as err:
        load_local_data(tmp_path / "f")
    assert str(bad) in str(err.value)


def test_unknown_folder_class_names_are_listed(tmp_path: Path) -> None:
    save_gray(tmp_path / "f" / "cow" / "a.png", 0)
    with pytest.raises(DataError, match="cow"):
        load_local_data(tmp_path / "f", class_names=["cat", "dog"])


def test_corrupt_npz_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "d.npz"
    path.write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(DataError, match=r"not a readable \.npz") as err:
        load_local_data(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"x": np.zeros((2, 4, 4))}, "lacks array"),
        ({"x": np.zeros((2, 4, 4)), "y": np.zeros(3, dtype=int)}, "2 samples"),
        ({"x": np.zeros((0, 4, 4)), "y": np.zeros(0, dtype=int)}, "no samples"),
        ({"x": np.zeros((2, 4, 4)), "y": np.array([0.5, 1.0])}, "integer labels"),
        ({"x": np.zeros((2, 4, 5)), "y": np.zeros(2, dtype=int)}, "square images"),
        ({"x": np.zeros((2, 2, 4, 4)), "y": np.zeros(2, dtype=int)}, "C in"),
        ({"x": np.full((1, 4, 4), np.nan), "y": np.zeros(1, dtype=int)}, "NaN"),
        ({"x": np.zeros((1, 4, 4)), "y": np.array([-1])}, "negative"),
    ],
)
def test_malformed_npz_names_the_problem(
    tmp_path: Path, arrays: dict[str, np.ndarray], message: str
) -> None:
    path = tmp_path / "d.npz"
    np.savez(path, **arrays)  # type: ignore[arg-type]
    with pytest.raises(DataError, match=message):
        load_local_data(path)


def test_labels_beyond_num_classes_are_refused(tmp_path: Path) -> None:
    np.savez(tmp_path / "d.npz", x=np.zeros((1, 4, 4)), y=np.array([10]))
    with pytest.raises(DataError, match="num-classes=10"):
        load_local_data(tmp_path / "d.npz", num_classes=10)


def test_image_size_mismatch_with_run_is_refused(tmp_path: Path) -> None:
    np.savez(tmp_path / "d.npz", x=np.zeros((1, 4, 4)), y=np.array([0]))
    with pytest.raises(DataError, match="image-size=8"):
        load_local_data(tmp_path / "d.npz", image_size=8)


def test_other_file_types_are_refused_with_valid_choices(tmp_path: Path) -> None:
    path = tmp_path / "data.csv"
    path.write_text("1,2\n")
    with pytest.raises(DataError, match=r"neither a folder nor an \.npz"):
        load_local_data(path)


def test_empty_path_explains_the_node_config_key() -> None:
    with pytest.raises(DataError, match="dataset-path"):
        load_local_data("")
