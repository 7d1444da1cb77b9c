"""Flower's differential-privacy wrappers, run by the wrapped strategy's own loop.

Flower adds central differential privacy by wrapping a strategy
(``DifferentialPrivacyServerSideFixedClipping(FedAvg(...), ...)``, see Flower's
documentation, "Differential Privacy"). The wrapper's ``start()`` is Flower's
``Strategy.start``: it waits for every sampled node or the timeout and calls the
wrapped strategy's ``configure_train``/``aggregate_train`` itself, so a
flowerbed strategy inside it would lose its deadlines, late updates, asynchrony
and work balancing. The classes here are Flower's wrappers with one change:
``start()`` hands the run to the wrapped flowerbed strategy's loop
(:meth:`~flowerbed.strategies.rounds.RoundLoop.start_wrapped`), which calls the
wrapper's four methods where it would call its own. Clipping, noise and
accounting are Flower's code, unchanged.

Swap the import and nothing else changes::

    from flowerbed.strategies import DeadlineFedAvg
    from flowerbed.strategies import DifferentialPrivacyServerSideFixedClipping

    strategy = DifferentialPrivacyServerSideFixedClipping(
        DeadlineFedAvg(), noise_multiplier=1.0, clipping_norm=1.0,
        num_sampled_clients=20,
    )

Privacy accounting (``accountant=``) needs every round to sample
``num_sampled_clients`` nodes at once; FedBuff hands out work a node at a time,
so an accounted wrapper around FedBuff is refused before the run starts.
"""

from __future__ import annotations

from typing import Any

from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping as _ClientAdaptive,
)
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping as _ClientFixed,
)
from flwr.serverapp.strategy import (
    DifferentialPrivacyServerSideAdaptiveClipping as _ServerAdaptive,
)
from flwr.serverapp.strategy import (
    DifferentialPrivacyServerSideFixedClipping as _ServerFixed,
)
from flwr.serverapp.strategy import Result, Strategy

from .fedbuff import FedBuff
from .rounds import RoundLoop, flower_start_signature


def wrapped_loop(wrapper: Strategy) -> RoundLoop | None:
    """The flowerbed strategy inside ``wrapper`` (through nested wrappers, by
    their ``strategy`` attribute), or None."""
    inner: object = wrapper
    seen: set[int] = set()
    while hasattr(inner, "strategy") and id(inner) not in seen:
        seen.add(id(inner))
        inner = inner.strategy
        if isinstance(inner, RoundLoop):
            return inner
    return None


class _RunsTheWrappedLoop(Strategy):
    """``start()`` by the wrapped flowerbed strategy's loop (see the module)."""

    @flower_start_signature
    def start(self, *args: Any, **kwargs: Any) -> Result:
        """Flower's ``Strategy.start`` arguments; the wrapped flowerbed strategy's
        loop runs the rounds (:meth:`RoundLoop.start_wrapped`)."""
        loop = wrapped_loop(self)
        if loop is None:  # a Flower strategy inside: Flower's loop, as before
            return super().start(*args, **kwargs)
        if isinstance(loop, FedBuff) and getattr(self, "accountant", None):
            raise ValueError(
                f"{type(self).__name__} with an accountant needs rounds that sample "
                "num_sampled_clients nodes at once; FedBuff hands out work a node "
                "at a time. Use DeadlineFedAvg or RuntimeWeightedFedAvg inside it, "
                "or drop accountant="
            )
        return loop.start_wrapped(self, *args, **kwargs)


class DifferentialPrivacyServerSideFixedClipping(_RunsTheWrappedLoop, _ServerFixed):
    """Flower's wrapper of the same name, run by the wrapped strategy's loop."""


class DifferentialPrivacyClientSideFixedClipping(_RunsTheWrappedLoop, _ClientFixed):
    """Flower's wrapper of the same name, run by the wrapped strategy's loop."""


class DifferentialPrivacyServerSideAdaptiveClipping(
    _RunsTheWrappedLoop, _ServerAdaptive
):
    """Flower's wrapper of the same name, run by the wrapped strategy's loop."""


class DifferentialPrivacyClientSideAdaptiveClipping(
    _RunsTheWrappedLoop, _ClientAdaptive
):
    """Flower's wrapper of the same name, run by the wrapped strategy's loop."""
