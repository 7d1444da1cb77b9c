"""The strategy suite: workloads where the choice of strategy matters, and its runs.

Every cell is one (workload, configuration, seed) on the in-process engine
(:mod:`flowerbed.sims.engine`), on virtual time, so the figures do not depend on how
busy this machine is.

Workloads (:data:`WORKLOADS`): a population of devices of which a cohort trains
each round, the devices' eligibility following
:class:`flowerbed.sims.availability.DiurnalAvailability` and each task failing as
its device profile says (:func:`flowerbed.sims.vclock.drop_probability`); data
either IID, correlated with the device class (the ``device`` partition of
:func:`flowerbed.data.partition`: slow phones hold classes the fast ones rarely see)
or split by its own writers (Synthetic(1, 1), FedProx Sec. 5.1, each writer shared
by several devices). The virtual clock
charges every task as a published phone-class model (``charge_as``,
:data:`flowerbed.models.CHARGED_MODELS`) while a small model is trained for real.

Configurations (:data:`CONFIGS`): Flower's FedAvg waiting for every sampled node;
Flower's FedAvg and FedProx with ``start(timeout=...)`` at quantiles of the fleet's
task-time distribution (:func:`task_seconds`), the best chosen per workload with
hindsight (:func:`best_config`); Flower's FedAvg over-sampling by hand (a larger
``fraction_train`` with a timeout); flowerbed's strategies with their defaults, one
setting for every workload (:data:`flowerbed.sims.scenario.STRATEGIES`).

A run stops at the workload's virtual-time budget or round cap, whichever comes
first (:class:`Evaluator` raises :class:`BudgetSpent` from ``evaluate_fn``).
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
from flowerbed import keys
from flowerbed.data import (
    SYNTHETIC_ALPHA,
    SYNTHETIC_BETA,
    SYNTHETIC_MAX_SAMPLES,
    SYNTHETIC_SEED,
    SYNTHETIC_WRITERS,
    Dataset,
    group_label_shares,
    make_synthetic,
    partition,
    standardise,
)
from flowerbed.grid import GridWrapper
from flowerbed.models import build_model, charged_costs, cost_factor, model_num_bytes
from flowerbed.sims import vclock
from flowerbed.sims.availability import AvailabilityGrid, DiurnalAvailability
from flowerbed.sims.config import Scenario
from flowerbed.sims.fleet import assign_devices, speed_groups
from flowerbed.sims.node import cached_dataset
from flowerbed.sims.scenario import STRATEGIES, build_fleet_grid, flower_args
from flowerbed.strategies.options import RECOMMENDED_DEADLINES
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, FedProx, Strategy

WAIT_ALL_TIMEOUT_S = 3600.0
"""Flower's own default ``start(timeout=...)``: what "waiting for all" means."""
TIMEOUT_QUANTILES = (0.25, 0.5, 0.75)
"""Quantiles of the task-time distribution the Flower timeout sweep tries."""
TIMEOUT_MARGIN = 1.01
"""A timeout at quantile q is 1% above that task time, so the replies it waits
for arrive before it."""
OVER_SAMPLING = 1.3
"""Over-selection factor (Bonawitz et al. 2019, Sec. 2.3; FedScale's default)."""
TARGET_FRACTIONS = (0.8, 0.9, 0.95)
"""Targets: these fractions of the workload's converged accuracy."""
HEADLINE_FRACTION = 0.95
RECOMMENDED = "deadline"
"""flowerbed's one recommended default (the README's ``strategy = "deadline"``):
the headline and every workload's comparison use it, whichever flowerbed
configuration happened to do best on a workload."""
EQUAL_ROUNDS = (10, 25, 50)
CI_LEVEL = 0.95


MNIST1D_BUDGET_ROUNDS = 240
"""mnist1d's budget in median task times: long enough that the best runs level
off near the converged accuracy (at 60, the published suite's first budget, they
stopped at ~46% of a ~66% plateau)."""


SYNTHETIC_BUDGET_ROUNDS = 120
"""synthetic's budget in median task times: Flower's best timeout levels off
near 75-80% by ~100 (at 40, the first budget, runs stopped far below it)."""


SMALL_FLEET = 20
"""Devices of the small-fleet workloads, every one sampled every round."""
MIXED_BUDGET_ROUNDS = 120
"""mixed-population's budget in median task times (half mnist1d's: a new row
that gives up length, and seeds, before the headline rows give up rigour)."""


class BudgetSpent(Exception):
    """Raised from ``evaluate_fn`` when a run has used its virtual-time budget."""


@dataclass(frozen=True)
class Workload:
    """One benchmark workload: data, model, population, cohort, clock and budget."""

    name: str
    description: str
    dataset: str
    model: str
    partition: str
    fleet: str
    population: int
    cohort: int
    charge_as: str
    availability: bool
    budget_rounds: int
    """The budget is this many rounds of the median device's task time."""
    learning_rate: float = 0.5
    local_steps: int = 10
    batch_size: int = 32
    max_seeds: int = 0
    """Run at most this many of the run's seeds here (0: all of them): new rows
    give up seeds before the headline workloads give up rigour."""

    @property
    def fraction(self) -> float:
        """``fraction_train`` that samples ``cohort`` devices at mean eligibility."""
        eligible = self.population * (
            DiurnalAvailability.mean if self.availability else 1.0
        )
        return min(1.0, self.cohort / eligible)


def _small_fleet(
    name: str, fleet: str, description: str, size: int = SMALL_FLEET
) -> Workload:
    """A small fleet sampled whole: ``size`` devices of ``fleet``, digits IID,
    LeNet-5 charged as itself, always available."""
    return Workload(
        name,
        description,
        "digits",
        "lenet",
        "iid",
        fleet,
        size,
        size,
        "",
        False,
        15,
        learning_rate=0.05,
        local_steps=10,
        batch_size=16,
    )


def _phone_population(
    name: str,
    description: str,
    dataset: str,
    model: str,
    partition: str,
    budget_rounds: int,
) -> Workload:
    """A large phone population: 1,000 ``phones-10x`` devices, a cohort of 20,
    charged as MobileNet, under diurnal availability."""
    return Workload(
        name,
        description,
        dataset,
        model,
        partition,
        fleet="phones-10x",
        population=1000,
        cohort=20,
        charge_as="mobilenet-v1-0.5-160",
        availability=True,
        budget_rounds=budget_rounds,
    )


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        _phone_population(
            "mnist1d-device",
            "MNIST-1D, device-correlated labels: slow phones hold classes 0-4, "
            "the fast ones see them in 10% of their data",
            "mnist1d",
            "mlp",
            "device",
            MNIST1D_BUDGET_ROUNDS,
        ),
        _phone_population(
            "mnist1d-iid",
            "MNIST-1D, IID",
            "mnist1d",
            "mlp",
            "iid",
            MNIST1D_BUDGET_ROUNDS,
        ),
        _phone_population(
            "synthetic",
            "Synthetic(1, 1) of FedProx (Li et al., MLSys 2020, Sec. 5.1), 100 "
            "writers, each split over 10 devices (natural non-IID: a device holds "
            "mostly one or two classes). Not one writer per device: one global "
            "linear model cannot fit 1,000 writers' own models (the centralised "
            "ceilings below); FedProx's own 30 writers would leave a test set of "
            "under 1,000 samples",
            "synthetic",
            "logreg",
            "natural",
            SYNTHETIC_BUDGET_ROUNDS,
        ),
        _small_fleet(
            "digits",
            "phones-10x",
            "scikit-learn digits, IID, 50 phones all sampled, LeNet-5 charged as "
            "itself, always available (the previous benchmark's setting)",
            size=50,
        ),
        _small_fleet(
            "boards",
            "boards",
            "scikit-learn digits, IID, 20 Raspberry Pi 3B/4B/5 and Jetson Nano boards "
            "all sampled every round, always available, LeNet-5 charged as itself "
            "(task times ~8x apart)",
        ),
        _small_fleet(
            "uniform",
            "uniform",
            "scikit-learn digits, IID, 20 identical Raspberry Pi 4B boards all sampled "
            "every round: the control, where no strategy has anything to gain",
        ),
        _small_fleet(
            "boards-2x",
            "boards-2x",
            "scikit-learn digits, IID, 20 boards, half Raspberry Pi 4B and half Pi 5, "
            "all sampled every round (task times ~1.5x apart)",
        ),
        _small_fleet(
            "boards-4x",
            "boards-4x",
            "scikit-learn digits, IID, 20 boards, half Raspberry Pi 3B and half Pi 5, "
            "all sampled every round (task times ~4x apart)",
        ),
        _small_fleet(
            "mixed-20",
            "mixed",
            "scikit-learn digits, IID, 20 phones and boards of the `mixed` fleet all "
            "sampled every round (task times ~16x apart: a low-end phone's uplink "
            "against a Jetson's Ethernet)",
        ),
        Workload(
            "mixed-population",
            "MNIST-1D, Dirichlet(0.5) label skew (Hsu et al. 2019), 300 phones and "
            "boards of the `mixed` fleet, a cohort of 30; 3 seeds",
            "mnist1d",
            "mlp",
            "dirichlet",
            "mixed",
            300,
            30,
            "mobilenet-v1-0.5-160",
            True,
            MIXED_BUDGET_ROUNDS,
            max_seeds=3,
        ),
    )
}
QUICK_POPULATION = 40
QUICK_COHORT = 8
QUICK_BUDGET_ROUNDS = 3


def quick_workload(w: Workload) -> Workload:
    """The same workload at toy size (``--quick``: structure only); a fleet
    sampled whole stays sampled whole."""
    whole = w.cohort >= w.population
    population = min(QUICK_POPULATION, w.population) if whole else QUICK_POPULATION
    return replace(
        w,
        population=population,
        cohort=population if whole else QUICK_COHORT,
        budget_rounds=QUICK_BUDGET_ROUNDS,
        local_steps=2,
    )


def scenario_of(w: Workload, seed: int, strategy: str = "fedavg") -> Scenario:
    """The simulation scenario a workload's cells run."""
    s = Scenario(
        fleet=w.fleet,
        num_nodes=w.population,
        strategy=strategy,
        model=w.model,
        dataset=w.dataset,
        partition=w.partition,
        batch_size=w.batch_size,
        local_steps=w.local_steps,
        learning_rate=w.learning_rate,
        fraction_train=w.fraction,
        dropout=-1.0,
        seed=seed,
        charge_as=w.charge_as,
    )
    s.check()
    return s


def task_costs(s: Scenario) -> tuple[float, int]:
    """(cost factor, bytes) the virtual clock charges per task of ``s``."""
    if s.charge_as:
        return charged_costs(s.charge_as)
    data = cached_dataset(s.dataset, s.data_dir)
    shape = (data.in_channels, data.image_size, data.num_classes)
    return cost_factor(s.model, *shape), model_num_bytes(build_model(s.model, *shape))


def task_seconds(s: Scenario) -> list[float]:
    """Virtual seconds of one full task (download, local steps, upload) of every
    device of the population, by the virtual clock's formulas
    (:mod:`flowerbed.sims.vclock`)."""
    factor, nbytes = task_costs(s)
    out = []
    for dev in assign_devices(s.fleet, s.num_nodes, s.seed):
        comm = vclock.transfer_seconds(nbytes, dev.downlink_mbps)
        comm += vclock.transfer_seconds(nbytes, dev.uplink_mbps)
        out.append(
            comm + s.local_steps * vclock.step_seconds(dev, s.batch_size, factor)
        )
    return out


def quantile_timeouts(times: Sequence[float]) -> dict[float, float]:
    """Timeout of each sweep quantile: the task time at quantile q (lower
    interpolation: a time some device really takes) x :data:`TIMEOUT_MARGIN`.
    Quantiles whose timeout equals a lower quantile's are left out (same run)."""
    out: dict[float, float] = {}
    for q in TIMEOUT_QUANTILES:
        t = float(np.quantile(np.asarray(times), q, method="lower")) * TIMEOUT_MARGIN
        if all(not math.isclose(t, prev) for prev in out.values()):
            out[q] = t
    return out


def budget_seconds(w: Workload, s: Scenario) -> float:
    """Virtual-time budget: ``budget_rounds`` x the median device's task time."""
    return w.budget_rounds * statistics.median(task_seconds(s))


@dataclass(frozen=True)
class Config:
    """A strategy configuration as the suite runs it."""

    name: str
    family: str
    """``flower`` (a baseline) or ``flowerbed`` (a default)."""
    description: str
    build: Callable[[Scenario], Strategy]
    quantile: float | None = None
    """Timeout at this quantile of the task times; None: wait for all."""
    over_sampling: float = 1.0
    versions_per_round: int = 1


def _fedavg(s: Scenario) -> Strategy:
    return FedAvg(**flower_args(s))


def _fedprox(s: Scenario) -> Strategy:
    return FedProx(proximal_mu=s.proximal_mu, **flower_args(s))


def _flowerbed(name: str) -> Callable[[Scenario], Strategy]:
    return lambda s: STRATEGIES[name](s)


def _configs() -> list[Config]:
    out = [
        Config(
            "flwr-fedavg",
            "flower",
            "Flower FedAvg, waits for every sampled node (start timeout 3600 s)",
            _fedavg,
        ),
    ]
    sweeps = [
        ("flwr-fedavg", "Flower FedAvg", _fedavg, TIMEOUT_QUANTILES, 1.0),
        (
            "flwr-fedprox",
            "Flower FedProx (proximal-mu 0.01)",
            _fedprox,
            TIMEOUT_QUANTILES[1:2],
            1.0,
        ),
        (
            "flwr-fedavg-over",
            f"Flower FedAvg over-sampling by hand (fraction_train x {OVER_SAMPLING:g})",
            _fedavg,
            TIMEOUT_QUANTILES[:1],
            OVER_SAMPLING,
        ),
    ]
    for prefix, label, build, quantiles, over in sweeps:
        for q in quantiles:
            pct = round(100 * q)
            out.append(
                Config(
                    f"{prefix}-q{pct}",
                    "flower",
                    f"{label}, start(timeout = task time at the {pct}th percentile "
                    "of the fleet)",
                    build,
                    quantile=q,
                    over_sampling=over,
                )
            )
    out += [
        Config(
            "deadline",
            "flowerbed",
            'DeadlineFedAvg.recommended(), the defaults of `strategy = "deadline"` '
            "(adaptive deadline at the 20th percentile of recent full-work task "
            "times; partial work sized to the deadline per device, each node's "
            "lateness after its deadline learnt from its replies; late updates)",
            _flowerbed("deadline"),
        ),
        Config(
            "fedbuff",
            "flowerbed",
            "FedBuff with its defaults (concurrency = twice the cohort, K = a "
            "quarter of the concurrency: half the cohort; a task out for over "
            "twice the slowest recent round trip is given up)",
            _flowerbed("fedbuff"),
            versions_per_round=2,
        ),
        Config(
            "runtime-weighted",
            "flowerbed",
            "RuntimeWeightedFedAvg with its defaults",
            _flowerbed("runtime-weighted"),
        ),
    ]
    for weighting in ("runtime", "throughput", "fednova", "examples"):
        out.append(
            Config(
                f"rw-{weighting}",
                "variant",
                f"RuntimeWeightedFedAvg, weighting={weighting!r}",
                _rw(weighting=weighting),
            )
        )
    out.append(
        Config(
            "rw-fednova-balanced",
            "variant",
            "RuntimeWeightedFedAvg, weighting='fednova', balance_work=True "
            "(local steps proportional to speed)",
            _rw(weighting="fednova", balance_work=True),
        )
    )
    # The variants are `deadline` (RECOMMENDED_DEADLINES) but for what each names.
    variants: tuple[tuple[str, dict[str, Any], str], ...] = (
        (
            "deadline-two-speed",
            {"deadline_percentile": None, "learn_margin": False, "work_fraction": 0.8},
            "two speeds (the 80th percentile of recent task times while it is at "
            "most 5x the 30th, else the 30th) and a fixed share of the deadline "
            "for nodes (work_fraction 0.8): the default until this release",
        ),
        (
            "deadline-fixed-share",
            {"learn_margin": False, "work_fraction": 0.8},
            "every node given 0.8 of the deadline (work_fraction), its lateness "
            "not learnt",
        ),
        (
            "deadline-p30",
            {"deadline_percentile": 30.0},
            "deadline_percentile=30",
        ),
        (
            "deadline-p80",
            {"deadline_percentile": 80.0, "min_batch_size": 0},
            "deadline_percentile=80 and no work sizing (min_batch_size=0)",
        ),
        (
            "deadline-pacer",
            {"pacer_step": 0.1},
            "with Oort's pacer on (pacer_step=0.1)",
        ),
    )
    for name, changes, text in variants:
        deadlines = replace(RECOMMENDED_DEADLINES, **changes)
        out.append(
            Config(
                name,
                "variant",
                f"DeadlineFedAvg as `deadline`, but {text}",
                _flowerbed_with("DeadlineFedAvg", deadlines=deadlines),
            )
        )
    out.append(
        Config(
            "fedbuff-momentum",
            "variant",
            "FedBuff with server momentum 0.5 on the buffered update (FedAvgM "
            "style): faster on mnist1d, slower on synthetic and digits",
            _flowerbed_with("FedBuff", server_momentum=0.5),
            versions_per_round=2,
        )
    )
    return out


def cohort_of(s: Scenario) -> int:
    """Devices a round samples on average: ``fraction_train`` x the eligible
    population (:attr:`Workload.fraction` inverted)."""
    eligible = s.num_nodes * DiurnalAvailability.mean
    return max(1, round(s.fraction_train * eligible))


def _flowerbed_with(name: str, **options: Any) -> Callable[[Scenario], Strategy]:
    from flowerbed.sims.scenario import flowerbed_strategy

    return flowerbed_strategy(name, **options)


def _rw(**options: Any) -> Callable[[Scenario], Strategy]:
    return _flowerbed_with("RuntimeWeightedFedAvg", **options)


CONFIGS: dict[str, Config] = {c.name: c for c in _configs()}
"""Every configuration the suite can run; ``variant`` ones (flowerbed options
other than the defaults) only when asked for with ``--strategies``, and never in
the headline."""
DEFAULT_CONFIGS = [n for n, c in CONFIGS.items() if c.family != "variant"]


def slow_weights(data: Dataset, s: Scenario) -> np.ndarray:
    """Weights over the central test set that make it the slow devices' data.

    ``device`` partition: sample j weighs pi_slow[y_j] / n_test(y_j), pi_slow the
    slow group's label shares (:func:`flowerbed.data.group_label_shares`);
    ``natural``: a writer's test samples weigh the share of its training samples
    held by slow devices (1 or 0 when each writer has one device); IID: uniform.
    Normalised to sum to 1, so ``weights @ correct`` is an accuracy.
    """
    y = data.y_test
    if s.partition == "device":
        pi = group_label_shares(data.num_classes, 2, s.affinity)[0]
        counts = np.bincount(y, minlength=data.num_classes).astype(float)
        w = pi[y] / counts[y]
    elif (
        s.partition == "natural"
        and data.train_writers is not None
        and data.test_writers is not None
    ):
        groups = speed_groups(assign_devices(s.fleet, s.num_nodes, s.seed))
        shards = partition(
            data.y_train, s.num_nodes, "natural", writers=data.train_writers
        )
        slow = np.zeros(len(data.y_train))
        for node, shard in enumerate(shards):
            slow[shard] = groups[node] == 0
        writers = data.train_writers
        share = np.bincount(writers, slow) / np.maximum(np.bincount(writers), 1)
        w = share[data.test_writers]
    else:
        w = np.ones(len(y))
    total = w.sum()
    if total <= 0:
        raise ValueError("no test sample belongs to the slow devices' data")
    return w / total


@dataclass(eq=False)
class Evaluator:
    """``evaluate_fn`` for a run: central accuracy, slow-data accuracy, the curve.

    Raises :class:`BudgetSpent` once the grid's clock has passed ``budget_s`` or
    ``max_rounds`` evaluations have been made (the run's end).
    """

    grid: Grid
    data: Dataset
    model: str
    """The name of the model evaluated (:func:`flowerbed.models.build_model`)."""
    weights: np.ndarray
    budget_s: float
    max_rounds: int
    curve: list[tuple[int, float, float, float]] = field(default_factory=list)
    """(round, virtual s, accuracy, slow-data accuracy) after each round."""
    initial: tuple[float, float] = (0.0, 0.0)

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord:
        import torch

        d = self.data
        model = build_model(self.model, d.in_channels, d.image_size, d.num_classes)
        model.load_state_dict(arrays.to_torch_state_dict())
        model.eval()
        with torch.no_grad():
            pred = model(torch.from_numpy(d.x_test)).argmax(dim=1).numpy()
        correct = (pred == d.y_test).astype(float)
        acc, slow = float(correct.mean()), float(self.weights @ correct)
        now = float(self.grid.clock.now())  # type: ignore[attr-defined]
        if server_round == 0:
            self.initial = (acc, slow)
        else:
            self.curve.append((server_round, now, acc, slow))
        if server_round >= self.max_rounds or now >= self.budget_s:
            raise BudgetSpent
        return MetricRecord({"accuracy": acc})


CEILING_STEPS = 100
"""L-BFGS iterations of :func:`centralised_accuracy` (the loss has levelled off)."""


def centralised_accuracy(data: Dataset, steps: int = CEILING_STEPS) -> float:
    """Test accuracy of one multinomial logistic regression fitted on the whole
    training split (full batch, L-BFGS with a strong-Wolfe line search, seed 0):
    what a single global ``logreg`` model can reach on this data, the ceiling of
    every federated configuration that trains one."""
    import torch

    x = torch.from_numpy(data.x_train.reshape(len(data.x_train), -1))
    y = torch.from_numpy(data.y_train)
    torch.manual_seed(0)
    model = torch.nn.Linear(x.shape[1], data.num_classes)
    opt = torch.optim.LBFGS(
        model.parameters(), max_iter=steps, line_search_fn="strong_wolfe"
    )

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small matrices: extra threads only contend
    try:
        opt.step(closure)
        with torch.no_grad():
            test = torch.from_numpy(data.x_test.reshape(len(data.x_test), -1))
            pred = model(test).argmax(dim=1).numpy()
    finally:
        torch.set_num_threads(threads)
    return float((pred == data.y_test).mean())


def synthetic_ceilings(population: int) -> dict[str, float]:
    """:func:`centralised_accuracy` on Synthetic(1, 1) as the suite loads it
    (:data:`flowerbed.data.SYNTHETIC_WRITERS` writers) and with one writer per
    device of ``population``, keyed by the number of writers."""
    return {
        str(n): centralised_accuracy(
            standardise(
                make_synthetic(
                    SYNTHETIC_ALPHA,
                    SYNTHETIC_BETA,
                    n,
                    seed=SYNTHETIC_SEED,
                    max_samples=SYNTHETIC_MAX_SAMPLES,
                )
            )
        )
        for n in dict.fromkeys((SYNTHETIC_WRITERS, population))
    }


def resolve(
    names: Iterable[str], catalogue: Mapping[str, object], what: str
) -> list[str]:
    """Check names against a catalogue; unknown ones raise naming the valid choices."""
    out = list(names)
    for name in out:
        if name not in catalogue:
            raise ValueError(
                f"unknown {what} {name!r}; valid choices: {', '.join(catalogue)}"
            )
    return out


class CountingGrid(GridWrapper):
    """Transparent ``Grid`` wrapper: counts train tasks, samples and energy.

    :meth:`drain`, called once the run is over, lets the virtual clock run on and
    pulls every train reply still in flight, so the energy of work that was
    never used (stragglers, replies after the round closed) is counted too: the
    devices spent it.
    """

    def __init__(self, inner: Grid) -> None:
        super().__init__(inner)
        self.dispatched = 0
        """Train messages pushed."""
        self.samples = 0
        """``num-examples`` summed over successful train replies pulled."""
        self.energy_j = 0.0
        """``energy-j`` summed over successful train replies pulled."""
        self.spent: list[tuple[float, float]] = []
        """(virtual s the task ended, its ``energy-j``) of every successful train
        reply pulled: dispatch time + ``comm-time-s`` + ``train-time-s``, so a
        straggler's work counts when it was done, not when (or whether) the
        strategy pulled its reply."""
        self._open: set[str] = set()
        self._sent_at: dict[str, float] = {}

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        ids = list(self.inner.push_messages(messages))
        for message, message_id in zip(messages, ids, strict=True):
            if message.metadata.message_type.startswith("train"):
                self.dispatched += 1
                self._open.add(message_id)
                clock = getattr(self, "clock", None)
                self._sent_at[message_id] = float(clock.now()) if clock else 0.0
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        replies = list(self.inner.pull_messages(message_ids))
        for reply in replies:
            message_id = reply.metadata.reply_to_message_id
            if message_id not in self._open:
                continue
            self._open.discard(message_id)
            sent = self._sent_at.pop(message_id, 0.0)
            if reply.has_error():
                continue
            for record in reply.content.metric_records.values():
                examples = record.get(keys.NUM_EXAMPLES)
                if isinstance(examples, int | float):
                    self.samples += int(examples)
                energy = record.get(keys.ENERGY_J)
                if isinstance(energy, int | float):
                    self.energy_j += float(energy)
                    took = sum(
                        float(v)
                        for k in (keys.COMM_TIME_S, keys.TRAIN_TIME_S)
                        if isinstance(v := record.get(k), int | float)
                    )
                    self.spent.append((sent + took, float(energy)))
        return replies

    def energy_by(self, times: Sequence[float]) -> list[float]:
        """Joules of the successful train tasks that had ended by each of
        ``times`` (call after :meth:`drain`, which pulls the stragglers)."""
        return [sum(e for end, e in self.spent if end <= t) for t in times]

    def drain(self) -> None:
        """Advance the virtual clock until nothing is in flight; pull it all."""
        clock = getattr(self, "clock", None)
        upcoming = getattr(self.inner, "next_arrival_after", None)
        if clock is None or upcoming is None:
            return
        while (t := upcoming(clock.now())) is not None and math.isfinite(t):
            clock.wait(t - clock.now())
        self.pull_messages(list(self._open))


class TransferCountingGrid(CountingGrid):
    """:class:`CountingGrid` that also counts successful train replies (uploads)."""

    def __init__(self, inner: Grid) -> None:
        super().__init__(inner)
        self.uploads = 0

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        open_before = set(self._open)
        replies = list(super().pull_messages(message_ids))
        self.uploads += sum(
            1
            for r in replies
            if r.metadata.reply_to_message_id in open_before and not r.has_error()
        )
        return replies


def _folded(result: Any, curve_rounds: int, grid: TransferCountingGrid) -> int:
    from flowerbed.strategies.round_metrics import (
        ROUND_LATE_UPDATES,
        ROUND_PARTICIPANTS,
    )

    history = getattr(result, "train_metrics_clientapp", None) or {}
    if history and all(ROUND_PARTICIPANTS in m for m in history.values()):
        return int(
            sum(
                float(m.get(k, 0.0))  # type: ignore[arg-type]
                for m in history.values()
                for k in (ROUND_PARTICIPANTS, ROUND_LATE_UPDATES)
            )
        )
    return grid.uploads


def run_cell(
    workload: Workload, config: Config, seed: int, timeout_s: float | None
) -> dict[str, Any]:
    """One (workload, configuration, seed) run; JSON-able metrics and its curve."""
    import random

    import torch

    s = scenario_of(workload, seed)
    if config.over_sampling != 1.0:
        s = replace(s, fraction_train=min(1.0, s.fraction_train * config.over_sampling))
    strategy_s = replace(
        s, strategy=config.name if config.family == "flowerbed" else "fedavg"
    )
    budget = budget_seconds(workload, s)
    max_rounds = workload.budget_rounds * 3 * config.versions_per_round
    data = cached_dataset(s.dataset, s.data_dir)
    fleet = build_fleet_grid(s.to_run_config())
    inner: Grid = fleet
    if workload.availability:
        model = DiurnalAvailability(s.num_nodes, seed=seed)
        device_of = {int(n): int(i) for i, n in enumerate(sorted(fleet.get_node_ids()))}
        inner = AvailabilityGrid(fleet, model, device_of)
    grid = TransferCountingGrid(inner)
    evaluator = Evaluator(
        grid, data, s.model, slow_weights(data, s), budget, max_rounds
    )
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    initial = build_model(s.model, data.in_channels, data.image_size, data.num_classes)
    strategy = config.build(strategy_s)
    train_config = ConfigRecord(
        {
            keys.LEARNING_RATE: s.learning_rate,
            keys.LOCAL_STEPS: s.local_steps,
            keys.BATCH_SIZE: s.batch_size,
        }
    )
    result = None
    with contextlib.suppress(BudgetSpent):
        result = strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(initial.state_dict()),
            num_rounds=max_rounds,
            timeout=timeout_s if timeout_s is not None else WAIT_ALL_TIMEOUT_S,
            train_config=train_config,
            evaluate_fn=evaluator,
        )
    end_s = float(grid.clock.now())  # type: ignore[attr-defined]
    folded = _folded(result, len(evaluator.curve), grid)
    grid.drain()
    energy_curve = grid.energy_by([p[1] for p in evaluator.curve])
    fleet.close()
    _, nbytes = task_costs(s)
    return {
        "workload": workload.name,
        "config": config.name,
        "family": config.family,
        "seed": seed,
        "timeout_s": timeout_s,
        "budget_s": budget,
        "end_s": end_s,
        "rounds": len(evaluator.curve),
        "initial_accuracy": evaluator.initial[0],
        "curve": [list(p) for p in evaluator.curve],
        "energy_curve": energy_curve,
        "energy_j": grid.energy_j,
        "bytes": nbytes * (grid.dispatched + grid.uploads),
        "updates_dispatched": grid.dispatched,
        "updates_folded": folded,
        "samples": grid.samples,
    }


# --- statistics -----------------------------------------------------------------


def accuracy_at_time(
    curve: Sequence[Sequence[float]], t: float, initial: float
) -> float:
    """Accuracy of the newest model evaluated by virtual time ``t``."""
    acc = initial
    for _, when, a, _ in curve:
        if when > t:
            break
        acc = a
    return acc


def time_to(
    curve: Sequence[Sequence[float]], target: float, until: float = math.inf
) -> float | None:
    """Virtual time of the first evaluation at or above ``target`` (None: never,
    or only after ``until``, the run's budget: a round that ends past the budget,
    as a wait-for-all round does when a device is lost, does not count)."""
    for _, when, a, _ in curve:
        if when > until:
            return None
        if a >= target:
            return float(when)
    return None


def energy_to(
    cell: Mapping[str, Any], target: float, until: float = math.inf
) -> float | None:
    """Joules the devices had spent on successful train tasks (ended by then,
    whether or not the strategy used them) when the run first reached ``target``
    (None: never reached, only after ``until`` as in :func:`time_to`, or a cell
    recorded before energy was recorded per evaluation)."""
    energy = cell.get("energy_curve")
    if not energy:
        return None
    for i, (_, when, a, _) in enumerate(cell["curve"]):
        if when > until:
            return None
        if a >= target:
            return float(energy[i])
    return None


def converged_accuracy(cells: Sequence[Mapping[str, Any]]) -> float:
    """A workload's converged accuracy: the median over seeds of the best accuracy
    any configuration reached within the budget (each run's median of its last
    five evaluations, so a lucky spike does not set it). The suite passes the
    baselines' and defaults' cells only: a variant does not move the targets."""
    best: dict[int, float] = {}
    for c in cells:
        accs = [p[2] for p in c["curve"]][-5:]
        if accs:
            best[c["seed"]] = max(best.get(c["seed"], 0.0), statistics.median(accs))
    return statistics.median(best.values()) if best else 0.0


def log_ratio_ci(ratios: Sequence[float], level: float = CI_LEVEL) -> dict[str, Any]:
    """Geometric mean of paired ratios with a Student-t interval on their logs.

    For n seeds, ``exp(mean(log r) +- t_{(1+level)/2, n-1} x sd(log r)/sqrt(n))``;
    one ratio has no interval.
    """
    from scipy import stats

    logs = np.log(np.asarray([r for r in ratios if r > 0], dtype=float))
    n = len(logs)
    if n == 0:
        return {"geomean": None, "low": None, "high": None, "n": 0}
    mean = float(logs.mean())
    if n == 1:
        return {"geomean": math.exp(mean), "low": None, "high": None, "n": 1}
    half = (
        float(stats.t.ppf((1 + level) / 2, n - 1))
        * float(logs.std(ddof=1))
        / math.sqrt(n)
    )
    return {
        "geomean": math.exp(mean),
        "low": math.exp(mean - half),
        "high": math.exp(mean + half),
        "n": n,
    }


def mean_ci(values: Sequence[float], level: float = CI_LEVEL) -> dict[str, Any]:
    """Mean with a Student-t interval (paired differences, e.g. accuracy points)."""
    from scipy import stats

    v = np.asarray(values, dtype=float)
    n = len(v)
    if n == 0:
        return {"mean": None, "low": None, "high": None, "n": 0}
    mean = float(v.mean())
    if n == 1:
        return {"mean": mean, "low": None, "high": None, "n": 1}
    half = (
        float(stats.t.ppf((1 + level) / 2, n - 1)) * float(v.std(ddof=1)) / math.sqrt(n)
    )
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": n}


def ideal_seconds(s: Scenario, cohort: int, updates: float) -> float:
    """Transfer-aware ideal time for ``updates`` local updates.

    The cohort's devices busy all the time, one full task (download, local steps,
    upload, :func:`task_seconds`) after another, the cohort drawn from the fleet's
    mix: throughput = cohort x mean_i(1 / T_i) tasks per second, so
    ``ideal_s = updates / (cohort x mean_i(1 / T_i))``.
    """
    times = task_seconds(s)
    rate = cohort * statistics.fmean(1.0 / t for t in times)
    return updates / rate


def summarise_workload(
    w: Workload, cells: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """Per-configuration statistics of one workload over its seeds."""
    conv = converged_accuracy([c for c in cells if c["family"] != "variant"])
    targets = {f: f * conv for f in TARGET_FRACTIONS}
    by: dict[str, list[Mapping[str, Any]]] = {}
    for c in cells:
        by.setdefault(c["config"], []).append(c)
    configs: dict[str, Any] = {}
    for name, runs in by.items():
        runs = sorted(runs, key=lambda c: c["seed"])
        budget = min(c["budget_s"] for c in runs)
        entry: dict[str, Any] = {
            "family": runs[0]["family"],
            "seeds": [c["seed"] for c in runs],
            "timeout_s": runs[0]["timeout_s"],
            "ttt": {},
            "reached": {},
            "energy_to": {},
        }
        for f, target in targets.items():
            times = [time_to(c["curve"], target, c["budget_s"]) for c in runs]
            entry["ttt"][str(f)] = [t for t in times]
            entry["energy_to"][str(f)] = [
                energy_to(c, target, c["budget_s"]) for c in runs
            ]
            entry["reached"][str(f)] = sum(t is not None for t in times)
        entry["final_accuracy"] = [
            accuracy_at_time(c["curve"], budget, c["initial_accuracy"]) for c in runs
        ]
        entry["final_slow_accuracy"] = [
            (c["curve"][-1][3] if c["curve"] else 0.0) for c in runs
        ]
        entry["accuracy_at_rounds"] = {
            str(r): [
                (c["curve"][r - 1][2] if len(c["curve"]) >= r else None) for c in runs
            ]
            for r in EQUAL_ROUNDS
        }
        for key in ("energy_j", "bytes", "rounds", "updates_folded", "end_s"):
            entry[key] = [c[key] for c in runs]
        configs[name] = entry
    return {"converged_accuracy": conv, "targets": targets, "configs": configs}


def median_ttt(entry: Mapping[str, Any], fraction: float, budget: float) -> float:
    """Median time-to-target over seeds, a run that never reached it counting as
    the budget (so a configuration that misses the target ranks last)."""
    times = [budget if t is None else t for t in entry["ttt"][str(fraction)]]
    return float(statistics.median(times)) if times else math.inf


def best_config(
    configs: Mapping[str, Mapping[str, Any]],
    family: str,
    fraction: float,
    budget: float,
) -> str | None:
    """The configuration of ``family`` with the lowest median time to the target
    (chosen with hindsight); ties go to the higher median final accuracy."""
    names = [n for n, e in configs.items() if e["family"] == family]
    if not names:
        return None
    return min(
        names,
        key=lambda n: (
            median_ttt(configs[n], fraction, budget),
            -statistics.median(configs[n]["final_accuracy"]),
        ),
    )


def compare(
    w: Workload,
    s: Scenario,
    summary: Mapping[str, Any],
    fraction: float = HEADLINE_FRACTION,
) -> dict[str, Any]:
    """flowerbed's recommended default (:data:`RECOMMENDED`, the same on every
    workload) against the best-tuned Flower configuration.

    Paired by seed: speed-up ``ttt(flower) / ttt(flowerbed)`` (runs that never
    reached the target count at the budget), final-accuracy and slow-data
    accuracy differences in points, energy ratios at the budget and to the
    target (seeds where flowerbed reached it; where Flower did not, its energy
    over the whole run, a lower bound); each with a t-interval.
    Also against Flower's best *timeout* configuration (the fairness target), and
    both against the transfer-aware ideal. The other flowerbed defaults'
    median times to the target are listed (``others``), never compared as the
    headline: picking the best of several with hindsight would flatter flowerbed.
    """
    configs = summary["configs"]
    budget = budget_seconds(w, s)
    ours = RECOMMENDED if RECOMMENDED in configs else None
    theirs = best_config(configs, "flower", fraction, budget)
    if ours is None:
        return {"available": False, "reason": f"{RECOMMENDED} was not run"}
    if theirs is None:
        return {"available": False, "reason": "no Flower configuration was run"}
    timeouts = {
        n: e for n, e in configs.items() if e["family"] == "flower" and e["timeout_s"]
    }
    best_timeout = best_config(timeouts, "flower", fraction, budget)
    a, b = configs[ours], configs[theirs]
    key = str(fraction)
    seeds = [x for x in a["seeds"] if x in b["seeds"]]

    def per_seed(e: Mapping[str, Any], field: str) -> list[Any]:
        return [e[field][e["seeds"].index(x)] for x in seeds]

    def ttt(e: Mapping[str, Any]) -> list[float]:
        return [
            budget if t is None else t
            for t in (e["ttt"][key][e["seeds"].index(x)] for x in seeds)
        ]

    speedups = [t_b / t_a for t_a, t_b in zip(ttt(a), ttt(b), strict=True)]
    acc_diff = [
        100 * (x - y)
        for x, y in zip(
            per_seed(a, "final_accuracy"), per_seed(b, "final_accuracy"), strict=True
        )
    ]
    energy = [
        y / x if x > 0 else math.inf
        for x, y in zip(per_seed(a, "energy_j"), per_seed(b, "energy_j"), strict=True)
    ]
    # Where Flower never reached the target in a seed and flowerbed did, the
    # energy Flower spent over its whole run is a lower bound of its energy to
    # the target, so the ratio is a lower bound too (counted apart below).
    energy_to_target: list[float] = []
    bounded = 0
    for x, y, spent in zip(
        per_seed_energy_to(a, key, seeds),
        per_seed_energy_to(b, key, seeds),
        per_seed(b, "energy_j"),
        strict=True,
    ):
        if x is None or x <= 0:
            continue
        if y is None:
            y, bounded = spent, bounded + 1
        energy_to_target.append(y / x)
    out: dict[str, Any] = {
        "available": True,
        "workload": w.name,
        "target_fraction": fraction,
        "target_accuracy": summary["targets"][fraction],
        "flowerbed": ours,
        "flower": theirs,
        "seeds": seeds,
        "speedup": log_ratio_ci(speedups),
        "speedups": speedups,
        "final_accuracy_diff_points": mean_ci(acc_diff),
        "energy_ratio_flower_over_flowerbed": log_ratio_ci(energy),
        "energy_to_target_ratio_flower_over_flowerbed": log_ratio_ci(energy_to_target),
        "energy_to_target_seeds": len(energy_to_target),
        "energy_to_target_bounded_seeds": bounded,
        "others": {
            n: median_ttt(e, fraction, budget)
            for n, e in configs.items()
            if e["family"] == "flowerbed" and n != ours
        },
        "others_reached": {
            n: e["reached"][key]
            for n, e in configs.items()
            if e["family"] == "flowerbed" and n != ours
        },
        "others_seeds": {
            n: len(e["seeds"])
            for n, e in configs.items()
            if e["family"] == "flowerbed" and n != ours
        },
        "median_ttt_flowerbed": median_ttt(a, fraction, budget),
        "median_ttt_flower": median_ttt(b, fraction, budget),
        "reached_flowerbed": a["reached"][key],
        "reached_flower": b["reached"][key],
        "budget_s": budget,
        "samples_everyone": w.cohort >= w.population,
    }
    if best_timeout is not None:
        c = configs[best_timeout]
        common = [x for x in a["seeds"] if x in c["seeds"]]
        slow_diff = [
            100
            * (
                a["final_slow_accuracy"][a["seeds"].index(x)]
                - c["final_slow_accuracy"][c["seeds"].index(x)]
            )
            for x in common
        ]
        out["flower_best_timeout"] = best_timeout
        out["slow_accuracy_diff_points"] = mean_ci(slow_diff)
    folded = statistics.median(b["updates_folded"])
    rounds = statistics.median(b["rounds"])
    # Updates the best Flower run folded up to the target: its share of the run.
    t_ref = out["median_ttt_flower"]
    end = statistics.median(b["end_s"])
    updates = folded * min(1.0, t_ref / end) if end > 0 else folded
    ideal = ideal_seconds(s, w.cohort, updates) if rounds else None
    out["ideal_s"] = ideal
    out["flowerbed_over_ideal"] = (
        None if not ideal else out["median_ttt_flowerbed"] / ideal
    )
    out["flower_over_ideal"] = None if not ideal else t_ref / ideal
    return out


def per_seed_energy_to(
    e: Mapping[str, Any], key: str, seeds: Sequence[int]
) -> list[float | None]:
    """A configuration's energy to the target ``key`` on each of ``seeds`` (None
    where it never reached it or the cell has no energy curve)."""
    found = e.get("energy_to", {}).get(key)
    if found is None:
        return [None] * len(seeds)
    return [found[e["seeds"].index(x)] for x in seeds]


def workload_description(w: Workload) -> dict[str, Any]:
    d = asdict(w)
    d["fraction_train"] = w.fraction
    return d


HEADLINE_WORKLOAD = "mnist1d-device"
TARGET_SPEEDUP = 2.0
TARGET_SLOW_POINTS = 3.0
TARGET_IDEAL_RATIO = 1.5
TARGET_CAVEATS: dict[str, str] = {
    "ideal": "Caveat: the ideal is the time to fold as many full updates as "
    "Flower's best configuration folded up to its time to the target (its whole "
    "run when it never reached it); a strategy that reaches the target with "
    "fewer or partial updates can come in under 1.0x, so a met target here "
    "says the strategy used the fleet well, not that it is near a bound.",
}
"""Per target name: a caveat shown whether the target is met or not."""


TARGET_ACCURACY_SLACK_POINTS = 0.5
"""On every workload the default may end at most this far below Flower's best."""
FEDBUFF = "fedbuff"


def check_targets(comparisons: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The suite's targets, each met or not, with the figures behind it.

    On every workload: the recommended default reaches the target no later than
    the best-tuned Flower configuration (median over seeds), ends at most
    :data:`TARGET_ACCURACY_SLACK_POINTS` below it and spends no more energy to
    reach the target. On the device-correlated population: at least
    :data:`TARGET_SPEEDUP` x as fast and :data:`TARGET_SLOW_POINTS` higher on the
    slow devices' data. FedBuff on population workloads: no slower than Flower's
    best. And the transfer-aware ideal on the headline workload.
    """
    out: list[dict[str, Any]] = []
    for name, c in comparisons.items():
        if not c.get("available"):
            continue
        acc = c["final_accuracy_diff_points"]["mean"]
        energy = c.get("energy_to_target_ratio_flower_over_flowerbed", {}).get(
            "geomean"
        )
        out.append(
            {
                "name": f"match-{name}",
                "text": f"{name}: the default reaches the target no later than the "
                "best-tuned Flower configuration (median over seeds), ends at most "
                f"{TARGET_ACCURACY_SLACK_POINTS:g} points below it and spends no "
                "more energy to reach the target",
                "met": bool(
                    c["median_ttt_flowerbed"] <= c["median_ttt_flower"]
                    and acc is not None
                    and acc >= -TARGET_ACCURACY_SLACK_POINTS
                    and energy is not None
                    and energy >= 1
                ),
                "median_ttt_flowerbed": c["median_ttt_flowerbed"],
                "median_ttt_flower": c["median_ttt_flower"],
                "final_accuracy_diff_points": acc,
                "energy_to_target_flower_over_flowerbed": energy,
            }
        )
    dev = comparisons.get(HEADLINE_WORKLOAD, {})
    if dev.get("available"):
        speed = statistics.median(dev["speedups"])
        acc = dev["final_accuracy_diff_points"]["mean"]
        slow = dev.get("slow_accuracy_diff_points", {}).get("mean")
        out.append(
            {
                "name": "device-correlated",
                "text": f"{HEADLINE_WORKLOAD}: the default reaches the "
                f"target >= {TARGET_SPEEDUP:g}x faster than the best-tuned Flower "
                "configuration (median over seeds), final accuracy no lower, and "
                f">= {TARGET_SLOW_POINTS:g} points higher accuracy on the slow "
                "devices' data than Flower with its best timeout",
                "met": bool(
                    speed >= TARGET_SPEEDUP
                    and acc >= 0
                    and slow is not None
                    and slow >= TARGET_SLOW_POINTS
                ),
                "median_speedup": speed,
                "final_accuracy_diff_points": acc,
                "slow_accuracy_diff_points": slow,
            }
        )
    for name, c in comparisons.items():
        if not c.get("available") or c.get("samples_everyone", True):
            continue
        fedbuff = c.get("others", {}).get(FEDBUFF)
        if fedbuff is None:
            continue
        reached = c.get("others_reached", {}).get(FEDBUFF, 0)
        seeds = c.get("others_seeds", {}).get(FEDBUFF, 0)
        out.append(
            {
                "name": f"fedbuff-{name}",
                "text": f"{name}: FedBuff with its defaults reaches the target (in "
                "most seeds) no later than the best-tuned Flower configuration "
                "(median over seeds)",
                # a tie at the budget (neither reached it) is not a result
                "met": bool(2 * reached > seeds and fedbuff <= c["median_ttt_flower"]),
                "median_ttt_fedbuff": fedbuff,
                "median_ttt_flower": c["median_ttt_flower"],
                "fedbuff_reached": f"{reached} of {seeds}",
            }
        )
    if dev.get("available"):
        ratio = dev["flowerbed_over_ideal"]
        out.append(
            {
                "name": "ideal",
                "text": f"{HEADLINE_WORKLOAD}: time-to-accuracy within "
                f"{TARGET_IDEAL_RATIO:g}x of the transfer-aware ideal",
                "met": bool(ratio is not None and ratio <= TARGET_IDEAL_RATIO),
                "flowerbed_over_ideal": ratio,
                "flower_over_ideal": dev["flower_over_ideal"],
            }
        )
    return out


def analyse(
    workloads: Sequence[str], cells: Sequence[Mapping[str, Any]], quick: bool
) -> dict[str, Any]:
    """Summary, comparisons, headline and targets of a suite's successful cells."""
    summary: dict[str, Any] = {}
    comparisons: dict[str, Any] = {}
    for name in workloads:
        w = WORKLOADS[name]
        if quick:
            w = quick_workload(w)
        mine = [c for c in cells if c["workload"] == name]
        if not mine:
            continue
        summary[name] = summarise_workload(w, mine)
        s = scenario_of(w, min(c["seed"] for c in mine))
        comparisons[name] = compare(w, s, summary[name])
    headline = comparisons.get(
        HEADLINE_WORKLOAD,
        {"available": False, "reason": f"{HEADLINE_WORKLOAD} was not run"},
    )
    return {
        "summary": summary,
        "comparisons": comparisons,
        "headline": headline,
        "targets": check_targets(comparisons),
    }
