"""Facts about the machine a run is on."""

from __future__ import annotations

import os


def available_memory() -> int:
    """Bytes of memory available now (``MemAvailable`` of /proc/meminfo; elsewhere
    the free physical pages)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
