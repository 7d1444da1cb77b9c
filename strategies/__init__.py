"""Drop-in Flower strategies for fleets of unequal devices."""

from .cluster_selection import ClusterSelection
from .deadline import DeadlineFedAvg
from .fedbuff import FedBuff
from .runtime_weighted import RuntimeWeightedFedAvg

__all__ = ["ClusterSelection", "DeadlineFedAvg", "FedBuff", "RuntimeWeightedFedAvg"]
