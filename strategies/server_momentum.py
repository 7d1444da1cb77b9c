"""The server optimiser of FedBuff's Alg. 1: SGD with momentum on the buffered update.

With ``u_v`` the update the buffer proposes (``proposed = x_v + u_v``) and
``beta`` the momentum (FedAvgM, Hsu et al., 2019, Sec. 3)::

    m_(v+1) = beta m_v + u_v,   x_(v+1) = x_v + m_(v+1)      (m_0 = 0)

on float arrays; other arrays take ``proposed`` as it is.
"""

from __future__ import annotations

import numpy as np
from flowerbed.strategies.accumulation import to_arrayrecord, to_numpy
from flwr.app import ArrayRecord


class ServerMomentum:
    """``m_v`` per float array, and the step that updates it (module docstring).

    Parameters
    ----------
    beta : float
        The momentum, in [0, 1); 0 leaves every proposal as it is.
    """

    def __init__(self, beta: float) -> None:
        self.beta = beta
        self.velocity: dict[str, np.ndarray] = {}
        """``m_v`` of each float array (empty: ``m_0 = 0``)."""

    def reset(self) -> None:
        """Back to ``m_0 = 0`` (a new run)."""
        self.velocity = {}

    def step(
        self, proposed: ArrayRecord, current: dict[str, np.ndarray]
    ) -> ArrayRecord:
        """``x_v + m_(v+1)`` from ``proposed = x_v + u_v`` and ``current = x_v``;
        ``proposed`` itself when ``beta`` is 0 or there is no ``current``."""
        beta = self.beta
        if beta == 0.0 or not current:
            return proposed
        out: dict[str, np.ndarray] = {}
        for name, value in to_numpy(proposed).items():
            base = current.get(name)
            if base is None or value.dtype.kind != "f" or base.shape != value.shape:
                out[name] = value
                continue
            step = value.astype(np.float64) - base
            previous = self.velocity.get(name)
            if previous is not None and previous.shape == step.shape:
                step += beta * previous
            self.velocity[name] = step
            out[name] = (base + step).astype(value.dtype)
        return to_arrayrecord(out)
