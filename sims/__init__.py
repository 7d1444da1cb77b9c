"""Simulated fleets: device profiles, virtual clock, in-process engine, Flower apps."""
