"""Pipeline training (FTPipeHD, Chen et al., arXiv 2110.02781): the layers of one
model split over unequal boards, with re-partitioning and recovery.

- :mod:`~flowerbed.parallel.pipeline.partition` — the partition DP (pure).
- :mod:`~flowerbed.parallel.pipeline.makespan` — the 1F1B/GPipe makespan model
  with links, replication and recovery (pure; the virtual clock).
- :mod:`~flowerbed.parallel.pipeline.planner` — :class:`PipelinePlanner`, the
  planning state between segments: powers, links, layouts (pure).
- :mod:`~flowerbed.parallel.pipeline.recovery` — which step to restart from and
  where each layer comes from after a loss (pure).
- :mod:`~flowerbed.parallel.pipeline.stage` — the member's side: profile the
  layers, run a segment as a ``torch.distributed.pipelining`` stage.

Importing this package imports no torch; the names the former module
``flowerbed.parallel.pipeline`` held resolve from
:mod:`~flowerbed.parallel.pipeline.stage` with a :class:`DeprecationWarning`
for one release.
"""

from __future__ import annotations

from flowerbed.moved import moved_names

_STAGE = "flowerbed.parallel.pipeline.stage"

__getattr__ = moved_names(
    __name__,
    dict.fromkeys(
        (
            "CRASH_EXIT_CODE",
            "INPUT_SHAPE",
            "KEEP_REPLICATIONS",
            "LOCAL_DATASET",
            "check_pipeline_plan",
            "job_data",
            "profile",
            "run_segment",
            "stage_module",
        ),
        _STAGE,
    ),
)
