"""The numba kernels of the node layout against PyTorch (convolutions in
float64, pooling bit for bit), and which kernels a shape gets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from flowerbed.sims.conv_kernels import ENABLE_ENV as C_ENV
from flowerbed.sims.conv_kernels import ConvShape, PoolShape
from flowerbed.sims.numba_kernels import (
    ENABLE_ENV,
    NumbaConvKernels,
    NumbaPoolKernels,
    kernels_for,
    pool_kernels_for,
)
from torch import nn

SHAPES = [
    # LeNet on digits: its two convolutions
    ConvShape(c=1, o=6, hi=8, wi=8, kh=5, kw=5, ph=2, pw=2, batch=16),
    ConvShape(c=6, o=16, hi=4, wi=4, kh=5, kw=5, ph=2, pw=2, batch=16),
    # no padding (smaller output), a rectangular kernel and image, two vectors
    # of samples, channel counts that are not whole blocks of 8
    ConvShape(c=3, o=20, hi=7, wi=9, kh=3, kw=2, ph=0, pw=1, batch=32),
    ConvShape(c=10, o=7, hi=5, wi=5, kh=3, kw=3, ph=1, pw=1, batch=48),
    # a window as large as the padded image: one output position
    ConvShape(c=2, o=9, hi=3, wi=3, kh=5, kw=5, ph=1, pw=1, batch=16),
]
POOLS = [
    PoolShape(c=6, hi=8, wi=8, kh=2, kw=2, batch=16),  # LeNet's first
    PoolShape(c=3, hi=5, wi=7, kh=2, kw=3, batch=32),  # rows and columns left over
]


@pytest.fixture(autouse=True)
def _default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not opted in to the C kernels, the numba ones not turned off."""
    monkeypatch.delenv(C_ENV, raising=False)
    monkeypatch.delenv(ENABLE_ENV, raising=False)


def _node_major(t: torch.Tensor) -> torch.Tensor:
    """(nodes, batch, C, H, W) -> (nodes, H, W, C, batch), contiguous."""
    return t.permute(0, 3, 4, 2, 1).contiguous()


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_convolutions_match_torch(shape: ConvShape) -> None:
    s = shape
    kernels = kernels_for(s)
    assert isinstance(kernels, NumbaConvKernels)
    n = 3
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, s.batch, s.c, s.hi, s.wi, generator=gen)
    w = torch.randn(n, s.o, s.c, s.kh, s.kw, generator=gen) * 0.2
    bias = torch.randn(n, s.o, generator=gen)
    g = torch.randn(n, s.batch, s.o, s.ho, s.wo, generator=gen)
    ref_out, ref_in, ref_w = [], [], []
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
        # float32 sums of up to 250 products against float64, as for the C
        # kernels (tests/test_conv_kernels.py)
        torch.testing.assert_close(mine.double(), ref, rtol=1e-5, atol=1e-4)

    close(out.permute(0, 4, 3, 1, 2), torch.stack(ref_out))
    close(grad_in.permute(0, 4, 3, 1, 2), torch.stack(ref_in))
    close((w_laid - moved).permute(0, 1, 4, 2, 3), torch.stack(ref_w))
    close(bias - moved_bias, g.double().sum(dim=(1, 3, 4)))


@pytest.mark.parametrize("shape", POOLS, ids=str)
def test_pooling_is_pytorchs_bit_for_bit(shape: PoolShape) -> None:
    s = shape
    kernels = pool_kernels_for(s)
    assert isinstance(kernels, NumbaPoolKernels)
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
    window = [s.kh, s.kw]
    planes = x.view(n * s.batch, s.c, s.hi, s.wi)
    ref_out, ref_idx = torch.ops.aten.max_pool2d_with_indices(
        planes, window, window, [0, 0], [1, 1], False
    )
    ref_in = torch.ops.aten.max_pool2d_with_indices_backward(
        g.view(n * s.batch, s.c, s.ho, s.wo),
        planes,
        window,
        window,
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


def test_turned_off_or_not_whole_vectors_means_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The caller keeps oneDNN."""
    assert kernels_for(ConvShape(1, 6, 8, 8, 5, 5, 2, 2, batch=8)) is None
    assert pool_kernels_for(PoolShape(6, 8, 8, 2, 2, batch=24)) is None
    for off in ("0", "off", " False "):
        monkeypatch.setenv(ENABLE_ENV, off)
        assert kernels_for(SHAPES[0]) is None
        assert pool_kernels_for(POOLS[0]) is None
    monkeypatch.setenv(ENABLE_ENV, "maybe")
    with pytest.raises(ValueError, match="FLOWERBED_NUMBA_KERNELS='maybe': valid"):
        kernels_for(SHAPES[0])


def test_the_c_kernels_win_when_opted_in(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from flowerbed.sims import conv_kernels

    monkeypatch.setenv(C_ENV, "1")
    monkeypatch.setenv(conv_kernels.CACHE_ENV, str(tmp_path / "cache"))
    if conv_kernels.kernels_for(SHAPES[0]) is None:
        pytest.skip("no C compiler to build the kernels")
    assert isinstance(kernels_for(SHAPES[0]), conv_kernels.ConvKernels)
    assert isinstance(pool_kernels_for(POOLS[0]), conv_kernels.PoolKernels)


def test_importing_the_simulator_compiles_nothing(tmp_path: Path) -> None:
    """numba is imported, and the kernels compiled or loaded from its cache,
    at their first call, not when the simulator or these tests are imported
    or collected."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    code = (
        "import sys\n"
        "import flowerbed.sims.grouped_sgd, flowerbed.sims.kernel_inference\n"
        "import flowerbed.sims.numba_kernels\n"
        "assert 'numba' not in sys.modules, 'numba imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    here = Path(__file__).parent
    files = ["test_numba_kernels.py", "test_batched.py", "test_kernel_inference.py"]
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
    assert not (tmp_path / "numba").exists()
