"""Fused tile geometry against hand-computed regions (no torch.distributed).

Regions are half-open: ``Rect(top, bottom, left, right)`` holds rows
``top..bottom-1`` and columns ``left..right-1``.
"""

from __future__ import annotations

import pytest
import torch
from flowerbed.parallel.tiles.region_ops import SUPPORTED, front_geometry, op_of
from flowerbed.parallel.tiles.regions import (
    NEG_INF,
    POINTWISE,
    WINDOW,
    Op,
    Rect,
    TileError,
    apportion,
    auto_bands,
    tile_grid,
    trace_group,
)
from torch import nn

CONV3 = Op("conv3", WINDOW, (3, 3), (1, 1), (1, 1), out_channels=2)
CONV3_S2 = Op("conv3s2", WINDOW, (3, 3), (2, 2), (1, 1))
POOL2 = Op("pool2", WINDOW, (2, 2), (2, 2), pad_value=NEG_INF)
RELU = Op("relu", POINTWISE)


def test_two_same_convolutions_need_one_more_row_each() -> None:
    # Top half of an 8x8 map through two 3x3 "same" convs: the second conv reads
    # rows -1..4 (row -1 is border padding), so the first must produce rows 0..4,
    # which read rows -1..5: the device holds input rows 0..5, a halo of 2 rows.
    trace = trace_group([CONV3, CONV3], (1, 8, 8), Rect(0, 4, 0, 8))
    first, second = trace.ops
    assert second.need == Rect(-1, 5, -1, 9)
    assert second.held == Rect(0, 5, 0, 8)
    assert second.padding == (1, 0, 1, 1)  # top, bottom, left, right
    assert first.out == Rect(0, 5, 0, 8)
    assert first.need == Rect(-1, 6, -1, 9)
    assert trace.input == Rect(0, 6, 0, 8)
    assert trace.owned_input == Rect(0, 4, 0, 8)
    assert trace.halo == (0, 2, 0, 0)


def test_the_bottom_tile_pads_only_at_the_true_border() -> None:
    trace = trace_group([CONV3, CONV3], (1, 8, 8), Rect(4, 8, 0, 8))
    first, second = trace.ops
    assert second.need == Rect(3, 9, -1, 9)
    assert second.padding == (0, 1, 1, 1)
    assert first.out == Rect(3, 8, 0, 8)
    assert first.padding == (0, 1, 1, 1)
    assert trace.input == Rect(2, 8, 0, 8)
    assert trace.halo == (2, 0, 0, 0)


def test_stride_two_conv_and_pool_double_the_region() -> None:
    # 16x16 -> conv 3x3 stride 2 pad 1 -> 8x8 -> max-pool 2x2 -> 4x4.
    # Output rows 2..3: the pool reads conv rows 4..7 (o*2 .. (o1-1)*2 + 2);
    # the conv's row 4 reads input rows 7..9 and row 7 reads 13..15: rows 7..15.
    # Columns 0..3 of the output: pool cols 0..7, conv cols -1..15.
    trace = trace_group([CONV3_S2, POOL2], (1, 16, 16), Rect(2, 4, 0, 4))
    conv, pool = trace.ops
    assert pool.need == Rect(4, 8, 0, 8)
    assert pool.padding == (0, 0, 0, 0)
    assert conv.out == Rect(4, 8, 0, 8)
    assert conv.need == Rect(7, 16, -1, 16)
    assert conv.padding == (0, 0, 1, 0)
    assert trace.input == Rect(7, 16, 0, 16)
    # Owned rows: pool boundary 2 -> 2*2 = 4 -> conv boundary 4*2 - 1 + 1 = 8.
    assert trace.owned_input == Rect(8, 16, 0, 16)
    assert trace.halo == (1, 0, 0, 0)


def test_dilation_and_padded_pooling() -> None:
    dilated = Op("dil", WINDOW, (3, 3), (1, 1), (2, 2), (2, 2))
    pool = Op("pool3s2", WINDOW, (3, 3), (2, 2), (1, 1), pad_value=NEG_INF)
    # 3x3 dilation 2 spans 5 pixels: outputs 3..5 read 1..7.
    assert dilated.need(Rect(3, 6, 0, 1)) == Rect(1, 8, -2, 3)
    # 3x3 stride 2 pad 1 pooling of a 9-wide map: 5 outputs; output 4 reads
    # inputs 7..9, input 9 is -inf padding.
    assert pool.out_size(9, 9) == (5, 5)
    trace = trace_group([pool], (1, 9, 9), Rect(4, 5, 4, 5))
    assert trace.ops[0].need == Rect(7, 10, 7, 10)
    assert trace.ops[0].padding == (0, 1, 0, 1)
    assert trace.ops[0].op.pad_value == NEG_INF


def test_pointwise_ops_need_exactly_their_output() -> None:
    trace = trace_group([CONV3, RELU], (1, 8, 8), Rect(0, 4, 0, 4))
    conv, relu = trace.ops
    assert relu.need == relu.out == Rect(0, 4, 0, 4)
    assert conv.out == Rect(0, 4, 0, 4)
    assert trace.input == Rect(0, 5, 0, 5)


def test_a_tile_smaller_than_its_halo_is_refused() -> None:
    # Eight 3x3 convs need a halo of 8 rows; a 4-row tile cannot carry it.
    with pytest.raises(TileError, match="smaller than its halo") as err:
        trace_group([CONV3] * 8, (1, 16, 16), Rect(4, 8, 0, 16), where="group 0")
    assert "owns 4x16 input pixels but needs a halo of 8 rows" in str(err.value)
    assert "fewer devices or a shallower group" in str(err.value)


def test_an_empty_tile_is_refused() -> None:
    with pytest.raises(TileError, match="a tile is empty"):
        trace_group([CONV3], (1, 8, 8), Rect(3, 3, 0, 8))


# --- tile grids ---------------------------------------------------------------------


def test_shares_follow_the_weights_with_largest_remainders() -> None:
    # 16 pixels for weights 1:2:1 -> 4, 8, 4; 10 for 1:1:1 -> 3.33 each: the
    # first remainder wins the leftover pixel.
    assert apportion(16, [1, 2, 1]) == [4, 8, 4]
    assert apportion(10, [1, 1, 1]) == [4, 3, 3]
    assert apportion(7, [3, 1]) == [5, 2]  # 5.25 and 1.75: 1.75 takes the extra
    with pytest.raises(TileError, match="cannot give every one of 3 devices"):
        apportion(2, [1, 1, 1])


def test_bands_minimise_the_tiles_perimeter() -> None:
    # D = 6 on a square: 1 band 6*H + W = 7H, 2 bands 3H + 2W = 5H, 3 bands
    # 2H + 3W = 5H (tie: fewer bands), 6 bands H + 6W = 7H.
    assert auto_bands(416, 416, 6) == 2
    assert auto_bands(416, 416, 4) == 2
    assert auto_bands(416, 416, 2) == 1
    assert auto_bands(64, 16, 4) == 4  # a tall map is cut into rows


def test_a_grid_gives_faster_devices_larger_tiles() -> None:
    # Three devices, the second twice as fast, on 16x16: two bands (ranks 0, 1
    # weigh 3, rank 2 weighs 1): rows 12 and 4; band 0 columns 16/3 and 32/3
    # -> 5 and 11 (largest remainder).
    tiles = tile_grid(16, 16, [1, 2, 1])
    assert tiles == [Rect(0, 12, 0, 5), Rect(0, 12, 5, 16), Rect(12, 16, 0, 16)]
    assert [t.area for t in tiles] == [60, 132, 64]  # ideal 64, 128, 64
    equal = tile_grid(12, 12, [1] * 6)
    assert sorted({t.area for t in equal}) == [24]
    assert sum(t.area for t in equal) == 144


# --- reading torch models -------------------------------------------------------------


def test_torch_layers_become_ops() -> None:
    conv = op_of("0.0", nn.Conv2d(3, 8, 5, stride=2, padding=2, groups=1), 3, "sync")
    assert (conv.kernel, conv.stride, conv.padding) == ((5, 5), (2, 2), (2, 2))
    assert conv.macs_per_pixel == 8 * 3 * 25
    same = op_of("1", nn.Conv2d(4, 4, 3, padding="same", dilation=2), 4, "sync")
    assert same.padding == (2, 2)
    pool = op_of("2", nn.MaxPool2d(3, 2, 1), 4, "sync")
    assert pool.pad_value == NEG_INF and pool.kind == WINDOW
    batch = op_of("3", nn.BatchNorm2d(4), 4, "sync")
    assert batch.kind == "norm" and batch.statistics(8) == 4
    group = op_of("4", nn.GroupNorm(2, 4), 4, "sync")
    assert group.statistics(8) == 16  # 2 groups per sample
    assert op_of("5", nn.BatchNorm2d(4), 4, "frozen").kind == POINTWISE


@pytest.mark.parametrize(
    ("module", "why"),
    [
        (nn.Upsample(scale_factor=2), "Upsample"),
        (nn.Dropout(0.5), "Dropout"),
        (nn.MaxPool2d(2, ceil_mode=True), "ceil_mode=True"),
        (nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"), "reflect"),
        (nn.AvgPool2d(3, 1, 1, count_include_pad=False), "count_include_pad"),
    ],
)
def test_an_unknown_layer_is_named_with_what_is_supported(
    module: nn.Module, why: str
) -> None:
    with pytest.raises(TileError) as err:
        op_of("2.1", module, 2, "sync")
    text = str(err.value)
    assert f"layer 2.1 ({type(module).__name__})" in text
    assert why in text
    assert SUPPORTED in text


def test_the_front_stops_at_the_first_layer_it_cannot_tile() -> None:
    model = nn.Sequential(
        nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU()),
        nn.MaxPool2d(2),
        nn.Upsample(scale_factor=2),
        nn.Sequential(nn.Flatten(), nn.Linear(4 * 8 * 8, 3)),
    )
    geometry = front_geometry(model, (1, 8, 8))
    assert geometry.tileable == 2
    assert "layer 2 (Upsample) cannot be tiled" in geometry.stop
    assert geometry.num_layers == 4
    # head MACs per sample from layer F on: the conv (8*8*4*9) then the linear.
    linear = 4 * 8 * 8 * 3
    assert geometry.head_macs == (8 * 8 * 4 * 9 + linear, linear, linear)
    assert geometry.layer_params == (40, 0, 0, 4 * 8 * 8 * 3 + 3)
    assert geometry.shapes() == [(1, 8, 8), (4, 8, 8), (4, 4, 4)]


def test_regions_of_a_real_stack_reproduce_the_full_map() -> None:
    # One device per band of a conv/pool/conv stack with stride and padding:
    # each tile computed from its region alone equals the full map's pixels.
    from flowerbed.parallel.tiles.region_ops import RegionOp, layer_ops, run_group

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Conv2d(2, 3, 3, stride=2, padding=1), nn.ReLU()),
        nn.MaxPool2d(3, 2, 1),
        nn.Sequential(nn.Conv2d(3, 3, 3, padding=2, dilation=2), nn.Tanh()),
        nn.AvgPool2d(2),
        nn.Flatten(),  # the head: the model's last layer is never tiled
    )
    x = torch.randn(2, 2, 96, 64)
    full = model[:4](x)
    geometry = front_geometry(model, (2, 96, 64), costs=False)
    ops = [op for layer in geometry.layers for op in layer]
    modules = [
        RegionOp(m, "sync")
        for i, layer in enumerate(model[:4])
        for _, m in layer_ops(i, layer, 0, "sync")
    ]
    for tile in tile_grid(full.shape[2], full.shape[3], [1, 2, 1], bands=1):
        trace = trace_group(ops, (2, 96, 64), tile)
        region = trace.input
        out = run_group(
            modules,
            trace.ops,
            x[:, :, region.top : region.bottom, region.left : region.right],
        )
        expected = full[:, :, tile.top : tile.bottom, tile.left : tile.right]
        torch.testing.assert_close(out, expected)
