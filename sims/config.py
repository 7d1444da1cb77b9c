"""The scenario a simulation runs, read from Flower's run config and checked once.

The run config keys and defaults are those of pyproject.toml's
``[tool.flwr.app.config]``; ``flowerbed sim`` and ``flwr run .`` read the same keys.
Every check happens before any data is loaded or any node trains, and each failure
is one line naming the key, the bad value and the valid choices or range
(:data:`LIMITS`). This module imports nothing heavy (no torch, no Flower), so
``flowerbed sim --help`` can list the choices.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

from flowerbed.data import DATASET_DIMS, DATASETS, PARTITIONS
from flowerbed.sims.fleet import FLEETS
from flowerbed.zoo import MODEL_NAMES, ONE_D_MODELS

STRATEGY_NAMES = ("fedavg", "fedprox", "runtime-weighted", "deadline", "fedbuff")
"""Strategies a scenario can name; see ``flowerbed.sims.scenario.build_strategy``."""
SEED_MAX = 2**32 - 1
"""Largest seed: numpy's legacy ``np.random.seed`` (which the run seeds) takes
``[0, 2**32 - 1]``."""
MAX_SECONDS = 7 * 24 * 3600.0
"""Longest deadline or round timeout (a week): longer is a typo, and ``inf`` or
values near the float limit overflow the clocks' arithmetic."""


@dataclass(frozen=True)
class Limit:
    """The valid range of a numeric key: ``low``/``high`` (None: unbounded),
    inclusive or not, and why the bound is there."""

    low: float | None
    high: float | None
    low_open: bool = False
    high_open: bool = False
    note: str = ""

    def admits(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and (
            value < self.low or (self.low_open and value == self.low)
        ):
            return False
        return not (
            self.high is not None
            and (value > self.high or (self.high_open and value == self.high))
        )

    def describe(self) -> str:
        """``in (0, 10]``, ``>= 1``, ... as the error message says it."""

        def num(x: float) -> str:
            return str(int(x)) if float(x).is_integer() else f"{x:g}"

        if self.low is not None and self.high is not None:
            text = (
                f"in {'(' if self.low_open else '['}{num(self.low)}, "
                f"{num(self.high)}{')' if self.high_open else ']'}"
            )
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {num(self.low)}"
        else:
            assert self.high is not None
            text = f"{'<' if self.high_open else '<='} {num(self.high)}"
        return f"{text} ({self.note})" if self.note else text


LIMITS: dict[str, Limit] = {
    "num-nodes": Limit(1, None),
    "num-rounds": Limit(1, 1_000_000, note="a million rounds is a typo"),
    "alpha": Limit(0, 1e6, low_open=True, note="1e6 is already IID"),
    "batch-size": Limit(
        1,
        65_536,
        note="larger than every dataset flowerbed ships (MNIST has 60,000 "
        "training images)",
    ),
    "local-steps": Limit(1, 100_000),
    "learning-rate": Limit(
        0, 10, low_open=True, note="SGD steps above 10 diverge on every model here"
    ),
    "fraction-train": Limit(0, 1, low_open=True),
    "dropout": Limit(
        None, 1, note="a probability; negative: the device profiles' own rates"
    ),
    "target-accuracy": Limit(0, 1, low_open=True),
    "seed": Limit(0, SEED_MAX, note="numpy's seed range"),
    "round-timeout-s": Limit(0, MAX_SECONDS, low_open=True, note="at most a week"),
    "deadline-s": Limit(0, MAX_SECONDS, note="0: none; at most a week"),
    "proximal-mu": Limit(
        0, 1000, note="FedProx's mu; papers use 0.001-1, larger freezes the model"
    ),
    "affinity": Limit(0, 1, low_open=True, note="a share of a node's samples"),
}
"""Valid range of every numeric run-config key (NaN and infinities never are)."""


class ConfigError(ValueError):
    """A run-config value that cannot be used; the message is one actionable line.

    ``key`` is the run-config key at fault, when there is one (so a command line can
    name its own option for it).
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


TYPE_NAMES = {
    bool: "true or false",
    int: "an integer",
    float: "a number",
    str: "a string",
}


@dataclass(frozen=True)
class Scenario:
    """One simulation: fleet, data, model, strategy and training knobs."""

    fleet: str = "mixed"
    num_nodes: int = 10
    num_rounds: int = 10
    strategy: str = "fedavg"
    model: str = "lenet"
    dataset: str = "digits"
    data_dir: str = ""
    partition: str = "iid"
    alpha: float = 0.5
    batch_size: int = 16
    local_steps: int = 10
    learning_rate: float = 0.05
    fraction_train: float = 1.0
    dropout: float = -1.0
    target_accuracy: float = 0.9
    seed: int = 42
    output_dir: str = "outputs"
    round_timeout_s: float = 3600.0
    deadline_s: float = 0.0
    proximal_mu: float = 0.01
    charge_as: str = ""
    """A published model (``flowerbed.models.CHARGED_MODELS``) whose bytes and
    compute the virtual clock charges instead of the trained model's; "" for none."""
    affinity: float = 0.9
    """``device`` partition: share of a node's samples from its group's classes."""

    @classmethod
    def keys(cls) -> list[str]:
        """Run-config keys (kebab-case) this class reads."""
        return [f.name.replace("_", "-") for f in fields(cls)]

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, object]) -> Scenario:
        """Build and check a scenario; raises :class:`ConfigError` on bad input."""
        known = {f.name.replace("_", "-"): f for f in fields(cls)}
        values: dict[str, object] = {}
        for key, value in run_config.items():
            if key not in known:
                raise ConfigError(
                    f"unknown run-config key {key!r}; valid keys: {', '.join(known)}",
                    key,
                )
            field = known[key]
            default = field.default
            wanted = TYPE_NAMES[type(default)]
            if isinstance(value, bool) and not isinstance(default, bool):
                raise ConfigError(
                    f"run-config {key!r} must be {wanted}, got {value!r}", key
                )
            try:
                if isinstance(default, bool):
                    values[field.name] = bool(value)
                elif isinstance(default, int):
                    if isinstance(value, float) and not value.is_integer():
                        raise ValueError
                    values[field.name] = int(value)  # type: ignore[call-overload]
                elif isinstance(default, float):
                    values[field.name] = float(value)  # type: ignore[arg-type]
                else:
                    values[field.name] = str(value)
            except (TypeError, ValueError, OverflowError):
                raise ConfigError(
                    f"run-config {key!r} must be {wanted}, got {value!r}", key
                ) from None
        scenario = cls(**values)  # type: ignore[arg-type]
        scenario.check()
        return scenario

    def check(self) -> None:
        """Raise :class:`ConfigError` for the first unusable value."""
        choices = {
            "fleet": (self.fleet, tuple(FLEETS)),
            "model": (self.model, MODEL_NAMES),
            "dataset": (self.dataset, DATASETS),
            "strategy": (self.strategy, STRATEGY_NAMES),
            "partition": (self.partition, PARTITIONS),
        }
        if self.charge_as:
            from flowerbed.models import CHARGED_MODELS

            choices["charge-as"] = (self.charge_as, tuple(CHARGED_MODELS))
        for key, (value, valid) in choices.items():
            if value not in valid:
                raise ConfigError(
                    f"unknown {key} {value!r}; valid choices: {', '.join(valid)}", key
                )
        # the zoo's names say which models take sequences; no torch needed
        fits = [
            m
            for m in MODEL_NAMES
            if (1 if m in ONE_D_MODELS else 2) == DATASET_DIMS[self.dataset]
        ]
        if self.model not in fits:
            raise ConfigError(
                f"model {self.model!r} does not take {self.dataset!r} samples; "
                f"valid choices for this dataset: {', '.join(fits)}",
                "model",
            )
        values = self.to_run_config()
        for key, limit in LIMITS.items():
            number = values[key]
            assert isinstance(number, int | float)
            if not limit.admits(number):
                raise ConfigError(
                    f"run-config {key!r} must be {limit.describe()}, got {number!r}",
                    key,
                )
        if not self.output_dir.strip():
            raise ConfigError(
                "run-config 'output-dir' must name a folder, got ''", "output-dir"
            )

    def to_run_config(self) -> dict[str, object]:
        """The scenario as Flower run config (kebab-case keys)."""
        return {k.replace("_", "-"): v for k, v in asdict(self).items()}
