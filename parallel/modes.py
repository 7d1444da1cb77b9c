"""The runners a board's span ClientApp can execute, by plan ``mode``.

A runner is ``run(plan, context, arrays) -> MemberResult`` (train messages), a
profiler ``profile(query, context) -> MemberResult`` (query messages; ``query`` is
the decoded ``span-query`` JSON) and an evaluator
``evaluate(query, context, arrays) -> MemberResult`` (evaluate messages).
``arrays`` maps full-model state names to NumPy arrays (optimiser state under
``"momentum:" + name``). They are named here as ``"module:function"`` strings
and imported on first use, so a board only imports what its job needs. A new
kind of job (large-batch all-reduce, fused tiles) adds one line to
:data:`RUNNERS` (and to :data:`PROFILERS` and :data:`EVALUATORS` if it has them).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

RUNNERS: dict[str, str] = {
    "probe": "flowerbed.parallel.probe:run",
    "allreduce": "flowerbed.parallel.large_batch.allreduce:run",
    "tiles": "flowerbed.parallel.tiles.runner:run",
    "pipeline": "flowerbed.parallel.pipeline.stage:run_segment",
}
"""Plan mode -> runner of a train message."""

PROFILERS: dict[str, str] = {
    "probe": "flowerbed.parallel.probe:profile",
    "allreduce": "flowerbed.parallel.large_batch.allreduce:profile",
    "tiles": "flowerbed.parallel.tiles.runner:profile",
    "pipeline": "flowerbed.parallel.pipeline.stage:profile",
}
"""Query mode -> profiler of a query message."""

EVALUATORS: dict[str, str] = {
    "allreduce": "flowerbed.parallel.large_batch.allreduce:evaluate",
    "tiles": "flowerbed.parallel.tiles.runner:evaluate",
}
"""Mode -> evaluator of the whole model (evaluate messages). Modes without one
(pipeline) get the span ClientApp's evaluation of the layered model named in the
query."""


def resolve(table: dict[str, str], mode: str) -> Callable[..., Any]:
    """Import the function registered for ``mode``; unknown modes list the choices."""
    if mode not in table:
        raise ValueError(
            f"unknown span mode {mode!r}; valid choices: {', '.join(sorted(table))}"
        )
    module, _, name = table[mode].partition(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]
