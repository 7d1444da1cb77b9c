"""Device profiles: what each class of device costs in time, bandwidth and power.

One small data object per device class, one formula per cost (STYLE.md, after
FedScale's client metadata). One table holds the numbers, one their sources
(``DeviceProfile.sources``). Where a figure is derived rather than read off a
datasheet or benchmark, the derivation is written out.

Compute speed. Relative speeds are Geekbench 5 multi-core scores relative to the
Raspberry Pi 4B (board scores as reported in "Raspberry Pi 5 8GB RAM vs older models:
performance benchmarks", The Star Biz News, 2024: Pi 5 1650, Pi 4 900, Pi 3B+ 420;
phone scores from the Geekbench Browser's typical results for each SoC).
Per-sample seconds for the reference model (LeNet-5 on 28x28x1,
``flowerbed.models.REFERENCE_MODEL``) are derived for the Pi 4B and scaled by
relative speed:

    LeNet-5 training FLOPs per sample = 3 x 2 x 693,000 MACs = 4.16 MFLOP
        (forward MACs from ``flowerbed.models.forward_macs``; backward ~ 2x forward)
    Pi 4B effective rate = 10% of its ~13.5 GFLOPS HPL/LINPACK rate = 1.35 GFLOP/s
        (small-batch CNN training reaches a fraction of dense-BLAS peak; assumption)
    Pi 4B seconds per sample = 4.16e6 / 1.35e9 = 3.1 ms

    seconds_per_sample(device) = 3.1 ms x (Pi 4B score / device score)
"""

from __future__ import annotations

from dataclasses import dataclass, field

PI4_SECONDS_PER_SAMPLE = 4.16e6 / 1.35e9
"""Reference-model training seconds per sample on a Raspberry Pi 4B (see module doc)."""
PI4_GEEKBENCH5_MULTI = 900.0


@dataclass(frozen=True)
class DeviceProfile:
    """Costs of one device class.

    Attributes
    ----------
    name : str
        Catalogue key, e.g. ``"rpi4b"``.
    geekbench5_multi : float
        Geekbench 5 multi-core score (for the Jetson Nano, an effective score; see
        its source).
    downlink_mbps, uplink_mbps : float
        Sustained network throughput in megabits per second.
    idle_w, busy_w : float
        Power while waiting/communicating and while training, in watts.
    dropout_prob : float
        Probability of failing during any one task, independent of its length.
    mean_online_s : float
        Mean length of an online session (exponentially distributed, an assumption).
    sources : dict[str, str]
        Field name -> where its number comes from.
    """

    name: str
    description: str
    geekbench5_multi: float
    downlink_mbps: float
    uplink_mbps: float
    idle_w: float
    busy_w: float
    dropout_prob: float
    mean_online_s: float
    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)

    @property
    def relative_speed(self) -> float:
        """Training throughput relative to a Raspberry Pi 4B."""
        return self.geekbench5_multi / PI4_GEEKBENCH5_MULTI

    @property
    def seconds_per_sample(self) -> float:
        """Training seconds per sample of the reference model (LeNet-5, 28x28)."""
        return PI4_SECONDS_PER_SAMPLE / self.relative_speed


_PI_GB5 = "Geekbench 5 multi-core, The Star Biz News Pi benchmark table (2024)"
_PI_WIFI = (
    "Raspberry Pi 3B+ launch post (raspberrypi.com, 2018): iperf 2.4 GHz 3B ~35 Mbit/s,"
    " 5 GHz CYW43455 radio ~102 Mbit/s (same radio on Pi 4B and Pi 5)"
)
_LTE_POWER = (
    "Huang et al., 'A close examination of performance and power characteristics of"
    " 4G LTE networks', MobiSys 2012: ~1 W radio power while transferring"
)
_MOBILE_BW = (
    "Ookla Speedtest Global Index, mobile medians 2023 (~50 down / ~11 up Mbit/s)"
)
_PHONE_AVAIL = (
    "Yang et al., 'Characterizing impacts of heterogeneity in federated learning upon"
    " large-scale smartphone data', WWW 2021 (FedScale's availability trace): phones"
    " drop out mid-task at a few to ~10%; session length an assumption"
)
_BOARD_AVAIL = (
    "estimate: mains-powered boards on Wi-Fi; 1% per-task faults (assumption)"
)

_NUMBERS: dict[str, tuple[float, float, float, float, float, float, float]] = {
    # geekbench5_multi, downlink_mbps, uplink_mbps, idle_w, busy_w, dropout_prob,
    # mean_online_s (DeviceProfile's fields, in order)
    "rpi3b": (360.0, 35.0, 35.0, 1.4, 3.7, 0.01, 86_400.0),
    "rpi4b": (PI4_GEEKBENCH5_MULTI, 102.0, 102.0, 2.7, 6.4, 0.01, 86_400.0),
    "rpi5": (1650.0, 102.0, 102.0, 2.7, 7.0, 0.01, 86_400.0),
    "jetson-nano": (2400.0, 940.0, 940.0, 1.9, 10.0, 0.01, 86_400.0),
    "low-end-phone": (330.0, 15.0, 5.0, 1.0, 2.5, 0.10, 3_600.0),
    "galaxy-s10": (2600.0, 50.0, 11.0, 1.0, 5.0, 0.05, 7_200.0),
    "galaxy-s10plus": (2150.0, 50.0, 11.0, 1.0, 5.0, 0.05, 7_200.0),
    "pixel-7": (3300.0, 50.0, 11.0, 1.0, 5.5, 0.05, 7_200.0),
}
"""Each device class's costs (see the module doc and its sources)."""
_DESCRIPTIONS = {
    "rpi3b": "Raspberry Pi 3B (4x Cortex-A53 @ 1.2 GHz)",
    "rpi4b": "Raspberry Pi 4B (4x Cortex-A72 @ 1.5-1.8 GHz)",
    "rpi5": "Raspberry Pi 5 (4x Cortex-A76 @ 2.4 GHz)",
    "jetson-nano": "NVIDIA Jetson Nano 4GB (128-core Maxwell GPU, 10 W mode)",
    "low-end-phone": "low-end Android phone (4x Cortex-A53 @ 1.3 GHz, e.g. MT6739)",
    "galaxy-s10": "Samsung Galaxy S10-class phone (Snapdragon 855 / Exynos 9820)",
    "galaxy-s10plus": "Samsung Galaxy S10+ (Exynos 9820), S1's cluster phone",
    "pixel-7": "Google Pixel 7-class phone (Tensor G2)",
}
_SOURCES: dict[str, dict[str, str]] = {
    "rpi3b": {
        "geekbench5_multi": _PI_GB5 + ": Pi 3B+ (1.4 GHz) 420, x 1.2/1.4 for the"
        " 1.2 GHz Pi 3B",
        "bandwidth": _PI_WIFI,
        "power": "RasPi.TV power measurements (Alex Eames): Pi 3B 260 mA idle,"
        " 730 mA under full load, at 5.1 V",
        "availability": _BOARD_AVAIL,
    },
    "rpi4b": {
        "geekbench5_multi": _PI_GB5,
        "bandwidth": _PI_WIFI,
        "power": "RasPi.TV Pi 4B measurements: ~540 mA idle, ~1280 mA under"
        " stress, at 5.1 V",
        "availability": _BOARD_AVAIL,
    },
    "rpi5": {
        "geekbench5_multi": _PI_GB5,
        "bandwidth": _PI_WIFI,
        "power": "Jeff Geerling, Raspberry Pi 5 review power tests (2023):"
        " ~2.7 W idle, ~7 W under stress-ng",
        "availability": _BOARD_AVAIL,
    },
    "jetson-nano": {
        "geekbench5_multi": "estimate: CPU (4x A57 @ 1.43 GHz) scores ~800 in"
        " Geekbench 5 multi-core; training on its 472 GFLOPS (FP16) GPU taken"
        " as 3x the CPU for small CNNs",
        "bandwidth": "gigabit Ethernet (no on-board Wi-Fi): ~940 Mbit/s TCP goodput",
        "power": "NVIDIA Jetson Nano module datasheet: 10 W power mode; idle"
        " ~1.9 W (estimate from NVIDIA forum tegrastats readings)",
        "availability": _BOARD_AVAIL,
    },
    "low-end-phone": {
        "geekbench5_multi": "Geekbench Browser, MediaTek MT6739 phones: ~330"
        " multi-core (Geekbench 5)",
        "bandwidth": "OpenSignal 4G experience reports (2023), low-tier"
        " markets: ~15 Mbit/s down, ~5 up",
        "power": _LTE_POWER + "; busy: estimate for 4 little cores under load",
        "availability": _PHONE_AVAIL,
    },
    "galaxy-s10": {
        "geekbench5_multi": "Geekbench Browser, Galaxy S10: ~2,200 (Exynos"
        " 9820) to ~2,700 (Snapdragon 855) multi-core",
        "bandwidth": _MOBILE_BW,
        "power": _LTE_POWER + "; busy ~5 W: sustained multi-core load on 2019"
        " flagship SoCs (AnandTech SoC power measurements)",
        "availability": _PHONE_AVAIL,
    },
    "galaxy-s10plus": {
        "geekbench5_multi": "Geekbench Browser, Galaxy S10+ SM-G975F/N"
        " (Exynos 9820): ~2,100-2,200 multi-core (Geekbench 5); the Exynos"
        " model assumed for S1's cluster (Na et al., arXiv 2110.12172, built"
        " in Korea, where the S10+ shipped with the Exynos 9820)",
        "bandwidth": _MOBILE_BW + "; on a cluster the links model"
        " (flowerbed.sims.links) replaces these",
        "power": _LTE_POWER + "; busy ~5 W: sustained multi-core load on 2019"
        " flagship SoCs (AnandTech SoC power measurements)",
        "availability": _PHONE_AVAIL,
    },
    "pixel-7": {
        "geekbench5_multi": "Geekbench Browser, Pixel 7 (Tensor G2): ~3,300"
        " multi-core (Geekbench 5)",
        "bandwidth": _MOBILE_BW,
        "power": _LTE_POWER + "; busy ~5.5 W: Tensor G2 sustained multi-core"
        " load (Geekerwan/AnandTech-style power measurements)",
        "availability": _PHONE_AVAIL,
    },
}
"""Each device class's numbers: field (``bandwidth`` for both directions,
``power`` for both draws) -> where it comes from."""

DEVICES: dict[str, DeviceProfile] = {
    name: DeviceProfile(name, _DESCRIPTIONS[name], *numbers, sources=_SOURCES[name])
    for name, numbers in _NUMBERS.items()
}


def get_device(name: str) -> DeviceProfile:
    """Look a device class up by name; unknown names list the valid choices."""
    try:
        return DEVICES[name]
    except KeyError:
        raise ValueError(
            f"unknown device {name!r}; valid choices: {', '.join(DEVICES)}"
        ) from None


def catalogue_markdown() -> str:
    """The catalogue as the Markdown table docs/simulation.md carries (tested equal)."""
    rows = [
        "| device | class | Geekbench 5 multi | speed (Pi 4B = 1) "
        "| ms per LeNet-5 sample | down / up Mbit/s | idle / busy W "
        "| dropout per task | mean online |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for d in DEVICES.values():
        rows.append(
            f"| `{d.name}` | {d.description} | {d.geekbench5_multi:.0f} "
            f"| {d.relative_speed:.2f} | {1000 * d.seconds_per_sample:.2f} "
            f"| {d.downlink_mbps:g} / {d.uplink_mbps:g} | {d.idle_w:g} / {d.busy_w:g} "
            f"| {d.dropout_prob:.0%} | {d.mean_online_s / 3600:g} h |"
        )
    return "\n".join(rows)
