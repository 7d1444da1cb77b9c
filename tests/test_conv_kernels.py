"""The compiled convolution kernels (opt-in) against PyTorch's convolution in
float64, and the checks of their private cache."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from flowerbed.sims import conv_kernels
from flowerbed.sims.conv_kernels import (
    CACHE_ENV,
    ENABLE_ENV,
    ConvShape,
    PoolShape,
    eligible,
    kernels_for,
    pool_kernels_for,
    private_cache,
    prune,
)
from torch import nn

SHAPES = [
    # LeNet on digits: its two convolutions
    ConvShape(c=1, o=6, hi=8, wi=8, kh=5, kw=5, ph=2, pw=2, batch=16),
    ConvShape(c=6, o=16, hi=4, wi=4, kh=5, kw=5, ph=2, pw=2, batch=16),
    # no padding (smaller output), a rectangular kernel and image, two vectors
    # of samples, channel counts whose blocks are not the whole
    ConvShape(c=3, o=20, hi=7, wi=9, kh=3, kw=2, ph=0, pw=1, batch=32),
    ConvShape(c=10, o=7, hi=5, wi=5, kh=3, kw=3, ph=1, pw=1, batch=48),
]


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One kernel cache for the module's tests (each shape built once)."""
    return tmp_path_factory.mktemp("kernels") / "cache"


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch, module_cache: Path) -> None:
    """Opt in to the kernels, and skip where no C compiler builds them; the
    build happens here, when a test that needs it runs, never while pytest
    collects the tests."""
    monkeypatch.setenv(ENABLE_ENV, "1")
    monkeypatch.setenv(CACHE_ENV, str(module_cache))
    if kernels_for(SHAPES[0]) is None:
        pytest.skip("no C compiler to build the kernels")


needs_compiler = pytest.mark.usefixtures("compiled")


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """Opted in, an empty cache of the test's own (``tmp_path / "cache"``), and
    the compiler and loaded kernels looked up afresh."""
    monkeypatch.setenv(ENABLE_ENV, "1")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    conv_kernels._compiler.cache_clear()
    conv_kernels._load.cache_clear()
    yield tmp_path / "cache"
    conv_kernels._compiler.cache_clear()
    conv_kernels._load.cache_clear()


def _needs_cc() -> None:
    if conv_kernels._compiler() is None:
        pytest.skip("no C compiler")


def _node_major(t: torch.Tensor) -> torch.Tensor:
    """(nodes, batch, C, H, W) -> (nodes, H, W, C, batch), contiguous."""
    return t.permute(0, 3, 4, 2, 1).contiguous()


@needs_compiler
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernels_match_torch(shape: ConvShape) -> None:
    s = shape
    kernels = kernels_for(s)
    assert kernels is not None
    n = 3
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, s.batch, s.c, s.hi, s.wi, generator=gen)
    w = torch.randn(n, s.o, s.c, s.kh, s.kw, generator=gen) * 0.2
    bias = torch.randn(n, s.o, generator=gen)
    g = torch.randn(n, s.batch, s.o, s.ho, s.wo, generator=gen)

    ref_out: list[torch.Tensor] = []
    ref_in: list[torch.Tensor] = []
    ref_w: list[torch.Tensor] = []
    for i in range(n):
        xi = x[i].double().requires_grad_()
        wi = w[i].double().requires_grad_()
        out = nn.functional.conv2d(xi, wi, bias[i].double(), padding=(s.ph, s.pw))
        out.backward(g[i].double())
        assert xi.grad is not None and wi.grad is not None
        ref_out.append(out.detach())
        ref_in.append(xi.grad)
        ref_w.append(wi.grad)

    w_laid = w.permute(0, 1, 3, 4, 2).contiguous()  # (nodes, O, KH, KW, C)
    out = kernels.forward(_node_major(x), w_laid, bias)
    grad_in = kernels.input_grad(_node_major(g), w_laid)
    moved = w_laid.clone()
    kernels.update_weights(_node_major(g), _node_major(x), moved)
    moved_bias = bias.clone()
    again = w_laid.clone()
    kernels.update_weights(_node_major(g), _node_major(x), again, moved_bias)
    assert torch.equal(again, moved)  # the bias changes nothing of the weights'

    def close(mine: torch.Tensor, ref: torch.Tensor) -> None:
        torch.testing.assert_close(mine.double(), ref, rtol=1e-5, atol=1e-4)

    close(out.permute(0, 4, 3, 1, 2), torch.stack(ref_out))
    close(grad_in.permute(0, 4, 3, 1, 2), torch.stack(ref_in))
    close((w_laid - moved).permute(0, 1, 4, 2, 3), torch.stack(ref_w))
    close(bias - moved_bias, g.double().sum(dim=(1, 3, 4)))


@needs_compiler
def test_bad_tensors_are_refused() -> None:
    s = SHAPES[0]
    kernels = kernels_for(s)
    assert kernels is not None
    x = torch.zeros(2, s.hi, s.wi, s.c, s.batch)
    w = torch.zeros(2, s.o, s.kh, s.kw, s.c)
    with pytest.raises(ValueError, match="bias: need a contiguous float32"):
        kernels.forward(x, w, torch.zeros(2, s.o + 1))
    with pytest.raises(ValueError, match="input: need"):
        kernels.forward(x.double(), w, torch.zeros(2, s.o))
    with pytest.raises(ValueError, match="weights: need"):
        kernels.input_grad(torch.zeros(2, s.ho, s.wo, s.o, s.batch), w.transpose(2, 3))


def test_what_is_eligible() -> None:
    conv = nn.Conv2d(1, 6, 5, padding=2)
    assert eligible(conv, 16) and eligible(conv, 32)
    assert not eligible(conv, 8)  # not whole vectors of samples
    assert not eligible(nn.Conv2d(1, 6, 5, stride=2), 16)
    assert not eligible(nn.Conv2d(4, 4, 3, groups=2), 16)
    assert not eligible(nn.Conv2d(1, 6, 3, padding="same"), 16)
    assert not eligible(nn.Conv1d(1, 6, 3), 16)
    assert kernels_for(ConvShape(1, 6, 8, 8, 5, 5, 2, 2, batch=8)) is None


def test_no_compiler_means_none(monkeypatch: pytest.MonkeyPatch, fresh: Path) -> None:
    """Opted in without a compiler the kernels are not there (the caller keeps
    oneDNN)."""
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert kernels_for(ConvShape(2, 3, 6, 6, 3, 3, 1, 1, batch=16)) is None
    assert not fresh.exists()


def test_off_by_default_nothing_is_built(
    monkeypatch: pytest.MonkeyPatch, fresh: Path
) -> None:
    """Not opted in: no kernels, no compiler run, no cache directory (and,
    with the numba kernels off too, PyTorch's layout)."""
    from flowerbed.models import build_model
    from flowerbed.sims.grouped import grouped_forward
    from flowerbed.sims.grouped_sgd import GroupedSGD
    from flowerbed.sims.numba_kernels import ENABLE_ENV as NUMBA_ENV

    monkeypatch.setenv(NUMBA_ENV, "0")
    for value in (None, "0", "off", " False "):
        if value is None:
            monkeypatch.delenv(ENABLE_ENV)
        else:
            monkeypatch.setenv(ENABLE_ENV, value)
        assert kernels_for(SHAPES[0]) is None
        assert pool_kernels_for(POOLS[0]) is None
        forward = grouped_forward(build_model("lenet", 1, 8, 10))
        assert forward is not None
        step = GroupedSGD(forward)
        assert step.node_layout  # the chain could use them
        packed = step.pack(torch.zeros(2, 3, 16, 1, 8, 8))
        assert [h.dim() for h, _ in packed] == [4, 4]  # (batch, nodes x C, H, W)
    assert not fresh.exists()


def test_a_value_neither_on_nor_off_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENABLE_ENV, "maybe")
    with pytest.raises(ValueError, match="FLOWERBED_C_KERNELS='maybe': valid values"):
        kernels_for(SHAPES[0])


def test_a_compiler_without_march_native_still_builds(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fresh: Path
) -> None:
    """A compiler that refuses -march=native gets a portable build."""
    real = conv_kernels._compiler()
    if real is None:
        pytest.skip("no C compiler")
    wrapper = tmp_path / "cc-no-native"
    wrapper.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do [ "$a" = -march=native ] && '
        "{ echo 'unknown -march' >&2; exit 1; }; done\n"
        f'exec {real[0]} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("CC", str(wrapper))
    conv_kernels._compiler.cache_clear()
    shape = ConvShape(2, 3, 6, 6, 3, 3, 1, 1, batch=16)
    kernels = kernels_for(shape)
    assert kernels is not None
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 6, 6, 2, 16, generator=gen)
    w = torch.randn(1, 3, 3, 3, 2, generator=gen)
    out = kernels.forward(x, w, torch.zeros(1, 3))
    ref = nn.functional.conv2d(
        x[0].permute(3, 2, 0, 1).double(),
        w[0].permute(0, 3, 1, 2).double(),
        padding=1,
    )
    # float32 sums of 18 products against float64: tolerance as above
    torch.testing.assert_close(
        out[0].permute(3, 2, 0, 1).double(), ref, rtol=1e-5, atol=1e-4
    )


POOLS = [
    PoolShape(c=6, hi=8, wi=8, kh=2, kw=2, batch=16),  # LeNet's first
    PoolShape(c=3, hi=5, wi=7, kh=2, kw=3, batch=32),  # rows and columns left over
]


@needs_compiler
@pytest.mark.parametrize("shape", POOLS, ids=str)
def test_pooling_is_pytorchs_bit_for_bit(shape: PoolShape) -> None:
    s = shape
    kernels = pool_kernels_for(s)
    assert kernels is not None
    n = 2
    gen = torch.Generator().manual_seed(1)
    # small integers: many ties within a window; and NaN, -inf, -0.0
    x = torch.randint(-3, 3, (n, s.batch, s.c, s.hi, s.wi), generator=gen).float()
    flat = x.view(-1)
    flat[::37] = float("nan")
    flat[5::41] = float("-inf")
    flat[7::43] = -0.0
    g = torch.randn(n, s.batch, s.c, s.ho, s.wo, generator=gen)
    g.view(-1)[::29] = -0.0

    planes = x.view(n * s.batch, s.c, s.hi, s.wi)
    ref_out, ref_idx = torch.ops.aten.max_pool2d_with_indices(
        planes, [s.kh, s.kw], [s.kh, s.kw], [0, 0], [1, 1], False
    )
    ref_in = torch.ops.aten.max_pool2d_with_indices_backward(
        g.view(n * s.batch, s.c, s.ho, s.wo),
        planes,
        [s.kh, s.kw],
        [s.kh, s.kw],
        [0, 0],
        [1, 1],
        False,
        ref_idx,
    )
    out, places = kernels.forward(_node_major(x))
    grad_in = kernels.backward(_node_major(g), places)

    def back(t: torch.Tensor) -> torch.Tensor:  # (n, H, W, C, batch) -> planes
        return t.permute(0, 4, 3, 1, 2).reshape(n * s.batch, s.c, *t.shape[1:3])

    mine = back(out)
    assert torch.equal(mine.isnan(), ref_out.isnan())
    assert torch.equal(mine.nan_to_num(), ref_out.nan_to_num())
    assert torch.equal(mine.signbit(), ref_out.signbit())
    assert torch.equal(back(grad_in), ref_in)
    assert torch.equal(back(grad_in).signbit(), ref_in.signbit())


DEFINES = ConvShape(2, 3, 6, 6, 3, 3, 1, 1, batch=16).defines()


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_the_cache_is_private_and_each_build_recorded(fresh: Path) -> None:
    _needs_cc()
    library = conv_kernels._compiled(DEFINES)
    assert library is not None and library.parent == fresh
    record = json.loads(library.with_suffix(".json").read_text())
    assert _mode(fresh) == 0o700
    assert _mode(library) == _mode(library.with_suffix(".json")) == 0o600
    assert record["sha256"] == hashlib.sha256(library.read_bytes()).hexdigest()
    assert (
        record["source_sha256"]
        == hashlib.sha256(conv_kernels.SOURCE.encode()).hexdigest()
    )
    assert record["defines"] == DEFINES
    assert conv_kernels._verified(library) is None
    assert conv_kernels._compiled(DEFINES) == library  # found, not rebuilt
    assert record == json.loads(library.with_suffix(".json").read_text())


@pytest.mark.parametrize(
    ("tamper", "reason"),
    [
        (lambda lib: lib.write_bytes(lib.read_bytes() + b"\0"), "does not match"),
        (lambda lib: lib.chmod(0o644), "mode 644, not private"),
        (lambda lib: lib.with_suffix(".json").unlink(), "json: missing"),
        (
            lambda lib: lib.with_suffix(".json").write_text('{"sha256": "0"}'),
            "another source",
        ),
    ],
    ids=["content", "mode", "no-record", "foreign-record"],
)
def test_a_build_that_fails_its_checks_is_not_loaded_but_rebuilt(
    fresh: Path, caplog: pytest.LogCaptureFixture, tamper: object, reason: str
) -> None:
    _needs_cc()
    library = conv_kernels._compiled(DEFINES)
    assert library is not None
    tamper(library)  # type: ignore[operator]
    problem = conv_kernels._verified(library)
    assert problem is not None and reason in problem
    with caplog.at_level(logging.WARNING, logger=conv_kernels.__name__):
        assert conv_kernels._compiled(DEFINES) == library
    assert "failed its checks" in caplog.text and reason in caplog.text
    assert conv_kernels._verified(library) is None  # rebuilt whole


def test_a_file_of_another_user_is_not_trusted(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    mine = tmp_path / "conv_x.so"
    mine.write_bytes(b"x")
    mine.chmod(0o600)
    assert conv_kernels._unsafe_file(mine) is None
    monkeypatch.setattr(os, "getuid", lambda: os.stat(mine).st_uid + 1)
    assert "not by this user" in (conv_kernels._unsafe_file(mine) or "")
    link = tmp_path / "conv_y.so"
    link.symlink_to(mine)
    assert conv_kernels._unsafe_file(link) == "not a regular file"


def test_a_cache_others_may_write_to_or_own_is_refused(
    monkeypatch: pytest.MonkeyPatch, fresh: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fresh.mkdir(mode=0o700)
    fresh.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger=conv_kernels.__name__):
        assert private_cache() is None
        assert conv_kernels._compiled(DEFINES) is None
    assert "others may write to it (mode 777)" in caplog.text
    assert not list(fresh.iterdir())  # nothing built there
    fresh.chmod(0o755)  # ours, readable by others: made private
    assert private_cache() == fresh and _mode(fresh) == 0o700
    monkeypatch.setattr(os, "getuid", lambda: os.stat(fresh).st_uid + 1)
    assert private_cache() is None


def _fake_build(where: Path, name: str, source: str, built: float) -> Path:
    library = where / f"conv_{name}.so"
    library.write_bytes(name.encode())
    record = {"sha256": "", "source_sha256": source, "built": built}
    library.with_suffix(".json").write_text(json.dumps(record))
    return library


def test_prune_removes_other_sources_strays_and_the_oldest_beyond_the_limit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    today = hashlib.sha256(conv_kernels.SOURCE.encode()).hexdigest()
    monkeypatch.setattr(conv_kernels, "MAX_BUILDS", 2)
    old = _fake_build(tmp_path, "old", "another source", 5.0)
    a = _fake_build(tmp_path, "a", today, 1.0)
    b = _fake_build(tmp_path, "b", today, 2.0)
    c = _fake_build(tmp_path, "c", today, 3.0)
    stray = tmp_path / "conv_stray.so"  # no record
    stray.write_bytes(b"")
    orphan = tmp_path / "conv_orphan.json"  # no library
    orphan.write_text("{}")
    other = tmp_path / "notes.txt"  # not a build: left alone
    other.write_text("")
    young = tmp_path / "conv_young.so"  # maybe another process's, its record next
    young.write_bytes(b"")
    old_enough = time.time() - conv_kernels.STRAY_AGE_S - 1
    for path in (stray, orphan):
        os.utime(path, (old_enough, old_enough))
    removed = prune(tmp_path, keep=a)  # a: just built, kept whatever its date
    left = sorted(p.name for p in tmp_path.iterdir())
    kept = ["conv_a.so", "conv_a.json", "conv_c.so", "conv_c.json", "conv_young.so"]
    assert left == sorted([*kept, "notes.txt"])
    assert set(removed) == {
        old,
        old.with_suffix(".json"),
        b,
        b.with_suffix(".json"),
        stray,
        orphan,
    }
    assert c.exists()


def test_collecting_the_tests_compiles_nothing(tmp_path: Path) -> None:
    """Opted in and with an empty cache, pytest's collection of the kernel
    tests builds nothing (the builds happen in fixtures and tests)."""
    env = {**os.environ, ENABLE_ENV: "1", CACHE_ENV: str(tmp_path / "cache")}
    here = Path(__file__).parent
    files = ["test_conv_kernels.py", "test_batched.py", "test_kernel_inference.py"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist"]
        + [str(here / f) for f in files],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert not (tmp_path / "cache").exists()
