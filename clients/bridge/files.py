"""Private files of the gateway (node keys, token file): written whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` via a temporary file, fsync and rename.

    A reader (or a gateway restarted after a kill) sees the old file or the new one,
    never half of one; a kill mid-write leaves only ``<path>.<pid>.tmp`` (in the
    state dir, :func:`flowerbed.clients.bridge.relay.prepare_state_dir` removes such
    files at the next start). The file is created with ``mode`` (owner only by
    default).
    """
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
