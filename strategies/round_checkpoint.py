"""The round loop's checkpoint: after each round, the model, the strategy's state
and the Result's metric histories, so a restarted server goes on from there.

Written atomically and checksummed by
:func:`~flowerbed.strategies.checkpoints.save_checkpoint`, read back by
:func:`~flowerbed.strategies.checkpoints.read_checkpoint`, every field checked
(:class:`~flowerbed.strategies.checkpoints.StateReader`). The jobs that span
devices keep their own (:mod:`flowerbed.strategies.span_checkpoint`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord
from flwr.serverapp.strategy import Result

from .checkpoints import (
    CheckpointError,
    StateFieldError,
    StateReader,
    read_checkpoint,
    restore_histories,
    result_histories,
    save_checkpoint,
)


class RoundCheckpoint:
    """The checkpoint file of one strategy's run.

    Parameters
    ----------
    path : Path
        The file; written after every completed round, read by :meth:`resume`.
    strategy : str
        The strategy's class name; a checkpoint of another strategy is refused.
    """

    def __init__(self, path: Path, strategy: str) -> None:
        self.path = path
        self.strategy = strategy

    def save(
        self,
        server_round: int,
        arrays: Mapping[str, np.ndarray],
        state: dict[str, Any],
        result: Result,
    ) -> None:
        """Write the model and state after ``server_round``; a failed write
        raises one CheckpointError naming the path and the OS error, and leaves
        the last checkpoint as it was."""
        save_checkpoint(
            self.path,
            arrays,
            {
                "strategy": self.strategy,
                "round": server_round,
                "strategy_state": state,
                **result_histories(result),
            },
        )

    def resume(
        self,
        initial_arrays: ArrayRecord,
        result: Result,
        state: Callable[[], dict[str, Any]],
        load_state: Callable[[dict[str, Any]], None],
    ) -> tuple[int, dict[str, np.ndarray]] | None:
        """The last completed round and the model, or None without a file.

        The strategy's state goes to ``load_state`` and the Result's metric
        histories are restored. A bad field raises one CheckpointError naming
        it, and nothing is half-loaded: the state ``state()`` returned before
        is loaded back.
        """
        found = read_checkpoint(self.path, self.strategy, initial_arrays)
        if found is None:
            return None
        arrays, saved = found
        before = state()
        try:
            fields = StateReader(saved)
            last_round = fields.whole("round")
            histories = fields.histories()
            strategy_state = dict(fields.section("strategy_state"))
            try:
                load_state(strategy_state)
            except StateFieldError as err:
                raise err.within("strategy_state") from None
        except StateFieldError as err:
            load_state(before)  # nothing half-loaded
            raise CheckpointError(
                f"checkpoint {self.path} has malformed state: {err}; "
                "delete it to start afresh or point checkpoint_path elsewhere"
            ) from None
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            load_state(before)
            raise CheckpointError(
                f"checkpoint {self.path} has incomplete or malformed "
                f"state ({err!r}); delete it to start afresh or point "
                "checkpoint_path elsewhere"
            ) from err
        restore_histories(result, histories)
        return last_round, arrays
