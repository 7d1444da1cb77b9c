"""Large-batch optimisers on NumPy arrays: momentum SGD, LARS and LAMB.

One small class serves the all-reduce members (their parameters and all-reduced
gradients are CPU tensors, viewed as NumPy arrays without a copy) and the
server-side large-batch rounds (the server's model is NumPy arrays). State is
kept by parameter name, so it travels in an ArrayRecord and a checkpoint as it
is (:meth:`LargeBatchOptimizer.state` / :meth:`load_state`). No torch here.

With ``w`` a parameter tensor (a layer), ``g`` its gradient, ``lr`` the step's
learning rate (:class:`flowerbed.parallel.large_batch.recipe.LrSchedule`), ``m`` the
momentum and ``wd`` the weight decay:

- ``"sgd"``, momentum SGD (as ``torch.optim.SGD``): ``v <- m v + (g + wd w)``;
  ``w <- w - lr v``.
- ``"lars"`` (You, Gitman, Ginsburg, "Large Batch Training of Convolutional
  Networks", arXiv:1708.03888, Algorithm 1): a local rate per layer
  ``lambda = eta ||w|| / (||g|| + wd ||w||)`` with trust coefficient ``eta``
  (theirs: 0.001); ``v <- m v + lr lambda (g + wd w)``; ``w <- w - v``.
- ``"lamb"`` (You et al., "Large Batch Optimization for Deep Learning: Training
  BERT in 76 minutes", ICLR 2020, Algorithm 2, ``phi`` the identity):
  ``m1 <- b1 m1 + (1 - b1) g``; ``m2 <- b2 m2 + (1 - b2) g^2``;
  ``r = (m1 / (1 - b1^t)) / (sqrt(m2 / (1 - b2^t)) + eps)``;
  ``w <- w - lr ||w|| / ||r + wd w|| (r + wd w)``, ``t`` counting steps from 1.

Where a norm in a ratio is 0 (a layer initialised to zeros, a zero gradient)
the ratio is 1. With ``exclude_1d`` (default) 1-D tensors (biases) take the
plain update (ratio 1, no weight decay): a bias starts at zero, where the
layer-wise ratio says nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

OPTIMIZERS = ("sgd", "lars", "lamb")
"""Valid optimiser kinds."""
STEP_KEY = "step"
"""State entry holding the number of steps taken (LAMB's bias correction)."""


class LargeBatchOptimizer:
    """Momentum SGD, LARS or LAMB over named NumPy arrays (see the module doc).

    Parameters
    ----------
    kind : str
        One of :data:`OPTIMIZERS`.
    momentum : float (default: 0.9)
        ``m`` of SGD and LARS, in [0, 1).
    weight_decay : float (default: 0.0)
        ``wd`` (>= 0).
    trust : float (default: 0.001)
        LARS's trust coefficient ``eta`` (> 0).
    betas : tuple[float, float] (default: (0.9, 0.999))
        LAMB's ``b1``, ``b2``, each in [0, 1).
    eps : float (default: 1e-6)
        LAMB's ``eps`` (> 0).
    exclude_1d : bool (default: True)
        Plain update for 1-D tensors (module doc).
    """

    def __init__(
        self,
        kind: str,
        *,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust: float = 0.001,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        exclude_1d: bool = True,
    ) -> None:
        if kind not in OPTIMIZERS:
            raise ValueError(
                f"unknown optimiser {kind!r}; valid choices: {', '.join(OPTIMIZERS)}"
            )
        checks = [
            (0 <= momentum < 1, f"momentum must be in [0, 1), got {momentum}"),
            (
                math.isfinite(weight_decay) and weight_decay >= 0,
                f"weight_decay must be >= 0, got {weight_decay}",
            ),
            (math.isfinite(trust) and trust > 0, f"trust must be > 0, got {trust}"),
            (
                all(0 <= b < 1 for b in betas) and len(betas) == 2,
                f"betas must be two numbers in [0, 1), got {betas}",
            ),
            (math.isfinite(eps) and eps > 0, f"eps must be > 0, got {eps}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        self.kind = kind
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        self.trust = float(trust)
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.exclude_1d = exclude_1d
        self.steps = 0
        self.buffers: dict[str, dict[str, np.ndarray]] = {}
        """Buffer kind (``momentum``, ``exp_avg``, ``exp_avg_sq``) -> name -> array."""

    # ------------------------------------------------------------------ update
    def step(
        self,
        params: Mapping[str, np.ndarray],
        grads: Mapping[str, np.ndarray],
        lr: float,
    ) -> dict[str, float]:
        """Update every array of ``params`` in place from ``grads``.

        Returns the layer-wise ratio used for each parameter (1.0 for SGD and
        for excluded tensors): ``lambda / eta``-style diagnostics for logs.
        Raises ValueError for a learning rate that is not finite and > 0, or
        gradients whose names or shapes differ from the parameters'.
        """
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"learning rate must be > 0 and finite, got {lr}")
        if set(params) != set(grads):
            missing = sorted(set(params) ^ set(grads))
            raise ValueError(f"parameters and gradients differ in names: {missing}")
        self.steps += 1
        ratios = {}
        for name, w in params.items():
            g = np.asarray(grads[name])
            if g.shape != w.shape:
                raise ValueError(
                    f"gradient of {name!r} has shape {g.shape}, parameter {w.shape}"
                )
            plain = self.exclude_1d and w.ndim <= 1
            if self.kind == "lamb":
                ratios[name] = self._lamb(name, w, g, lr, plain)
            else:
                ratios[name] = self._momentum(name, w, g, lr, plain)
        return ratios

    def _buffer(self, kind: str, name: str, like: np.ndarray) -> np.ndarray:
        store = self.buffers.setdefault(kind, {})
        if name not in store:
            store[name] = np.zeros_like(like)
        return store[name]

    def _momentum(
        self, name: str, w: np.ndarray, g: np.ndarray, lr: float, plain: bool
    ) -> float:
        wd = 0.0 if plain else self.weight_decay
        update = g + wd * w if wd else g.copy()
        ratio = 1.0
        if self.kind == "lars" and not plain:
            w_norm = float(np.linalg.norm(w))
            g_norm = float(np.linalg.norm(g))
            denominator = g_norm + wd * w_norm
            if w_norm > 0 and denominator > 0:
                ratio = self.trust * w_norm / denominator
        v = self._buffer("momentum", name, w)
        v *= self.momentum
        if self.kind == "lars":
            v += (lr * ratio) * update
            w -= v
        else:
            v += update
            w -= lr * v
        return ratio

    def _lamb(
        self, name: str, w: np.ndarray, g: np.ndarray, lr: float, plain: bool
    ) -> float:
        b1, b2 = self.betas
        m1 = self._buffer("exp_avg", name, w)
        m2 = self._buffer("exp_avg_sq", name, w)
        m1 *= b1
        m1 += (1 - b1) * g
        m2 *= b2
        m2 += (1 - b2) * g * g
        t = self.steps
        r = (m1 / (1 - b1**t)) / (np.sqrt(m2 / (1 - b2**t)) + self.eps)
        wd = 0.0 if plain else self.weight_decay
        if wd:
            r = r + wd * w
        ratio = 1.0
        if not plain:
            w_norm = float(np.linalg.norm(w))
            r_norm = float(np.linalg.norm(r))
            if w_norm > 0 and r_norm > 0:
                ratio = w_norm / r_norm
        w -= (lr * ratio) * r
        return ratio

    # ------------------------------------------------------------------ state
    def state(self) -> dict[str, np.ndarray]:
        """Flat state: ``"<buffer>/<parameter>"`` arrays and ``"step"``."""
        out = {
            f"{kind}/{name}": array
            for kind, store in self.buffers.items()
            for name, array in store.items()
        }
        out[STEP_KEY] = np.array(self.steps, dtype=np.int64)
        return out

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore what :meth:`state` returned (copies; ValueError if malformed)."""
        buffers: dict[str, dict[str, np.ndarray]] = {}
        steps = 0
        for key, array in state.items():
            if key == STEP_KEY:
                steps = int(np.asarray(array).reshape(-1)[0])
                continue
            kind, sep, name = key.partition("/")
            if not sep or kind not in ("momentum", "exp_avg", "exp_avg_sq"):
                raise ValueError(f"optimiser state has an unknown entry {key!r}")
            buffers.setdefault(kind, {})[name] = np.array(array, copy=True)
        if steps < 0:
            raise ValueError(f"optimiser state step {steps} is negative")
        self.buffers = buffers
        self.steps = steps
