"""Drop-in Flower strategies for fleets of unequal devices.

``PipelineTraining`` (one model across several boards) imports torch, so it is
imported on first use: ``import flowerbed.strategies`` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .cluster_selection import ClusterSelection
from .deadline import DeadlineFedAvg
from .fedbuff import FedBuff
from .large_batch_rounds import LargeBatchRounds
from .large_batch_sync import LargeBatchSync
from .runtime_weighted import RuntimeWeightedFedAvg
from .tiled import TiledTraining
from .wrappers import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
)

if TYPE_CHECKING:
    from .pipeline import PipelineTraining

_LAZY = {"PipelineTraining": "flowerbed.strategies.pipeline"}

__all__ = [
    "ClusterSelection",
    "DeadlineFedAvg",
    "DifferentialPrivacyClientSideAdaptiveClipping",
    "DifferentialPrivacyClientSideFixedClipping",
    "DifferentialPrivacyServerSideAdaptiveClipping",
    "DifferentialPrivacyServerSideFixedClipping",
    "FedBuff",
    "LargeBatchRounds",
    "LargeBatchSync",
    "PipelineTraining",
    "RuntimeWeightedFedAvg",
    "TiledTraining",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
