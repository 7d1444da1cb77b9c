"""Drop-in Flower strategies for fleets of unequal devices."""

from .cluster_selection import ClusterSelection
from .deadline import DeadlineFedAvg
from .fedbuff import FedBuff
from .large_batch_rounds import LargeBatchRounds
from .large_batch_sync import LargeBatchSync
from .runtime_weighted import RuntimeWeightedFedAvg
from .tile_clusters import TileClusters
from .tiled import TiledTraining

__all__ = [
    "ClusterSelection",
    "DeadlineFedAvg",
    "FedBuff",
    "LargeBatchRounds",
    "LargeBatchSync",
    "RuntimeWeightedFedAvg",
    "TileClusters",
    "TiledTraining",
]
