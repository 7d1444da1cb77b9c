"""Which devices of a population can take a task at a given virtual time.

Phones train for federated learning only while they are eligible: idle, charging
and on an unmetered (Wi-Fi) network, which happens mostly at night, local time
(Bonawitz et al., "Towards Federated Learning at Scale: System Design", MLSys 2019,
Sec. 2-3: device eligibility and the resulting diurnal participation; Yang et al.,
"Characterizing impacts of heterogeneity in federated learning upon large-scale
smartphone data", WWW 2021: the same pattern in a trace of 136k phones). The model
here is that pattern as one formula, a pure function of (device, time) that any
population sampler can consult:

    local_hour_i(t) = (start_hour + t / 3600 + offset_i) mod 24
    p(h)            = mean x (1 + amplitude x cos(2 pi (h - peak_hour) / 24))
    available_i(t)  = u_i(slot(t)) < p(local_hour_i(slot start)),
                      slot(t) = floor(t / slot_s), u_i(slot) ~ U(0, 1) i.i.d.

``offset_i`` ~ U(-timezone_spread_h, +timezone_spread_h) spreads devices over
neighbouring time zones. Eligibility is redrawn every ``slot_s`` seconds (devices
come and go). The parameters' defaults are assumptions in line with those papers'
qualitative findings, not fitted to a trace: on average 30% of devices eligible,
4x more at the peak (02:00 local) than at the trough.

Losing a device in the middle of a task (it unplugs, leaves Wi-Fi, or the app is
killed) is the device profile's dropout model (:func:`flowerbed.sims.vclock.
drop_probability`), which the simulated nodes apply to each task.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from flowerbed.grid import GridWrapper
from flwr.serverapp import Grid

SECONDS_PER_DAY = 86_400.0


@dataclass(frozen=True)
class DiurnalAvailability:
    """Eligibility of a population's devices over the day (see the module doc).

    Attributes
    ----------
    num_devices : int
        Devices 0..num_devices-1 (partition ids).
    mean : float (default 0.3)
        Average share of devices eligible, in (0, 1].
    amplitude : float (default 0.6)
        Relative swing over the day, in [0, 1): peak/trough = (1+a)/(1-a).
    peak_hour : float (default 2.0)
        Local hour of peak eligibility (phones charging overnight).
    timezone_spread_h : float (default 3.0)
        Devices' local-time offsets are uniform in +- this many hours.
    slot_s : float (default 600.0)
        Seconds between redraws of each device's eligibility.
    start_hour : float (default 20.0)
        Server-local hour at virtual time 0.
    seed : int (default 0)
        Seeds the offsets and the draws.
    """

    num_devices: int
    mean: float = 0.3
    amplitude: float = 0.6
    peak_hour: float = 2.0
    timezone_spread_h: float = 3.0
    slot_s: float = 600.0
    start_hour: float = 20.0
    seed: int = 0
    _offsets: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        checks = [
            (
                self.num_devices >= 1,
                f"num_devices must be >= 1, got {self.num_devices}",
            ),
            (0 < self.mean <= 1, f"mean must be in (0, 1], got {self.mean}"),
            (
                0 <= self.amplitude < 1,
                f"amplitude must be in [0, 1), got {self.amplitude}",
            ),
            (
                self.mean * (1 + self.amplitude) <= 1,
                f"mean x (1 + amplitude) must be <= 1, got "
                f"{self.mean * (1 + self.amplitude):g}",
            ),
            (self.slot_s > 0, f"slot_s must be > 0, got {self.slot_s}"),
            (
                self.timezone_spread_h >= 0,
                f"timezone_spread_h must be >= 0, got {self.timezone_spread_h}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        rng = np.random.default_rng([self.seed, 0])
        offsets = rng.uniform(
            -self.timezone_spread_h, self.timezone_spread_h, self.num_devices
        )
        object.__setattr__(self, "_offsets", offsets)

    def probability(self, local_hour: float | np.ndarray) -> float | np.ndarray:
        """p(h): chance that a device is eligible at local hour ``h``."""
        phase = 2 * np.pi * (np.asarray(local_hour) - self.peak_hour) / 24.0
        p = self.mean * (1 + self.amplitude * np.cos(phase))
        return float(p) if np.ndim(p) == 0 else p

    def local_hours(self, t: float) -> np.ndarray:
        """Each device's local hour at the start of the slot holding time ``t``."""
        start = math.floor(t / self.slot_s) * self.slot_s
        return np.mod(self.start_hour + start / 3600.0 + self._offsets, 24.0)

    def available_mask(self, t: float) -> np.ndarray:
        """Boolean mask over devices: eligible at virtual time ``t`` (seconds)."""
        if t < 0 or not math.isfinite(t):
            raise ValueError(f"time must be finite and >= 0, got {t}")
        slot = math.floor(t / self.slot_s)
        u = np.random.default_rng([self.seed, 1, slot]).random(self.num_devices)
        return u < self.probability(self.local_hours(t))

    def available(self, devices: Sequence[int], t: float) -> list[int]:
        """The subset of ``devices`` (partition ids) eligible at time ``t``."""
        mask = self.available_mask(t)
        return [d for d in devices if mask[d]]


class AvailabilityGrid(GridWrapper):
    """A ``Grid`` whose connected nodes are the eligible devices of a population.

    ``get_node_ids()`` answers with the nodes whose device is eligible at the
    clock's now, so any strategy that samples from the connected nodes (Flower's
    FedAvg, flowerbed's) samples from the eligible ones. ``device_of`` maps a node id
    to its device index in the availability model.
    """

    def __init__(
        self, inner: Grid, availability: DiurnalAvailability, device_of: dict[int, int]
    ) -> None:
        super().__init__(inner)
        if getattr(self, "clock", None) is None:
            raise ValueError("AvailabilityGrid needs a grid with a clock")
        self.availability = availability
        self.device_of = dict(device_of)

    def get_node_ids(self) -> Iterable[int]:
        mask = self.availability.available_mask(self.clock.now())
        return [n for n in self.inner.get_node_ids() if mask[self.device_of[n]]]
