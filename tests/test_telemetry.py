"""Telemetry readers on fake /sys and /proc trees built in each test.

Values are written in the kernel's units (kHz, millidegrees, mW, mV, mA, uW, uV,
uA, kB); the expectations below convert them by hand.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from flowerbed.clients import telemetry as t


def put(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def put_rail(hwmon: Path, channel: int, label: str, mv: str, ma: str) -> None:
    """An INA3221 channel under ``hwmon``: its label, bus millivolts and
    milliamps, as the hwmon driver lays them out."""
    put(hwmon, f"in{channel}_label", label)
    put(hwmon, f"in{channel}_input", mv)
    put(hwmon, f"curr{channel}_input", ma)


RPI4_CPUINFO = """processor\t: 0
BogoMIPS\t: 108.00
CPU part\t: 0xd08

processor\t: 1
CPU part\t: 0xd08

Hardware\t: BCM2835
Model\t\t: Raspberry Pi 4 Model B Rev 1.4
"""


def rpi4(root: Path) -> None:
    put(root, "proc/device-tree/model", "Raspberry Pi 4 Model B Rev 1.4\x00")
    put(root, "proc/cpuinfo", RPI4_CPUINFO)
    put(root, "sys/devices/system/cpu/online", "0-3\n")
    for cpu, khz in enumerate((600000, 1500000, 1500000, 1000000)):
        base = f"sys/devices/system/cpu/cpu{cpu}/cpufreq"
        put(root, f"{base}/scaling_cur_freq", f"{khz}\n")
        put(root, f"{base}/cpuinfo_max_freq", "1500000\n")
    put(root, "sys/class/thermal/thermal_zone0/type", "cpu-thermal\n")
    put(root, "sys/class/thermal/thermal_zone0/temp", "48685\n")
    put(root, "proc/meminfo", "MemTotal:  3884096 kB\nMemAvailable:  3145728 kB\n")


def test_empty_tree_gives_no_keys_at_all(tmp_path: Path) -> None:
    assert t.read_telemetry(tmp_path) == {}


def test_raspberry_pi_cpu_temperature_and_memory(tmp_path: Path) -> None:
    rpi4(tmp_path)
    got = t.read_telemetry(tmp_path)
    assert got[t.BOARD] == "Raspberry Pi 4 Model B Rev 1.4"
    assert got[t.CPU_MODEL] == "BCM2835"  # aarch64 kernels name only the SoC
    assert got[t.CPU_CORES] == 4  # from "0-3", although cpuinfo lists only two
    # (600 + 1500 + 1500 + 1000) MHz / 4
    assert got[t.CPU_FREQ_MHZ] == pytest.approx(1150.0)
    assert got[t.CPU_MAX_FREQ_MHZ] == pytest.approx(1500.0)
    assert got[t.TEMP_C] == pytest.approx(48.685)
    assert got[t.MEM_TOTAL_MB] == pytest.approx(3884096 / 1024)
    assert got[t.MEM_AVAILABLE_MB] == pytest.approx(3072.0)
    for absent in (t.POWER_W, t.BATTERY_PCT, t.THROTTLED):
        assert absent not in got


def test_x86_model_name_and_core_count_from_cpuinfo(tmp_path: Path) -> None:
    put(
        tmp_path,
        "proc/cpuinfo",
        "processor : 0\nmodel name : Intel(R) Core(TM) i5\n\n"
        "processor : 1\nmodel name : Intel(R) Core(TM) i5\n",
    )
    got = t.read_cpu(tmp_path)
    assert got == {t.CPU_MODEL: "Intel(R) Core(TM) i5", t.CPU_CORES: 2}


def test_cpu_list_with_gaps_counts_each_cpu(tmp_path: Path) -> None:
    put(tmp_path, "sys/devices/system/cpu/online", "0,2-5\n")
    assert t.read_cpu(tmp_path)[t.CPU_CORES] == 5


def test_temperature_prefers_cpu_zone_over_hotter_fixed_pmic_zone(
    tmp_path: Path,
) -> None:
    # Jetson Nano: zone 0 "AO-therm", zone 1 "CPU-therm", zone 4 "PMIC-Die" = 100 C.
    for zone, (kind, milli) in enumerate(
        [("AO-therm", 41500), ("CPU-therm", 38500), ("PMIC-Die", 100000)]
    ):
        put(tmp_path, f"sys/class/thermal/thermal_zone{zone}/type", kind)
        put(tmp_path, f"sys/class/thermal/thermal_zone{zone}/temp", str(milli))
    assert t.read_temperature(tmp_path) == {t.TEMP_C: 38.5}
    assert t.read_thermal_zones(tmp_path)["PMIC-Die"] == 100.0


def test_temperature_without_cpu_zone_uses_zone_zero(tmp_path: Path) -> None:
    put(tmp_path, "sys/class/thermal/thermal_zone10/temp", "70000")
    put(tmp_path, "sys/class/thermal/thermal_zone2/temp", "51000")
    assert t.read_temperature(tmp_path) == {t.TEMP_C: 51.0}


def test_unreadable_values_are_absent_not_zero(tmp_path: Path) -> None:
    put(tmp_path, "sys/class/thermal/thermal_zone0/temp", "garbage")
    put(tmp_path, "sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq", "")
    assert t.read_telemetry(tmp_path) == {}


def test_raspberry_pi_throttle_mask_from_sysfs(tmp_path: Path) -> None:
    # 0x50005: under-voltage now (bit 0) and throttled now (bit 2), plus the
    # "has occurred" bits 16 and 18.
    put(tmp_path, "sys/devices/platform/soc/soc:firmware/get_throttled", "50005\n")
    assert t.read_throttling(tmp_path) == {t.THROTTLED: 0x50005, t.THROTTLED_NOW: 1}


def test_throttle_that_only_occurred_in_the_past_is_not_now(tmp_path: Path) -> None:
    put(tmp_path, "sys/devices/platform/soc/soc:firmware/get_throttled", "50000\n")
    assert t.read_throttling(tmp_path) == {t.THROTTLED: 0x50000, t.THROTTLED_NOW: 0}


def test_throttle_mask_from_vcgencmd_when_sysfs_lacks_it(tmp_path: Path) -> None:
    tool = tmp_path / "vcgencmd"
    tool.write_text('#!/bin/sh\n[ "$1" = get_throttled ] && echo "throttled=0x4"\n')
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    assert t.read_throttling(tmp_path, vcgencmd=str(tool)) == {
        t.THROTTLED: 4,
        t.THROTTLED_NOW: 1,
    }


def test_fake_tree_never_runs_the_real_vcgencmd(tmp_path: Path) -> None:
    assert t.read_throttling(tmp_path) == {}


def test_jetson_nano_ina3221x_input_rail_is_board_power(tmp_path: Path) -> None:
    iio = "sys/bus/i2c/drivers/ina3221x/6-0040/iio:device0"
    for i, (name, mw) in enumerate(
        [("POM_5V_IN", 4520), ("POM_5V_GPU", 720), ("POM_5V_CPU", 1840)]
    ):
        put(tmp_path, f"{iio}/rail_name_{i}", name)
        put(tmp_path, f"{iio}/in_power{i}_input", str(mw))
    assert t.read_ina3221_rails(tmp_path) == {
        "POM_5V_IN": 4.52,
        "POM_5V_GPU": 0.72,
        "POM_5V_CPU": 1.84,
    }
    assert t.read_power(tmp_path) == {
        t.POWER_W: 4.52,  # the input rail, not 4.52 + 0.72 + 1.84
        t.POWER_SOURCE: "ina3221:POM_5V_IN",
    }


def test_jetson_hwmon_layout_power_is_volts_times_amps(tmp_path: Path) -> None:
    hwmon = "sys/bus/i2c/drivers/ina3221/1-0040/hwmon/hwmon3"
    put_rail(tmp_path / hwmon, 1, "VDD_IN", "5000", "1200")
    put_rail(tmp_path / hwmon, 2, "VDD_CPU_GPU_CV", "4800", "500")
    # in4..in7 are shunt voltages; curr4 is the sum channel: never a rail.
    put(tmp_path, f"{hwmon}/in4_input", "40")
    put(tmp_path, f"{hwmon}/curr4_input", "1700")
    assert t.read_ina3221_rails(tmp_path) == {
        "VDD_IN": pytest.approx(6.0),  # 5000 mV x 1200 mA = 6 W
        "VDD_CPU_GPU_CV": pytest.approx(2.4),
    }
    assert t.read_power(tmp_path)[t.POWER_W] == pytest.approx(6.0)


def test_rails_without_an_input_rail_are_summed(tmp_path: Path) -> None:
    hwmon = "sys/bus/i2c/drivers/ina3221/1-0040/hwmon/hwmon0"
    put_rail(tmp_path / hwmon, 1, "VDD_GPU_SOC", "5000", "400")
    put_rail(tmp_path / hwmon, 2, "VDD_CPU_CV", "5000", "600")
    assert t.read_power(tmp_path) == {
        t.POWER_W: pytest.approx(5.0),  # 2 W + 3 W
        t.POWER_SOURCE: "ina3221:sum",
    }


def test_discharging_battery_power_now(tmp_path: Path) -> None:
    put(tmp_path, "sys/class/power_supply/BAT0/type", "Battery")
    put(tmp_path, "sys/class/power_supply/BAT0/status", "Discharging")
    put(tmp_path, "sys/class/power_supply/BAT0/capacity", "87")
    put(tmp_path, "sys/class/power_supply/BAT0/power_now", "7350000")  # uW
    put(tmp_path, "sys/class/power_supply/AC/type", "Mains")
    assert t.read_power(tmp_path) == {
        t.BATTERY_PCT: 87.0,
        t.POWER_W: pytest.approx(7.35),
        t.POWER_SOURCE: "power_supply:BAT0",
    }


def test_discharging_battery_voltage_times_current(tmp_path: Path) -> None:
    put(tmp_path, "sys/class/power_supply/battery/type", "Battery")
    put(tmp_path, "sys/class/power_supply/battery/status", "Discharging")
    put(tmp_path, "sys/class/power_supply/battery/voltage_now", "3800000")  # uV
    put(tmp_path, "sys/class/power_supply/battery/current_now", "-500000")  # uA
    # 3.8 V x 0.5 A = 1.9 W (the sign of current_now differs between drivers)
    assert t.read_power(tmp_path)[t.POWER_W] == pytest.approx(1.9)


def test_charging_battery_gives_level_but_no_board_power(tmp_path: Path) -> None:
    put(tmp_path, "sys/class/power_supply/BAT0/type", "Battery")
    put(tmp_path, "sys/class/power_supply/BAT0/status", "Charging")
    put(tmp_path, "sys/class/power_supply/BAT0/capacity", "40")
    put(tmp_path, "sys/class/power_supply/BAT0/power_now", "15000000")
    assert t.read_power(tmp_path) == {t.BATTERY_PCT: 40.0}


def test_numeric_keeps_only_metric_values() -> None:
    assert t.numeric({t.BOARD: "Pi", t.CPU_CORES: 4, t.TEMP_C: 50.5}) == {
        t.CPU_CORES: 4,
        t.TEMP_C: 50.5,
    }
