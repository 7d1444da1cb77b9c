"""The compiled convolution kernels against PyTorch's convolution in float64."""

from __future__ import annotations

import pytest
import torch
from flowerbed.sims import conv_kernels
from flowerbed.sims.conv_kernels import (
    ConvShape,
    PoolShape,
    eligible,
    kernels_for,
    pool_kernels_for,
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
def compiled() -> None:
    """Skip where no C compiler builds the kernels; the build happens here, when a
    test that needs it runs, never while pytest collects the tests."""
    if kernels_for(SHAPES[0]) is None:
        pytest.skip("no C compiler to build the kernels")


needs_compiler = pytest.mark.usefixtures("compiled")


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


def test_no_compiler_means_none(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Without a compiler the kernels are not there (the caller keeps oneDNN)."""
    monkeypatch.setenv("CC", "no-such-compiler-here")
    monkeypatch.setenv("FLOWERBED_KERNEL_CACHE", str(tmp_path))
    conv_kernels._compiler.cache_clear()
    conv_kernels._load.cache_clear()
    try:
        assert kernels_for(ConvShape(2, 3, 6, 6, 3, 3, 1, 1, batch=16)) is None
        assert not any(tmp_path.iterdir())
    finally:
        conv_kernels._compiler.cache_clear()
        conv_kernels._load.cache_clear()


def test_without_kernels_the_step_keeps_onednn(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """No compiler: the written-out step lays LeNet's images out for oneDNN."""
    from flowerbed.models import build_model
    from flowerbed.sims.grouped import grouped_forward
    from flowerbed.sims.grouped_sgd import GroupedSGD

    monkeypatch.setenv("CC", "no-such-compiler-here")
    monkeypatch.setenv("FLOWERBED_KERNEL_CACHE", str(tmp_path))
    conv_kernels._compiler.cache_clear()
    conv_kernels._load.cache_clear()
    try:
        forward = grouped_forward(build_model("lenet", 1, 8, 10))
        assert forward is not None
        step = GroupedSGD(forward)
        assert step.node_layers is not None  # the chain could use them
        packed = step.pack(torch.zeros(2, 3, 16, 1, 8, 8))
        assert [h.dim() for h, _ in packed] == [4, 4]  # (batch, nodes x C, H, W)
    finally:
        conv_kernels._compiler.cache_clear()
        conv_kernels._load.cache_clear()


def test_a_compiler_without_march_native_still_builds(
    monkeypatch: pytest.MonkeyPatch, tmp_path
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
    monkeypatch.setenv("FLOWERBED_KERNEL_CACHE", str(tmp_path / "cache"))
    conv_kernels._compiler.cache_clear()
    conv_kernels._load.cache_clear()
    try:
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
    finally:
        conv_kernels._compiler.cache_clear()
        conv_kernels._load.cache_clear()


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
