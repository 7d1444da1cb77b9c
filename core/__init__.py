"""flowerbed: fast, reliable federated training on fleets of small, unequal devices.

The distribution installs one import namespace, ``flowerbed``:

- ``flowerbed.strategies`` -- drop-in Flower strategies
- ``flowerbed.clients`` -- board clients, training helpers, telemetry, phone bridge
- ``flowerbed.sims`` -- device profiles, fleets, virtual clock, in-process engine
- ``flowerbed.keys`` -- the metric and config keys on the wire
- ``flowerbed.models`` / ``flowerbed.data`` -- model zoo and datasets shared by all
"""

__version__ = "0.1.0"
