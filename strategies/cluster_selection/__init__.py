"""ClusterSelection: profile briefly, pick the best set of nodes, train on it.

Gu, Kong, Munir, Kim, "A Framework for Distributed Deep Learning Training with
Heterogeneous Computing Platforms", 2019. Four ideas, one module each:

- :mod:`.model`: what a configuration costs (fitted node models, time, energy,
  EDP and time-to-accuracy estimates);
- :mod:`.search`: which configurations are considered, the best one, and how sure
  that choice is;
- :mod:`.refine`: refinement (rehearse the nodes the choice hinges on) and racing
  (train some rounds on rivals);
- :mod:`.strategy`: the Flower strategy, with :mod:`.selection_options` (its option
  objects), :mod:`.profiling` (the profiling phase on a Grid), :mod:`.observe`
  (reading replies) and :mod:`.selector` (the chosen configuration during
  training).

The cost model, search and refinement use no Flower machinery, so the benchmark's
evaluation (``flowerbed.bench.selection_eval``) shares them with the strategy.

``flowerbed.strategies.cluster_selection.training`` (now :mod:`.selector`) still
imports for one release, with a :class:`DeprecationWarning`.
"""

from flowerbed.moved import alias_modules

from .model import (
    MODES,
    OBJECTIVES,
    Estimate,
    NodeModel,
    Observation,
    Workload,
    estimate,
    estimate_masks,
    expected_max,
    fit_node,
    pool_variances,
)
from .observe import observation_of, timed_exchange
from .profiling import Profiler
from .refine import (
    DEFAULT_INDIFFERENCE,
    DEFAULT_PROFILE_BUDGET,
    DEFAULT_RACE_SHARE,
    DEFAULT_TARGET_CONFIDENCE,
    RACE_GREEDY_EVERY,
    RaceState,
    expected_round_trip,
    informative_nodes,
    profiling_end,
    race_next,
    rehearsal_steps,
    settled_confidence,
)
from .search import (
    CONFIDENCE_DRAWS,
    EXHAUSTIVE_MAX_NODES,
    Confidence,
    all_masks,
    confidence,
    prefix_masks,
    search_masks,
    select,
)
from .selection_options import Certainty, Profiling, SelectionGoal, Tracking
from .selector import (
    SELECTION_ESTIMATED_S,
    SELECTION_MEASURED_S,
    SELECTION_SIZE,
    SelectedGrid,
    SelectionRecord,
)
from .strategy import ClusterSelection

__all__ = [
    "CONFIDENCE_DRAWS",
    "DEFAULT_INDIFFERENCE",
    "DEFAULT_PROFILE_BUDGET",
    "DEFAULT_RACE_SHARE",
    "DEFAULT_TARGET_CONFIDENCE",
    "EXHAUSTIVE_MAX_NODES",
    "MODES",
    "OBJECTIVES",
    "RACE_GREEDY_EVERY",
    "SELECTION_ESTIMATED_S",
    "SELECTION_MEASURED_S",
    "SELECTION_SIZE",
    "Certainty",
    "ClusterSelection",
    "Confidence",
    "Estimate",
    "NodeModel",
    "Observation",
    "Profiler",
    "Profiling",
    "RaceState",
    "SelectedGrid",
    "SelectionGoal",
    "SelectionRecord",
    "Tracking",
    "Workload",
    "all_masks",
    "confidence",
    "estimate",
    "estimate_masks",
    "expected_max",
    "expected_round_trip",
    "fit_node",
    "informative_nodes",
    "observation_of",
    "pool_variances",
    "prefix_masks",
    "profiling_end",
    "race_next",
    "rehearsal_steps",
    "search_masks",
    "select",
    "settled_confidence",
    "timed_exchange",
]

alias_modules(
    {
        "flowerbed.strategies.cluster_selection.training": (
            "flowerbed.strategies.cluster_selection.selector"
        )
    }
)
