"""A user's model, loss and optimiser in a span job, named so every board can load them.

Flower starts a fresh ClientApp process for each message on every board, so no
Python object travels from the ServerApp to the members: what travels is a
*name*, ``"package.module:attribute"`` — the form Flower itself uses for
``serverapp`` and ``clientapp`` in ``pyproject.toml`` and that
:func:`importlib.import_module` plus :func:`getattr` resolve. The name rides in
the member's plan (:attr:`~flowerbed.parallel.plan.MemberPlan.options`), and the
board imports it, so the module must be installed on every board (and on the
server, which checks that the names resolve before it sends anything).

- :class:`Training` — a loss function and a ``torch.optim`` optimiser factory
  (with its keyword arguments), an option of every span strategy
  (``PipelineTraining``, ``LargeBatchSync``, ``TiledTraining``). The defaults
  keep each strategy's own training: cross-entropy, and SGD (LARS/LAMB for
  large batch). :meth:`Training.from_run_config` reads it from a Flower run
  config (``loss``, ``optimizer``, ``optimizer-args``).
- :func:`build_module` — any ``nn.Module`` by name (data parallelism cuts
  nothing); :func:`build_layers` — a model a pipeline or a tile job can cut: an
  ``nn.Sequential``, or a module that declares its cut points with a
  ``pipeline_layers()`` method (:data:`CUT_METHOD`).

Exactness holds with a user's loss and optimiser as with the defaults, under two
conditions the methods need: the loss of a batch must be the *mean* of per-sample
losses (pipeline micro-batches and large-batch shares are combined as a mean,
``loss_fn(logits, target)`` with a ``reduction="mean"``-like result), and the
optimiser must update each parameter from its own gradient and state (every
``torch.optim`` optimiser except ``LBFGS``: a pipeline stage or a tile member
steps only the parameters it holds).
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

SPEC_FORM = "package.module:attribute"
"""The one form of a name (``"torch.optim:AdamW"``, ``"mylab.losses:smooth"``)."""
_SPEC = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")

DEFAULT_LOSS = "cross-entropy"
"""The loss every span strategy trains with unless told otherwise
(``torch.nn.functional.cross_entropy``, mean over the batch)."""
DEFAULT_OPTIMIZER = ""
"""Empty: the strategy's own optimiser (SGD; LARS/LAMB for large batch)."""

LOSS = "loss"
"""Plan option and run-config key: the loss (:data:`DEFAULT_LOSS` or a name)."""
OPTIMIZER_FACTORY = "optimizer-factory"
"""Plan option: the optimiser factory's name (empty: the strategy's own)."""
OPTIMIZER_ARGS = "optimizer-args"
"""Plan option and run-config key: the factory's keyword arguments (an object;
JSON text in a run config)."""
RUN_CONFIG_OPTIMIZER = "optimizer"
"""Run-config key of the optimiser factory's name."""
RESERVED_ARGS = ("params", "lr")
"""Keyword arguments the member passes itself: the parameters it holds and the
strategy's learning rate (which follows the strategy's schedule)."""

CUT_METHOD = "pipeline_layers"
"""A module that is not an ``nn.Sequential`` can still be cut if it has this
method: it returns an ``nn.Sequential`` of the module's own parts, in the order
``forward`` applies them, each taking one tensor and returning one tensor."""


class UserCodeError(ValueError):
    """A name that is malformed, does not import, or names the wrong kind of thing."""


def check_spec(spec: object, what: str) -> str:
    """``spec`` if it has the form :data:`SPEC_FORM`; else :class:`UserCodeError`."""
    if not isinstance(spec, str) or not _SPEC.match(spec):
        raise UserCodeError(
            f"{what} {spec!r} is not a name of the form '{SPEC_FORM}' (e.g. "
            "'torch.optim:AdamW', 'mylab.losses:smooth_ce'): the module must be "
            "importable on every board and on the server"
        )
    return spec


def load(spec: str, what: str) -> Any:
    """Import the object ``spec`` names (:data:`SPEC_FORM`), naming what failed."""
    check_spec(spec, what)
    module_name, _, attribute = spec.partition(":")
    try:
        value: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise UserCodeError(
            f"{what} {spec!r}: module {module_name!r} cannot be imported here "
            f"({type(err).__name__}: {err}); install it on every board and on "
            "the server"
        ) from None
    for part in attribute.split("."):
        if not hasattr(value, part):
            raise UserCodeError(
                f"{what} {spec!r}: module {module_name!r} has no attribute "
                f"{attribute!r}"
            )
        value = getattr(value, part)
    if not callable(value):
        raise UserCodeError(
            f"{what} {spec!r} is a {type(value).__name__}, not a function or class"
        )
    return value


LossFn = Callable[[Any, Any], Any]
"""``loss(logits, target) -> scalar tensor``, the mean over the batch."""


@dataclass(frozen=True)
class Training:
    """A user's loss function and optimiser factory for a span job (module doc).

    Parameters
    ----------
    loss : str (default: "cross-entropy")
        ``"cross-entropy"``, or the name (``"package.module:function"``) of a
        function ``loss(logits, target) -> scalar tensor`` that averages over
        the batch (e.g. ``torch.nn.functional.cross_entropy`` with label
        smoothing, wrapped in your own module).
    optimizer : str (default: "")
        Empty for the strategy's own optimiser, or the name of a
        ``torch.optim.Optimizer`` class or factory called as
        ``factory(params, lr=lr, **optimizer_args)`` — e.g.
        ``"torch.optim:AdamW"``. ``lr`` is the strategy's (its schedule, for
        large batch); the strategy's ``momentum`` and ``weight_decay`` are not
        passed: put them in ``optimizer_args``.
    optimizer_args : mapping (default: empty)
        JSON-compatible keyword arguments of the factory, except ``params`` and
        ``lr``.
    """

    loss: str = DEFAULT_LOSS
    optimizer: str = DEFAULT_OPTIMIZER
    optimizer_args: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.loss != DEFAULT_LOSS:
            check_spec(self.loss, f"loss (or {DEFAULT_LOSS!r})")
        if self.optimizer != DEFAULT_OPTIMIZER:
            check_spec(self.optimizer, "optimizer (or '' for the strategy's own)")
        if not isinstance(self.optimizer_args, Mapping):
            raise UserCodeError(
                f"optimizer_args must be a mapping of keyword arguments, got "
                f"{type(self.optimizer_args).__name__}"
            )
        if self.optimizer_args and self.optimizer == DEFAULT_OPTIMIZER:
            raise UserCodeError(
                "optimizer_args are given but no optimizer: name the factory they "
                "are for (e.g. optimizer='torch.optim:AdamW')"
            )
        reserved = sorted(set(self.optimizer_args) & set(RESERVED_ARGS))
        if reserved:
            raise UserCodeError(
                f"optimizer_args may not set {reserved}: the member passes the "
                "parameters it holds and the strategy's learning rate"
            )
        try:
            json.dumps(dict(self.optimizer_args))
        except (TypeError, ValueError) as err:
            raise UserCodeError(
                f"optimizer_args must be JSON values (they travel in the plan): {err}"
            ) from None
        object.__setattr__(self, "optimizer_args", dict(self.optimizer_args))

    @property
    def custom_optimizer(self) -> bool:
        """Whether the optimiser is the user's (not the strategy's own)."""
        return self.optimizer != DEFAULT_OPTIMIZER

    def describe(self, default_optimizer: str) -> str:
        """One line for a strategy's summary: the loss and the optimiser."""
        optimizer = default_optimizer
        if self.custom_optimizer:
            args = ", ".join(f"{k}={v!r}" for k, v in self.optimizer_args.items())
            optimizer = f"{self.optimizer}({args})"
        return f"loss {self.loss}, optimiser {optimizer}"

    def check(self) -> None:
        """Import the loss and the factory here (the server), so a bad name fails
        before any message is sent."""
        if self.loss != DEFAULT_LOSS:
            load(self.loss, "loss")
        if self.custom_optimizer:
            load(self.optimizer, "optimizer")

    def to_options(self) -> dict[str, Any]:
        """The plan options that carry it to the members."""
        return {
            LOSS: self.loss,
            OPTIMIZER_FACTORY: self.optimizer,
            OPTIMIZER_ARGS: dict(self.optimizer_args),
        }

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> Training:
        """The :class:`Training` a plan's options carry (defaults when absent)."""
        args = options.get(OPTIMIZER_ARGS) or {}
        if not isinstance(args, Mapping):
            raise UserCodeError(
                f"plan option {OPTIMIZER_ARGS!r} must be an object, got {args!r}"
            )
        return cls(
            loss=str(options.get(LOSS, DEFAULT_LOSS)),
            optimizer=str(options.get(OPTIMIZER_FACTORY, DEFAULT_OPTIMIZER)),
            optimizer_args=args,
        )

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> Training:
        """Read ``loss``, ``optimizer`` and ``optimizer-args`` (JSON object text)
        from a Flower run config (``[tool.flwr.app.config]`` or ``flwr run
        --run-config``); absent keys keep the defaults."""
        loss = run_config.get(LOSS, DEFAULT_LOSS)
        optimizer = run_config.get(RUN_CONFIG_OPTIMIZER, DEFAULT_OPTIMIZER)
        raw = run_config.get(OPTIMIZER_ARGS, "")
        for key, value in ((LOSS, loss), (RUN_CONFIG_OPTIMIZER, optimizer)):
            if not isinstance(value, str):
                raise UserCodeError(
                    f"run config {key!r} must be a string of the form "
                    f"'{SPEC_FORM}', got {value!r}"
                )
        if not isinstance(raw, str):
            raise UserCodeError(
                f"run config {OPTIMIZER_ARGS!r} must be a JSON object in a string, "
                f"e.g. '{{\"weight_decay\": 0.01}}', got {raw!r}"
            )
        try:
            args = json.loads(raw) if raw.strip() else {}
        except ValueError as err:
            raise UserCodeError(
                f"run config {OPTIMIZER_ARGS!r} is not valid JSON ({err}): write an "
                "object, e.g. '{\"weight_decay\": 0.01}'"
            ) from None
        if not isinstance(args, dict):
            raise UserCodeError(
                f"run config {OPTIMIZER_ARGS!r} must be a JSON object, got {raw!r}"
            )
        return cls(loss=loss, optimizer=optimizer, optimizer_args=args)

    def loss_fn(self) -> LossFn:
        """The loss function (imported on first use)."""
        if self.loss == DEFAULT_LOSS:
            import torch.nn.functional as F

            return F.cross_entropy
        return load(self.loss, "loss")  # type: ignore[no-any-return]

    def make_optimizer(
        self, params: Iterable[Any], lr: float, default: Callable[[list[Any]], Any]
    ) -> Any:
        """The optimiser of ``params``: ``default(params)`` unless the user named
        a factory, which is called as ``factory(params, lr=lr, **optimizer_args)``
        and must return a ``torch.optim.Optimizer``."""
        params = list(params)
        if not self.custom_optimizer:
            return default(params)
        import torch

        factory = load(self.optimizer, "optimizer")
        try:
            optimizer = factory(params, lr=lr, **self.optimizer_args)
        except TypeError as err:
            raise UserCodeError(
                f"optimizer {self.optimizer!r} cannot be called as "
                f"factory(params, lr=..., **{self.optimizer_args}): {err}"
            ) from None
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UserCodeError(
                f"optimizer {self.optimizer!r} returned a "
                f"{type(optimizer).__name__}, not a torch.optim.Optimizer"
            )
        if isinstance(optimizer, torch.optim.LBFGS):
            raise UserCodeError(
                f"optimizer {self.optimizer!r} is LBFGS, which needs the whole "
                "model's loss closure: a member steps only the parameters it holds"
            )
        return optimizer


def set_lr(optimizer: Any, lr: float) -> None:
    """Give every parameter group of a ``torch.optim`` optimiser the rate ``lr``."""
    for group in optimizer.param_groups:
        group["lr"] = lr


# --------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------


def build_module(
    name: str, args: Mapping[str, Any] | None = None, seed: int | None = None
) -> Any:
    """Any ``nn.Module``: a name of ``flowerbed.models.SEQUENTIAL_MODELS`` or a
    factory ``"package.module:function"`` called with ``args``.

    :func:`flowerbed.models.build_named_module` builds it (conv and linear
    layers He-initialised from ``seed`` if given, so every process building the
    same name gets the same weights); a name that does not import, arguments the
    factory refuses or a result that is no ``nn.Module`` raise
    :class:`UserCodeError`.
    """
    from flowerbed.models import build_named_module

    return build_named_module(
        name,
        args,
        seed,
        importer=lambda spec: load(spec, "model"),
        error=UserCodeError,
    )


def cut_points(model: Any, name: str = "") -> Any:
    """The ``nn.Sequential`` a pipeline or tile job cuts (module doc).

    An ``nn.Sequential`` is its own cut points. Another module gives them with
    ``pipeline_layers()`` (:data:`CUT_METHOD`); every weight and buffer of the
    module must belong to one of those layers. Anything else raises
    :class:`flowerbed.models.ModelCutError` saying what cannot be cut and the
    ways out.
    """
    from flowerbed.models import ModelCutError
    from torch import nn

    label = f"model {name!r}" if name else "the model"
    if isinstance(model, nn.Sequential):
        return model
    method = getattr(model, CUT_METHOD, None)
    if not callable(method):
        raise ModelCutError(
            f"{label} is a {type(model).__name__}, not an nn.Sequential, and has "
            f"no {CUT_METHOD}() method, so it cannot be cut: its forward is "
            "arbitrary code, and a pipeline or tile job cuts only between the "
            "top-level layers of an nn.Sequential. Build it as an "
            f"nn.Sequential, give {type(model).__name__} a {CUT_METHOD}() method "
            "returning an nn.Sequential of its parts in forward order (keep each "
            "residual block whole, as one layer), or train it with LargeBatchSync, "
            "which takes any nn.Module"
        )
    layers = method()
    if not isinstance(layers, nn.Sequential):
        raise ModelCutError(
            f"{label}: {CUT_METHOD}() returned a {type(layers).__name__}, not an "
            "nn.Sequential"
        )
    held = {id(t) for t in [*layers.parameters(), *layers.buffers()]}
    outside = [
        n
        for n, t in [*model.named_parameters(), *model.named_buffers()]
        if id(t) not in held
    ]
    if outside:
        raise ModelCutError(
            f"{label}: {CUT_METHOD}() leaves out {len(outside)} weights or buffers "
            f"of the model, e.g. {outside[:3]}: every part forward uses must be "
            "one of the layers"
        )
    return layers


def build_layers(
    name: str, args: Mapping[str, Any] | None = None, seed: int | None = None
) -> Any:
    """The layered model of a pipeline or tile job: :func:`build_module` then
    :func:`cut_points`. Its ``state_dict`` names (``"0.weight"`` ...) are the
    job's array names."""
    return cut_points(build_module(name, args, seed), name)
