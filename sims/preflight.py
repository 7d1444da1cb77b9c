"""Checks a run passes before anything is built; the line a failed run ends with.

:func:`preflight` is what ``flowerbed sim`` (with or without ``--check``) and the
``flwr run`` ServerApp (``flowerbed.sims.apps``) check before any node trains: the
data is there and its partition gives every node samples, the population and a
round fit in memory, the output folder can take the run folder. Each refusal is one
line naming the run-config keys to change.

It imports neither torch nor Flower: the memory check needs the model's size only
when a run would not fit with the largest model
(:data:`flowerbed.sims.population.MODEL_BYTES_BOUND`) and its population alone
would, and only then builds it. So ``flowerbed sim --check`` stays quick.

:func:`failure_line` turns what can still stop a checked run (a disk that fills up,
memory the estimates do not cover) into one line naming what to change.
"""

from __future__ import annotations

import errno
import math
import os
from pathlib import Path
from typing import TypeAlias

from flowerbed.data import DataError, Dataset
from flowerbed.sims.config import Scenario
from flowerbed.sims.outputs import OutputDirError, check_output_dir, run_folder_bytes
from flowerbed.sims.population import (
    MODEL_BYTES_BOUND,
    cached_dataset,
    check_memory,
    check_partition,
    population_bytes,
    run_bytes,
)
from flowerbed.system import available_memory

Failure: TypeAlias = DataError | OutputDirError | OSError | MemoryError
FAILURES = (DataError, OutputDirError, OSError, MemoryError)
"""What :func:`preflight` raises and what can still stop a checked run; callers
end the run with :func:`failure_line` of it."""
MEMORY_KEYS = "lower num-nodes, fraction-train or batch-size, or use a smaller model"
"""What frees memory in a run, as the keys a user sets."""


def preflight(
    scenario: Scenario, num_nodes: int | None = None, *, create_output: bool = True
) -> None:
    """Refuse a run that cannot finish, before anything trains.

    ``num_nodes``: the population (default the scenario's; under ``flwr run``, the
    federation's). ``create_output``: make the output folder and write a file in
    it; False (``--check``) writes nothing and judges the folder by its
    permissions and free space.

    Raises
    ------
    DataError
        Missing data, a partition that leaves a node without samples, or a
        population and round too large for this machine's memory.
    OutputDirError
        An output folder that cannot be written or lacks room.
    """
    nodes = num_nodes or scenario.num_nodes
    data = cached_dataset(scenario.dataset, scenario.data_dir)
    available = available_memory()
    if run_bytes(nodes, scenario.fraction_train, MODEL_BYTES_BOUND) > available:
        # a population that cannot fit alone is refused whatever the model
        exact = population_bytes(nodes) < available
        check_memory(
            nodes,
            scenario.fraction_train,
            model_bytes(scenario, data) if exact else MODEL_BYTES_BOUND,
            available,
        )
    check_partition(scenario, data, nodes)
    cohort = math.ceil(scenario.fraction_train * nodes)
    check_output_dir(
        scenario.output_dir,
        run_folder_bytes(scenario.num_rounds, cohort),
        create=create_output,
    )


def model_bytes(scenario: Scenario, data: Dataset) -> int:
    """Bytes of the model ``scenario`` trains on ``data`` (builds it: imports torch)."""
    from flowerbed.models import build_model, model_num_bytes

    model = build_model(
        scenario.model, data.in_channels, data.image_size, data.num_classes
    )
    return model_num_bytes(model)


def failure_line(err: Failure, scenario: Scenario) -> str:
    """One line for what stopped a run: a check's own message, or for an
    ``OSError`` or ``MemoryError`` what failed and the keys that change it."""
    if isinstance(err, DataError | OutputDirError):
        return str(err)
    if isinstance(err, MemoryError) or err.errno == errno.ENOMEM:
        return f"the run ran out of memory; {MEMORY_KEYS}"
    what = err.strerror or str(err)
    if err.filename:
        what += f": {os.fsdecode(err.filename)!r}"
    output = Path(scenario.output_dir).expanduser().absolute()
    if err.errno == errno.ENOSPC or _within(err.filename, output):
        return (
            f"{what}; set output-dir to a folder with room that this user can write "
            f"(it is {str(output)!r})"
        )
    data_dir = Path(scenario.data_dir).expanduser().absolute()
    if scenario.data_dir and _within(err.filename, data_dir):
        return f"{what}; check data-dir, the folder the data is read from"
    return f"the run stopped: {what}"


def _within(filename: object, folder: Path) -> bool:
    """True when ``filename`` (an ``OSError``'s) is ``folder`` or inside it."""
    if not isinstance(filename, str | bytes | os.PathLike) or not filename:
        return False
    return Path(os.fsdecode(filename)).expanduser().absolute().is_relative_to(folder)
