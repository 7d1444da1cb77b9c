"""A TiledTraining round's figures, from its plan and its members' replies.

Per round (``Result.train_metrics_clientapp``): whether the segment completed,
the plan (boards, tiled layers, groups, predicted step seconds, tile areas) and
the slowest member's measured step, compute and link seconds, activation bytes
and peak RSS.
"""

from __future__ import annotations

from collections.abc import Mapping

from flowerbed import keys

from .span import SegmentReply
from .tile_segment import SegmentPlan

SEGMENT_OK = "tiles-segment-ok"
DEVICES = "tiles-devices"
FRONT = "tiles-front"
GROUPS = "tiles-groups"
PREDICTED_STEP_S = "tiles-predicted-step-s"
TILE_AREAS = "tiles-areas"
"""Pixels of each rank's tile of the first tiled group's output (the largest
map), in rank order."""
SLOWEST = (
    keys.SPAN_STEP_S,
    keys.TILES_COMPUTE_S,
    keys.TILES_LINK_S,
    keys.TILES_ACTIVATION_BYTES,
    keys.TILES_PEAK_RSS_BYTES,
)
"""Member metrics a round reports as their largest value over the members."""

Figures = dict[str, int | float | list[int] | list[float]]


def segment_figures(
    segment: SegmentPlan,
    complete: bool,
    areas: list[int],
    replies: Mapping[int, SegmentReply],
) -> Figures:
    """The round's figures before the weights are taken (``num-examples`` 0)."""
    figures: Figures = {
        SEGMENT_OK: int(complete),
        DEVICES: len(segment.boards),
        FRONT: segment.tile_plan.front,
        GROUPS: len(segment.tile_plan.bounds) - 1,
        PREDICTED_STEP_S: segment.tile_plan.cost.total_s,
        TILE_AREAS: areas,
        keys.NUM_EXAMPLES: 0,
    }
    for key in SLOWEST:
        values = [float(r.metrics[key]) for r in replies.values() if key in r.metrics]
        if values:
            figures[key] = max(values)
    return figures
