"""What a board can tell about itself: CPU, temperature, memory, throttling, power.

Every reader takes ``root`` (default ``"/"``) and reads files below it, so tests
build a fake ``/sys`` and ``/proc`` tree in a temporary folder. A value whose file
does not exist (or cannot be parsed) is *absent* from the result, never zero: a
strategy must not mistake "cannot measure" for "draws no power".

Sources, all Linux kernel ABI files (Documentation/ABI in the kernel tree):

- CPU: ``/proc/cpuinfo``, ``/proc/device-tree/model`` (board name on Raspberry Pi
  and Jetson), ``/sys/devices/system/cpu/online`` and ``cpu*/cpufreq/`` (kHz).
- Temperature: ``/sys/class/thermal/thermal_zone*/{type,temp}`` (millidegrees C).
- Memory: ``/proc/meminfo`` (kB).
- Throttling: Raspberry Pi firmware's ``get_throttled`` bit mask, from
  ``/sys/devices/platform/soc/soc:firmware/get_throttled`` or, when that file is
  absent, ``vcgencmd get_throttled`` (bits as in the Raspberry Pi documentation,
  "vcgencmd get_throttled").
- Power: Jetson INA3221 rail monitors, both the JetPack 4 ``ina3221x`` IIO layout
  (``in_power<i>_input`` in mW, ``rail_name_<i>``) and the JetPack 5+ ``ina3221``
  hwmon layout (``in<i>_label``, ``in<i>_input`` in mV, ``curr<i>_input`` in mA);
  otherwise a discharging battery in ``/sys/class/power_supply`` (``power_now`` in
  uW, or ``voltage_now`` uV x ``current_now`` uA).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

# Keys of the telemetry dict (kebab-case like the wire keys) -----------------------
BOARD = "board"
CPU_MODEL = "cpu-model"
CPU_CORES = "cpu-cores"
CPU_FREQ_MHZ = "cpu-freq-mhz"
"""Mean current frequency over the CPUs that report one."""
CPU_MAX_FREQ_MHZ = "cpu-max-freq-mhz"
TEMP_C = "temp-c"
"""CPU temperature: the hottest zone whose type names the CPU, else zone 0."""
MEM_TOTAL_MB = "mem-total-mb"
MEM_AVAILABLE_MB = "mem-available-mb"
THROTTLED = "throttled"
"""Raspberry Pi firmware throttle bit mask (0 = never throttled since boot)."""
THROTTLED_NOW = "throttled-now"
"""1 when under-voltage, frequency capping, throttling or the soft temperature
limit is active right now (bits 0-3 of the mask), else 0."""
POWER_W = "power-w"
"""Whole-board power: the input rail when one is named so, else the sum of rails."""
POWER_SOURCE = "power-source"
"""Where ``power-w`` came from: ``ina3221:<rail>``, ``ina3221:sum`` or
``power_supply:<name>``."""
BATTERY_PCT = "battery-pct"

INPUT_RAIL_NAMES = ("POM_5V_IN", "VDD_IN", "VIN_SYS_5V0", "VDD_IN_SYS")
"""INA3221 rails that carry the whole board's input (Jetson Nano: POM_5V_IN;
Xavier NX and Orin: VDD_IN; AGX Orin: VIN_SYS_5V0). Other rails are parts of it,
so summing them with the input rail would count twice."""

THROTTLE_NOW_MASK = 0xF
"""Bits 0-3 of get_throttled: under-voltage, ARM frequency capped, currently
throttled, soft temperature limit active (Raspberry Pi documentation)."""

Telemetry = dict[str, float | int | str]


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def _read_number(path: Path) -> float | None:
    text = _read(path)
    if text is None:
        return None
    try:
        return float(text.split()[0])
    except (ValueError, IndexError):
        return None


def _sys(root: str | Path) -> Path:
    return Path(root) / "sys"


def _proc(root: str | Path) -> Path:
    return Path(root) / "proc"


def _parse_cpu_list(text: str) -> int | None:
    """Count CPUs in a kernel CPU list such as ``0-3`` or ``0,2-5``."""
    count = 0
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if match is None:
            return None
        low = int(match.group(1))
        high = int(match.group(2)) if match.group(2) else low
        count += high - low + 1
    return count or None


def read_cpu(root: str | Path = "/") -> Telemetry:
    """Board name, CPU model, online core count and frequencies (MHz)."""
    out: Telemetry = {}
    board = _read(_proc(root) / "device-tree" / "model")
    if board:
        out[BOARD] = board.rstrip("\x00")
    cpuinfo = _read(_proc(root) / "cpuinfo") or ""
    fields: dict[str, str] = {}
    processors = 0
    for line in cpuinfo.splitlines():
        name, sep, value = line.partition(":")
        if not sep:
            continue
        name = name.strip().lower()
        if name == "processor":
            processors += 1
        fields.setdefault(name, value.strip())
    # x86 and 32-bit ARM name the CPU in "model name"; Raspberry Pi kernels put the
    # board in "Model"; 64-bit ARM kernels give only "Hardware" or the part number.
    for field in ("model name", "hardware", "model"):
        if fields.get(field):
            out[CPU_MODEL] = fields[field]
            break
    else:
        if "cpu part" in fields:
            out[CPU_MODEL] = f"ARM part {fields['cpu part']}"
    online = _read(_sys(root) / "devices" / "system" / "cpu" / "online")
    cores = _parse_cpu_list(online) if online else None
    if cores is None and processors:
        cores = processors
    if cores is not None:
        out[CPU_CORES] = cores
    cpu_dir = _sys(root) / "devices" / "system" / "cpu"
    current: list[float] = []
    maxima: list[float] = []
    for freq_dir in sorted(cpu_dir.glob("cpu[0-9]*/cpufreq")):
        cur = _read_number(freq_dir / "scaling_cur_freq")
        if cur is None:
            cur = _read_number(freq_dir / "cpuinfo_cur_freq")
        if cur is not None:
            current.append(cur / 1000.0)
        high = _read_number(freq_dir / "cpuinfo_max_freq")
        if high is not None:
            maxima.append(high / 1000.0)
    if current:
        out[CPU_FREQ_MHZ] = sum(current) / len(current)
    if maxima:
        out[CPU_MAX_FREQ_MHZ] = max(maxima)
    return out


def read_thermal_zones(root: str | Path = "/") -> dict[str, float]:
    """Temperature (deg C) of each thermal zone, keyed ``<type>`` (or zone name)."""
    zones: dict[str, float] = {}
    base = _sys(root) / "class" / "thermal"

    def zone_number(path: Path) -> int:
        digits = path.name.removeprefix("thermal_zone")
        return int(digits) if digits.isdigit() else 0

    for zone in sorted(base.glob("thermal_zone*"), key=zone_number):
        milli = _read_number(zone / "temp")
        if milli is None:
            continue
        name = _read(zone / "type") or zone.name
        if name in zones:
            name = f"{name}:{zone.name}"
        zones[name] = milli / 1000.0
    return zones


def read_temperature(root: str | Path = "/") -> Telemetry:
    """CPU temperature: the hottest zone with "cpu" in its type, else the first zone.

    Not the hottest zone overall: Jetson Nano's ``PMIC-Die`` zone reads a fixed
    100 C, which says nothing about load.
    """
    zones = read_thermal_zones(root)
    if not zones:
        return {}
    cpu = [t for name, t in zones.items() if "cpu" in name.lower()]
    return {TEMP_C: max(cpu) if cpu else next(iter(zones.values()))}


def read_memory(root: str | Path = "/") -> Telemetry:
    """Total and available memory in MB from ``/proc/meminfo``."""
    text = _read(_proc(root) / "meminfo")
    if text is None:
        return {}
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = re.fullmatch(r"(\w+):\s+(\d+)\s*kB", line.strip())
        if match:
            values[match.group(1)] = int(match.group(2)) / 1024.0
    out: Telemetry = {}
    if "MemTotal" in values:
        out[MEM_TOTAL_MB] = values["MemTotal"]
    if "MemAvailable" in values:
        out[MEM_AVAILABLE_MB] = values["MemAvailable"]
    return out


def _throttle_fields(mask: int) -> Telemetry:
    return {THROTTLED: mask, THROTTLED_NOW: int(bool(mask & THROTTLE_NOW_MASK))}


def read_throttling(root: str | Path = "/", vcgencmd: str | None = None) -> Telemetry:
    """Raspberry Pi throttle mask from sysfs, else from ``vcgencmd get_throttled``.

    Parameters
    ----------
    root : str or Path, default "/"
        Filesystem root to read below.
    vcgencmd : str, optional
        Path of the ``vcgencmd`` program. Default: looked up on ``PATH`` only when
        ``root`` is ``"/"`` (a fake tree never runs the real board's tool).
    """
    firmware = _sys(root) / "devices" / "platform" / "soc" / "soc:firmware"
    text = _read(firmware / "get_throttled")
    if text is not None:
        try:
            return _throttle_fields(int(text, 16))
        except ValueError:
            return {}
    program = vcgencmd
    if program is None and Path(root) == Path("/"):
        program = shutil.which("vcgencmd")
    if program is None:
        return {}
    try:
        done = subprocess.run(
            [program, "get_throttled"],
            capture_output=True,
            text=True,
            timeout=2.0,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return {}
    match = re.search(r"throttled=(0x[0-9a-fA-F]+)", done.stdout)
    return _throttle_fields(int(match.group(1), 16)) if match else {}


def read_ina3221_rails(root: str | Path = "/") -> dict[str, float]:
    """Power (W) of each Jetson INA3221 rail, from either driver layout."""
    rails: dict[str, float] = {}
    drivers = _sys(root) / "bus" / "i2c" / "drivers"
    # JetPack 4 (L4T 32): ina3221x IIO device with in_power<i>_input in mW.
    for iio in sorted(drivers.glob("ina3221x/*/iio:device*")):
        for power_file in sorted(iio.glob("in_power[0-9]_input")):
            index = power_file.name.removeprefix("in_power").removesuffix("_input")
            milliwatts = _read_number(power_file)
            if milliwatts is None:
                continue
            name = _read(iio / f"rail_name_{index}") or f"{iio.parent.name}:{index}"
            rails[name] = milliwatts / 1000.0
    # JetPack 5+ (L4T 34+): ina3221 hwmon device. Channels 1-3 are the rails (bus
    # voltage in<i>, current curr<i>); in4-in7 are shunt voltages and their sum.
    for hwmon in sorted(drivers.glob("ina3221/*/hwmon/hwmon*")):
        for volt_file in sorted(hwmon.glob("in[1-3]_input")):
            index = volt_file.name.removeprefix("in").removesuffix("_input")
            millivolts = _read_number(volt_file)
            milliamps = _read_number(hwmon / f"curr{index}_input")
            if millivolts is None or milliamps is None:
                continue
            name = _read(hwmon / f"in{index}_label") or f"{hwmon.name}:{index}"
            rails[name] = millivolts * milliamps / 1e6
    return rails


def read_power_supply(root: str | Path = "/") -> Telemetry:
    """Battery level, and the power a discharging battery delivers to the board."""
    out: Telemetry = {}
    base = _sys(root) / "class" / "power_supply"
    for supply in sorted(base.glob("*")):
        if (_read(supply / "type") or "").lower() != "battery":
            continue
        capacity = _read_number(supply / "capacity")
        if capacity is not None and BATTERY_PCT not in out:
            out[BATTERY_PCT] = capacity
        if (_read(supply / "status") or "").lower() != "discharging":
            continue
        microwatts = _read_number(supply / "power_now")
        if microwatts is None:
            volts = _read_number(supply / "voltage_now")
            amps = _read_number(supply / "current_now")
            if volts is None or amps is None:
                continue
            microwatts = volts * abs(amps) / 1e6
        if POWER_W not in out:
            out[POWER_W] = abs(microwatts) / 1e6
            out[POWER_SOURCE] = f"power_supply:{supply.name}"
    return out


def read_power(root: str | Path = "/") -> Telemetry:
    """Board power (W) and its source, plus battery level where there is one.

    Jetson INA3221 first: the input rail if one is named in
    :data:`INPUT_RAIL_NAMES`, else the sum of all rails (a lower bound on board
    power). Otherwise a discharging battery from ``/sys/class/power_supply``.
    """
    supply = read_power_supply(root)
    rails = read_ina3221_rails(root)
    if not rails:
        return supply
    out: Telemetry = {k: v for k, v in supply.items() if k == BATTERY_PCT}
    for name in INPUT_RAIL_NAMES:
        if name in rails:
            out[POWER_W] = rails[name]
            out[POWER_SOURCE] = f"ina3221:{name}"
            return out
    out[POWER_W] = sum(rails.values())
    out[POWER_SOURCE] = "ina3221:sum"
    return out


def read_telemetry(root: str | Path = "/", vcgencmd: str | None = None) -> Telemetry:
    """Everything the board can tell now, merged; absent where it cannot tell.

    Parameters
    ----------
    root : str or Path, default "/"
        Filesystem root (tests pass a fake tree).
    vcgencmd : str, optional
        Path of ``vcgencmd`` for the throttle fallback (see :func:`read_throttling`).

    Returns
    -------
    dict
        Keys among this module's constants (``cpu-model``, ``cpu-cores``,
        ``cpu-freq-mhz``, ``temp-c``, ``mem-total-mb``, ``throttled``,
        ``power-w``, ``battery-pct``, ...). The numeric ones with a wire key of the
        same name (``temp-c``, ``power-w``, ``battery-pct``) can go into a reply's
        MetricRecord as they are; :func:`numeric` keeps only the numbers.
    """
    out: Telemetry = {}
    out.update(read_cpu(root))
    out.update(read_temperature(root))
    out.update(read_memory(root))
    out.update(read_throttling(root, vcgencmd))
    out.update(read_power(root))
    return out


def numeric(telemetry: Mapping[str, float | int | str]) -> dict[str, float | int]:
    """The numeric entries of a telemetry dict (what a MetricRecord accepts)."""
    return {
        k: v
        for k, v in telemetry.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }
