"""Clients: training helpers shared by every node, board ClientApps and telemetry.

- :mod:`flowerbed.clients.board_app` — ``app``, a ready ClientApp for boards.
- :func:`timed_train`, :class:`TrainingMeter` — timed, deadline-bound training with
  power metering, for users' own ClientApps (:mod:`flowerbed.clients.timed`).
- :func:`read_telemetry` — CPU, temperature, memory, throttling and power
  (:mod:`flowerbed.clients.telemetry`).
- :func:`load_local_data` — a board's image folder or ``.npz``
  (:mod:`flowerbed.clients.local_data`).

Names are imported on first use, so ``import flowerbed.clients.bridge`` does not
pull in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flowerbed.lazy import lazy_names

if TYPE_CHECKING:
    from flowerbed.clients.local_data import LocalData, load_local_data
    from flowerbed.clients.telemetry import read_telemetry
    from flowerbed.clients.timed import TimedTraining, TrainingMeter, timed_train

_EXPORTS = {
    "LocalData": "flowerbed.clients.local_data",
    "load_local_data": "flowerbed.clients.local_data",
    "read_telemetry": "flowerbed.clients.telemetry",
    "TimedTraining": "flowerbed.clients.timed",
    "TrainingMeter": "flowerbed.clients.timed",
    "timed_train": "flowerbed.clients.timed",
}

__all__ = [
    "LocalData",
    "TimedTraining",
    "TrainingMeter",
    "load_local_data",
    "read_telemetry",
    "timed_train",
]


__getattr__ = lazy_names(__name__, _EXPORTS)
