"""The server's view of a tiled job's model: its geometry and its state's shapes.

The planner needs the geometry of the model's early layers
(:func:`flowerbed.parallel.tiles.region_ops.front_geometry`), and every array
that reaches the server (``initial_arrays``, rank 0's reply, the optimiser
state) must be the model's state, so member replies are checked here; both come
from one build of the model, made on first use (torch is imported then, not when
the strategy is).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from flowerbed import keys
from flowerbed.replies import ReplyRejected

from .span import SegmentReply


class TileModel:
    """A layered model as the server plans and checks it.

    Parameters
    ----------
    model, model_args, seed
        The model (:func:`flowerbed.parallel.user_code.build_layers`).
    input_shape : tuple of int
        One sample's ``(channels, height, width)``.
    norm : str
        Batch norm in the tiled layers (``"sync"`` or ``"frozen"``).
    """

    def __init__(
        self,
        model: str,
        model_args: Mapping[str, Any],
        seed: int,
        input_shape: tuple[int, ...],
        norm: str,
    ) -> None:
        self.model, self.model_args, self.seed = model, model_args, seed
        self.input_shape, self.norm = input_shape, norm
        self._geometry: Any = None
        self.state_shapes: dict[str, tuple[int, ...]] = {}
        """Each array of the model's state and its shape (after :meth:`geometry`)."""

    def geometry(self) -> Any:
        """The planner's view of the model (built once, on the server)."""
        if self._geometry is None:
            from flowerbed.parallel.tiles.region_ops import front_geometry
            from flowerbed.parallel.user_code import build_layers

            model = build_layers(self.model, self.model_args, seed=self.seed)
            self._geometry = front_geometry(model, self.input_shape, self.norm)
            self.state_shapes = {
                k: tuple(v.shape) for k, v in model.state_dict().items()
            }
        return self._geometry

    def check_arrays(self, arrays: Mapping[str, np.ndarray], what: str) -> None:
        """Raise ValueError unless ``arrays`` is the model's state (names, shapes)."""
        self.geometry()
        wanted = self.state_shapes
        missing = sorted(set(wanted) - set(arrays))
        extra = sorted(set(arrays) - set(wanted))
        if missing or extra:
            raise ValueError(
                f"{what} do not match model {self.model!r}: missing {missing[:4]}, "
                f"unexpected {extra[:4]} (build initial_arrays from "
                "flowerbed.parallel.user_code.build_layers(model, model_args)"
                ".state_dict())"
            )
        for name, shape in wanted.items():
            if tuple(np.shape(arrays[name])) != shape:
                raise ValueError(
                    f"{what}: {name!r} has shape {list(np.shape(arrays[name]))}, "
                    f"the model's is {list(shape)}"
                )

    def check_reply(self, reply: SegmentReply, rank: int) -> None:
        """Raise ReplyRejected unless a finished member's reply has its step's
        compute seconds and MACs and, from rank 0, the train loss, the model's
        state and an optimiser state that belongs to it."""
        for key in (keys.TILES_COMPUTE_S, keys.TILES_MACS):
            value = reply.metrics.get(key)
            if not isinstance(value, int | float) or value < 0:
                raise ReplyRejected(f"metric {key!r} missing or negative: {value!r}")
        if rank != 0:
            return
        if keys.TRAIN_LOSS not in reply.metrics:
            raise ReplyRejected(f"rank 0's reply has no {keys.TRAIN_LOSS!r}")
        try:
            self.check_arrays(reply.arrays, "rank 0's reply arrays")
        except ValueError as err:
            raise ReplyRejected(str(err)) from None
        self.check_optimizer(reply.optimizer)

    def check_optimizer(self, state: Mapping[str, np.ndarray]) -> None:
        """Raise ReplyRejected unless every entry of an optimiser state belongs
        to a parameter: a moment buffer has its parameter's shape, a step count
        none."""
        from flowerbed.parallel.member import OPTIMIZER_SEP  # torch: not at import

        for name, value in state.items():
            param, _, key = name.partition(OPTIMIZER_SEP)
            shape = self.state_shapes.get(param)
            if (
                shape is None
                or tuple(np.shape(value)) not in (shape, ())
                or (not key and tuple(np.shape(value)) != shape)
            ):
                raise ReplyRejected(
                    f"optimiser state {name!r} does not match the model"
                )
