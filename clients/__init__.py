"""Clients: training helpers shared by every node, board ClientApps and telemetry."""
