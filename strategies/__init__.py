"""Drop-in Flower strategies for fleets of unequal devices."""

from .deadline import DeadlineFedAvg
from .fedbuff import FedBuff
from .runtime_weighted import RuntimeWeightedFedAvg

__all__ = ["DeadlineFedAvg", "FedBuff", "RuntimeWeightedFedAvg"]
