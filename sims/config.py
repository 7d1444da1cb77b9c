"""The scenario a simulation runs, read from Flower's run config and checked once.

The run config keys and defaults are those of pyproject.toml's
``[tool.flwr.app.config]``; ``flowerbed sim`` and ``flwr run .`` read the same keys.
Every check happens before any data is loaded or any node trains, and each failure
is one line naming the key, the bad value and the valid choices.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

from flowerbed.data import DATASET_DIMS, DATASETS, PARTITIONS
from flowerbed.models import CHARGED_MODELS, MODELS, model_dims
from flowerbed.sims.fleet import FLEETS

STRATEGY_NAMES = ("fedavg", "fedprox", "runtime-weighted", "deadline", "fedbuff")
"""Strategies a scenario can name; see ``flowerbed.sims.scenario.build_strategy``."""


class ConfigError(ValueError):
    """A run-config value that cannot be used; the message is one actionable line."""


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
                    f"unknown run-config key {key!r}; valid keys: {', '.join(known)}"
                )
            field = known[key]
            default = field.default
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
            except (TypeError, ValueError):
                raise ConfigError(
                    f"run-config {key!r} must be a {type(default).__name__}, "
                    f"got {value!r}"
                ) from None
        scenario = cls(**values)  # type: ignore[arg-type]
        scenario.check()
        return scenario

    def check(self) -> None:
        """Raise :class:`ConfigError` for the first unusable value."""
        choices = {
            "fleet": (self.fleet, tuple(FLEETS)),
            "model": (self.model, tuple(MODELS)),
            "dataset": (self.dataset, DATASETS),
            "strategy": (self.strategy, STRATEGY_NAMES),
            "partition": (self.partition, PARTITIONS),
        }
        if self.charge_as:
            choices["charge-as"] = (self.charge_as, tuple(CHARGED_MODELS))
        for key, (value, valid) in choices.items():
            if value not in valid:
                raise ConfigError(
                    f"unknown {key} {value!r}; valid choices: {', '.join(valid)}"
                )
        if model_dims(self.model) != DATASET_DIMS[self.dataset]:
            fits = [m for m in MODELS if model_dims(m) == DATASET_DIMS[self.dataset]]
            raise ConfigError(
                f"model {self.model!r} does not take {self.dataset!r} samples; "
                f"valid choices for this dataset: {', '.join(fits)}"
            )
        ranges: list[tuple[str, float, bool, str]] = [
            ("num-nodes", self.num_nodes, self.num_nodes >= 1, ">= 1"),
            ("num-rounds", self.num_rounds, self.num_rounds >= 1, ">= 1"),
            ("alpha", self.alpha, self.alpha > 0, "> 0"),
            ("batch-size", self.batch_size, self.batch_size >= 1, ">= 1"),
            ("local-steps", self.local_steps, self.local_steps >= 1, ">= 1"),
            ("learning-rate", self.learning_rate, self.learning_rate > 0, "> 0"),
            (
                "fraction-train",
                self.fraction_train,
                0 < self.fraction_train <= 1,
                "in (0, 1]",
            ),
            (
                "dropout",
                self.dropout,
                self.dropout < 0 or self.dropout <= 1,
                "in [0, 1], or negative for the device profiles' own rates",
            ),
            (
                "target-accuracy",
                self.target_accuracy,
                0 < self.target_accuracy <= 1,
                "in (0, 1]",
            ),
            (
                "round-timeout-s",
                self.round_timeout_s,
                self.round_timeout_s > 0,
                "> 0",
            ),
            ("deadline-s", self.deadline_s, self.deadline_s >= 0, ">= 0 (0: none)"),
            ("proximal-mu", self.proximal_mu, self.proximal_mu >= 0, ">= 0"),
            ("affinity", self.affinity, 0 < self.affinity <= 1, "in (0, 1]"),
        ]
        for key, number, ok, rule in ranges:
            if not ok:
                raise ConfigError(f"run-config {key!r} must be {rule}, got {number!r}")

    def to_run_config(self) -> dict[str, object]:
        """The scenario as Flower run config (kebab-case keys)."""
        return {k.replace("_", "-"): v for k, v in asdict(self).items()}
