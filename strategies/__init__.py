"""Drop-in Flower strategies for fleets of unequal devices."""

from .runtime_weighted import RuntimeWeightedFedAvg

__all__ = ["RuntimeWeightedFedAvg"]
