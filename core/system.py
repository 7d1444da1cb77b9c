"""Facts about the machine a run is on."""

from __future__ import annotations

import os


def proc_bytes(path: str, key: str) -> int | None:
    """The ``key`` line (``"MemAvailable:"``) of a Linux /proc file that counts in
    kB, in bytes; None where the file or the line cannot be read."""
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_memory() -> int:
    """Bytes of memory available now (``MemAvailable`` of /proc/meminfo; elsewhere
    the free physical pages)."""
    found = proc_bytes("/proc/meminfo", "MemAvailable:")
    if found is not None:
        return found
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
