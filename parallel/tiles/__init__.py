"""Fused-tile training (Rama, Threadgill, Gerstlauer, arXiv 2409.09083): the
feature maps of a CNN's first layers cut into tiles, one per board, trained
exactly.

- :mod:`~flowerbed.parallel.tiles.regions` — the tracer: the input region each
  output tile needs, tile grids sized to device speed (pure).
- :mod:`~flowerbed.parallel.tiles.layout` — a model's geometry, every rank's
  regions and the pieces exchanged at group boundaries (pure).
- :mod:`~flowerbed.parallel.tiles.grouping` — the step's cost model and the
  grouping DP under memory (pure).
- :mod:`~flowerbed.parallel.tiles.region_ops` — torch layers as ops, ops on
  regions, normalisation statistics shared across boards.
- :mod:`~flowerbed.parallel.tiles.exact_step` — one member's exact tiled step.
- :mod:`~flowerbed.parallel.tiles.runner` — the member's side: the ``tiles``
  mode's runner, profiler and evaluator.

Importing this package imports no torch; the names the former module
``flowerbed.parallel.tiles`` held resolve from
:mod:`~flowerbed.parallel.tiles.regions` with a :class:`DeprecationWarning` for
one release.
"""

from __future__ import annotations

from flowerbed.moved import moved_names

__getattr__ = moved_names(
    __name__,
    dict.fromkeys(
        (
            "KINDS",
            "NEG_INF",
            "NORM",
            "PAD_VALUES",
            "POINTWISE",
            "WINDOW",
            "ZERO",
            "GroupTrace",
            "Layer",
            "Op",
            "OpRegion",
            "Pair",
            "Rect",
            "TileError",
            "apportion",
            "auto_bands",
            "band_sizes",
            "flatten",
            "layer_shapes",
            "map_shapes",
            "tile_grid",
            "trace_group",
        ),
        "flowerbed.parallel.tiles.regions",
    ),
)
