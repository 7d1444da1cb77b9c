"""A simulated node: trains for real, reports the time its device would have taken.

The node's identity comes from Flower's ``node_config`` (``partition-id``,
``num-partitions``, as Flower's simulation engine sets them), so the same node gets
the same device, data and random draws on the in-process engine and on Ray.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from flowerbed import keys
from flowerbed.arrays import (
    encode_record,
    encode_records,
    record_views,
    torch_state_dict,
)
from flowerbed.clients.training import TrainStats, evaluate, train_steps
from flowerbed.data import partition
from flowerbed.models import build_model, charged_costs, cost_factor, model_num_bytes
from flowerbed.records import filled
from flowerbed.sims import vclock
from flowerbed.sims.batched import NodeJob, batchable, train_many
from flowerbed.sims.config import Scenario
from flowerbed.sims.devices import DeviceProfile, get_device
from flowerbed.sims.fleet import device_of
from flowerbed.sims.population import (
    MIN_SAMPLES,
    cached_dataset,
    drawn_shard,
    fits,
    train_partition,
)
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable
from flwr.common.constant import ErrorCode
from torch import nn

OFFLINE = "offline"
"""node_config ``device`` value of a node that never answers (for tests)."""
DEVICE_KEY = "device"
"""node_config key that pins a node's device class instead of the fleet's draw."""
TRAIN, EVALUATE, QUERY = 0, 1, 2
DEFAULT_PROFILE_STEPS = 3
"""Task kinds, part of each task's random stream."""
EVAL_COST = 1.0 / 3.0
"""A forward pass costs about a third of a training step (forward + 2x backward)."""


@dataclass(frozen=True)
class NodeSetup:
    """What a node knows about itself."""

    partition_id: int
    device: DeviceProfile
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    cost_factor: float
    model_bytes: int


@functools.lru_cache(maxsize=8)
def _partition(scenario: Scenario, num_partitions: int, split: str) -> list[np.ndarray]:
    """Disjoint shards of one split (training: the scenario's scheme; test: iid)."""
    data = cached_dataset(scenario.dataset, scenario.data_dir)
    if split == "train":
        return train_partition(scenario, data, num_partitions)
    return partition(
        data.y_test,
        num_partitions,
        "iid",
        scenario.alpha,
        scenario.seed,
        MIN_SAMPLES["test"],
    )


def _shard(scenario: Scenario, num_partitions: int, pid: int, split: str) -> np.ndarray:
    """A node's sample indices: its disjoint shard, or one it draws (population)."""
    data = cached_dataset(scenario.dataset, scenario.data_dir)
    labels = data.y_train if split == "train" else data.y_test
    if fits(len(labels), num_partitions, split):
        return _partition(scenario, num_partitions, split)[pid]
    scheme = scenario.partition if split == "train" else "iid"
    return drawn_shard(labels, pid, split, scheme, scenario.alpha, scenario.seed)


@functools.lru_cache(maxsize=8)
def _model_costs(
    model: str, dataset: str, data_dir: str, charge_as: str
) -> tuple[float, int]:
    """(cost factor, bytes) of the model a scenario trains or charges: once per
    process and model, not per run (building the models to count their
    multiply-adds costs ~3 ms)."""
    if charge_as:
        return charged_costs(charge_as)
    data = cached_dataset(dataset, data_dir)
    shape = (data.in_channels, data.image_size, data.num_classes)
    built = build_model(model, *shape)
    return cost_factor(model, *shape), model_num_bytes(built)


def node_setup(
    scenario: Scenario, partition_id: int, num_partitions: int, device: str = ""
) -> NodeSetup:
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} outside [0, {num_partitions})")
    data = cached_dataset(scenario.dataset, scenario.data_dir)
    train = _shard(scenario, num_partitions, partition_id, "train")
    test = _shard(scenario, num_partitions, partition_id, "test")
    if device in ("", OFFLINE):
        profile = device_of(scenario.fleet, num_partitions, scenario.seed, partition_id)
    else:
        profile = get_device(device)
    factor, nbytes = _model_costs(
        scenario.model, scenario.dataset, scenario.data_dir, scenario.charge_as
    )
    return NodeSetup(
        partition_id,
        profile,
        data.x_train[train],
        data.y_train[train],
        data.x_test[test],
        data.y_test[test],
        factor,
        nbytes,
    )


def _number(config: Mapping[str, object], key: str, default: float) -> float:
    """A numeric config value, or ``default`` when the key is absent."""
    value = config.get(key, default)
    if not isinstance(value, (int, float)):
        raise ValueError(f"config {key!r} must be a number, got {value!r}")
    return float(value)


def single_threaded() -> None:
    """Pin torch to one intra-op thread, without oneDNN, for this process.

    Simulated nodes train tiny models: one intra-op thread is fastest, and on a
    loaded machine more threads spin against each other (10x slower measured
    here). oneDNN's per-call setup costs more than these convolutions (27%
    measured).
    """
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
        torch.backends.mkldnn.enabled = False  # type: ignore[assignment]


@functools.lru_cache(maxsize=8)
def _scenario(items: tuple[tuple[str, object], ...]) -> Scenario:
    return Scenario.from_run_config(dict(items))


@functools.lru_cache(maxsize=1024)
def _node_setup(
    scenario: Scenario, partition_id: int, num_partitions: int, device: str
) -> NodeSetup:
    """:func:`node_setup` for the nodes a process keeps meeting (a round's cohort)."""
    return node_setup(scenario, partition_id, num_partitions, device)


def _identity(context: Context) -> tuple[Scenario, NodeSetup]:
    single_threaded()
    # Every task of a run has the same run config: parsed and checked once.
    scenario = _scenario(tuple(sorted(context.run_config.items())))
    pid = int(context.node_config.get("partition-id", 0))
    n = int(context.node_config.get("num-partitions", scenario.num_nodes))
    device = str(context.node_config.get(DEVICE_KEY, ""))
    if device == OFFLINE:
        raise vclock.NodeDropout(
            f"offline device (partition {pid})", silent=True, after_s=0.0
        )
    return scenario, _node_setup(scenario, pid, n, device)


@functools.lru_cache(maxsize=4)
def _architecture(
    name: str, in_channels: int, image_size: int, classes: int
) -> nn.Module:
    """One model per process and architecture; tasks load their weights into it."""
    return build_model(name, in_channels, image_size, classes)


def _model_of(scenario: Scenario) -> nn.Module:
    data = cached_dataset(scenario.dataset, scenario.data_dir)
    return _architecture(
        scenario.model, data.in_channels, data.image_size, data.num_classes
    )


def _model_from(message: Message, scenario: Scenario) -> nn.Module:
    model = _model_of(scenario)
    model.load_state_dict(torch_state_dict(message.content.array_records[keys.ARRAYS]))
    return model


def _config(message: Message) -> Mapping[str, object]:
    """The message's config record (empty if none): ``content.config_records``
    without the synced view Flower builds on every access."""
    record = message.content.get(keys.CONFIG)
    return record if isinstance(record, ConfigRecord) else {}


def _maybe_drop(
    scenario: Scenario, node: NodeSetup, server_round: int, kind: int, duration_s: float
) -> None:
    """Raise ``NodeDropout`` as the device's availability dictates."""
    p = vclock.drop_probability(node.device, duration_s, scenario.dropout)
    if p <= 0:  # no draw can fall below it
        return
    rng = vclock.task_rng(scenario.seed, node.partition_id, server_round, kind)
    if rng.random() < p:
        silent = bool(rng.random() < 0.5)
        raise vclock.NodeDropout(
            f"{node.device.name} (partition {node.partition_id}) dropped out",
            silent=silent,
            after_s=float(rng.random() * duration_s),
        )


@dataclass(frozen=True)
class TrainPlan:
    """A train task once its config is read and its device has decided to run it."""

    scenario: Scenario
    node: NodeSetup
    steps: int
    batch: int
    lr: float
    proximal_mu: float
    seed: int
    step_s: float
    comm_s: float

    def train(self, model: nn.Module) -> TrainStats:
        """Run the plan's SGD steps on the node's data, training ``model`` in place."""
        return train_steps(
            model,
            self.node.x_train,
            self.node.y_train,
            steps=self.steps,
            batch_size=self.batch,
            lr=self.lr,
            seed=self.seed,
            proximal_mu=self.proximal_mu,
        )


def plan_train(message: Message, context: Context) -> TrainPlan:
    """Read a train message's config; raise ``NodeDropout`` if the device drops.

    A plan of 0 steps means the deadline leaves no time for one: see
    :func:`no_step_reply`.
    """
    scenario, node = _identity(context)
    config = _config(message)
    server_round = int(_number(config, keys.SERVER_ROUND, 0))
    steps = int(_number(config, keys.LOCAL_STEPS, scenario.local_steps))
    lr = _number(config, keys.LEARNING_RATE, scenario.learning_rate)
    batch = min(
        int(_number(config, keys.BATCH_SIZE, scenario.batch_size)), len(node.x_train)
    )
    deadline = _number(config, keys.DEADLINE_S, 0.0)
    mu = _number(config, keys.PROXIMAL_MU, 0.0)

    dev = node.device
    step_s = vclock.step_seconds(dev, batch, node.cost_factor)
    comm_s = vclock.transfer_seconds(
        node.model_bytes, dev.downlink_mbps
    ) + vclock.transfer_seconds(node.model_bytes, dev.uplink_mbps)
    if deadline > 0:
        fit = vclock.max_steps_within(deadline, comm_s, step_s)
        min_batch = int(_number(config, keys.MIN_BATCH_SIZE, 0))
        if fit == 0 and min_batch > 0 and steps > 0:
            smaller = vclock.max_batch_within(deadline, comm_s, step_s / batch)
            if smaller >= min_batch:  # one smaller step instead of none
                batch, step_s, fit = smaller, step_s * smaller / batch, 1
        steps = min(steps, fit)
    _maybe_drop(scenario, node, server_round, TRAIN, comm_s + steps * step_s)
    seed = int(
        vclock.task_rng(scenario.seed, node.partition_id, server_round, TRAIN).integers(
            2**31
        )
    )
    return TrainPlan(scenario, node, steps, batch, lr, mu, seed, step_s, comm_s)


def no_step_reply(message: Message, plan: TrainPlan) -> Message:
    """The answer of a node whose deadline leaves no time for one step.

    What a board client reports (``flowerbed.clients.timed``): zero steps on
    zero examples and the model as received. Not an error: the node is slow,
    not broken, and a strategy can lengthen the deadline or assign less work.
    """
    metrics = MetricRecord(
        {
            keys.NUM_EXAMPLES: 0,
            keys.NUM_STEPS: 0,
            keys.TRAIN_TIME_S: 0.0,
            keys.COMM_TIME_S: plan.comm_s,
            keys.ENERGY_J: vclock.energy_joules(plan.node.device, 0.0, plan.comm_s),
            keys.PARTITION_ID: plan.node.partition_id,
        }
    )
    arrays = message.content.array_records[keys.ARRAYS]
    return Message(
        RecordDict({keys.ARRAYS: arrays, keys.METRICS: metrics}), reply_to=message
    )


def train_reply(
    message: Message,
    plan: TrainPlan,
    stats: TrainStats,
    weights: Mapping[str, np.ndarray] | ArrayRecord,
) -> Message:
    """The reply to a train task: trained weights and the device's virtual costs.

    ``weights`` may come encoded already (an ``ArrayRecord``).
    """
    compute_s = stats.num_steps * plan.step_s
    metrics = filled(
        MetricRecord(),
        {
            keys.NUM_EXAMPLES: stats.num_examples,
            keys.NUM_STEPS: stats.num_steps,
            keys.TRAIN_TIME_S: compute_s,
            keys.COMM_TIME_S: plan.comm_s,
            keys.SAMPLES_PER_S: stats.num_examples / compute_s,
            keys.ENERGY_J: vclock.energy_joules(
                plan.node.device, compute_s, plan.comm_s
            ),
            keys.PARTITION_ID: plan.node.partition_id,
            keys.TRAIN_LOSS: stats.mean_loss,
        },
    )
    arrays = weights if isinstance(weights, ArrayRecord) else encode_record(weights)
    content = filled(RecordDict(), {keys.ARRAYS: arrays, keys.METRICS: metrics})
    return Message(content, reply_to=message)


def _train_alone(
    plan: TrainPlan, weights: Mapping[str, torch.Tensor]
) -> tuple[dict[str, np.ndarray], TrainStats]:
    """Train the process's model of the plan's architecture from ``weights``;
    its trained weights are views of the model's (encode them before the
    model trains again)."""
    model = _model_of(plan.scenario)
    model.load_state_dict(weights)
    stats = plan.train(model)
    return {name: t.numpy() for name, t in model.state_dict().items()}, stats


def train(message: Message, context: Context) -> Message:
    """Train on local data; report the device's virtual time, energy and work."""
    plan = plan_train(message, context)
    if plan.steps == 0:
        return no_step_reply(message, plan)
    weights = torch_state_dict(message.content.array_records[keys.ARRAYS])
    trained, stats = _train_alone(plan, weights)
    return train_reply(message, plan, stats, trained)


def _job(plan: TrainPlan, weights: Mapping[str, np.ndarray]) -> NodeJob:
    return NodeJob(
        weights,
        plan.node.x_train,
        plan.node.y_train,
        plan.steps,
        plan.batch,
        plan.lr,
        plan.seed,
        plan.proximal_mu,
    )


def train_batch(tasks: Sequence[tuple[Message, Context]]) -> list[Message | Exception]:
    """Run many train tasks as :func:`train` would, batching what can be batched.

    Tasks whose nodes train the same architecture are trained together by
    :func:`flowerbed.sims.batched.train_many` (equal to :func:`train` within
    float tolerance), from views of each distinct ArrayRecord's bytes (read
    once, in place); nodes trained alone get its arrays decoded once. Returns,
    in task order, each task's reply or the exception :func:`train` would have
    raised (``NodeDropout`` included).
    """
    single_threaded()
    results: list[Message | Exception | None] = [None] * len(tasks)
    plans: dict[int, TrainPlan] = {}
    received: dict[int, ArrayRecord] = {}  # each task's
    views: dict[int, dict[str, np.ndarray]] = {}  # by record
    decoded: dict[int, dict[str, torch.Tensor]] = {}  # by record
    for i, (message, context) in enumerate(tasks):
        try:
            plan = plan_train(message, context)
            if plan.steps == 0:
                results[i] = no_step_reply(message, plan)
                continue
            record = message.content[keys.ARRAYS]
            if not isinstance(record, ArrayRecord):
                raise TypeError(f"{keys.ARRAYS!r} is not an ArrayRecord")
            if id(record) not in views:  # a round's arrays: read once
                views[id(record)] = record_views(record)
            received[i] = record
            plans[i] = plan
        except Exception as err:
            results[i] = err
    groups: dict[tuple[str, str, str], list[int]] = {}
    for i, plan in plans.items():
        s = plan.scenario
        groups.setdefault((s.model, s.dataset, s.data_dir), []).append(i)
    for members in groups.values():
        model = _model_of(plans[members[0]].scenario)
        trained: list[tuple[ArrayRecord, TrainStats]] | None = None
        if batchable(model) and len(members) > 1:
            try:
                jobs = [_job(plans[i], views[id(received[i])]) for i in members]
                done = train_many(model, jobs)
                records = encode_records([state for state, _ in done])
                trained = [
                    (r, stats) for r, (_, stats) in zip(records, done, strict=True)
                ]
            except Exception:  # one node's failure must stay that node's
                trained = None
        for k, i in enumerate(members):
            state: ArrayRecord | Mapping[str, np.ndarray]
            try:
                if trained:
                    state, stats = trained[k]
                else:
                    record = received[i]
                    if id(record) not in decoded:
                        decoded[id(record)] = torch_state_dict(record)
                    state, stats = _train_alone(plans[i], decoded[id(record)])
                results[i] = train_reply(tasks[i][0], plans[i], stats, state)
            except Exception as err:
                results[i] = err
    return [r for r in results if r is not None]


def evaluate_local(message: Message, context: Context) -> Message:
    """Evaluate the received model on this node's share of the test set."""
    scenario, node = _identity(context)
    config = _config(message)
    server_round = int(_number(config, keys.SERVER_ROUND, 0))
    dev = node.device
    comm_s = vclock.transfer_seconds(node.model_bytes, dev.downlink_mbps)
    eval_s = len(node.x_test) * dev.seconds_per_sample * node.cost_factor * EVAL_COST
    _maybe_drop(scenario, node, server_round, EVALUATE, comm_s + eval_s)
    loss, acc = evaluate(_model_from(message, scenario), node.x_test, node.y_test)
    metrics = MetricRecord(
        {
            keys.NUM_EXAMPLES: len(node.x_test),
            keys.EVAL_LOSS: loss,
            keys.EVAL_ACC: acc,
            keys.EVAL_TIME_S: eval_s,
            keys.COMM_TIME_S: comm_s,
            keys.PARTITION_ID: node.partition_id,
        }
    )
    return Message(RecordDict({keys.METRICS: metrics}), reply_to=message)


def profile(message: Message, context: Context) -> Message:
    """Answer a profiling query with the virtual time of ``profile-steps`` steps.

    Same keys as the board clients' query (``flowerbed.clients.board_app.profile``):
    the device's speed and power, as the virtual clock prices them; the model is
    downloaded (it travels with the query), nothing is uploaded.
    """
    scenario, node = _identity(context)
    config = _config(message)
    steps = int(_number(config, keys.PROFILE_STEPS, DEFAULT_PROFILE_STEPS))
    server_round = int(_number(config, keys.SERVER_ROUND, 0))
    dev = node.device
    batch = min(scenario.batch_size, len(node.x_train))
    compute_s = steps * vclock.step_seconds(dev, batch, node.cost_factor)
    comm_s = vclock.transfer_seconds(node.model_bytes, dev.downlink_mbps)
    _maybe_drop(scenario, node, server_round, QUERY, comm_s + compute_s)
    metrics = MetricRecord(
        {
            keys.NUM_STEPS: steps,
            keys.NUM_EXAMPLES: steps * batch,
            keys.TRAIN_TIME_S: compute_s,
            keys.COMM_TIME_S: comm_s,
            keys.SAMPLES_PER_S: steps * batch / compute_s,
            keys.POWER_W: dev.busy_w,
            keys.ENERGY_J: vclock.energy_joules(dev, compute_s, comm_s),
            keys.PARTITION_ID: node.partition_id,
        }
    )
    return Message(RecordDict({keys.METRICS: metrics}), reply_to=message)


def _reply_on_dropout(task: ClientAppCallable) -> ClientAppCallable:
    """``task`` whose simulated dropout becomes the reply Flower would deliver.

    A vanished node answers as Flower's SuperLink does once the message expires
    (``REPLY_MESSAGE_UNAVAILABLE``), a failed one with
    ``CLIENT_APP_RAISED_EXCEPTION``; the reason keeps the dropout's tag, from
    which :class:`~flowerbed.sims.virtual_grid.VirtualTimeGrid` times it.
    Quietly: no traceback and no line of its own. Under ``flwr run`` a node's
    lines reach the run's log whenever Ray forwards them, rounds after the
    event; the strategy's log names each failure when its round takes it
    ("Received error in reply from node N: ..."), and the run folder counts
    them.
    """

    @functools.wraps(task)
    def run(message: Message, context: Context) -> Message:
        try:
            return task(message, context)
        except vclock.NodeDropout as drop:
            code = (
                ErrorCode.REPLY_MESSAGE_UNAVAILABLE
                if drop.silent
                else ErrorCode.CLIENT_APP_RAISED_EXCEPTION
            )
            return Message(Error(code, str(drop)), reply_to=message)

    return run


def make_client_app(*, raise_dropouts: bool) -> ClientApp:
    """The simulated node as a Flower ClientApp (train, evaluate, query).

    ``raise_dropouts=True`` for flowerbed's in-process engine, which catches
    :class:`~flowerbed.sims.vclock.NodeDropout` and delivers the failure at its
    virtual time (a vanished node's when its message's TTL expires). ``False``
    for Flower's simulation engine (``flwr run``): the dropout becomes the same
    error reply, quietly (:func:`_reply_on_dropout`).
    """
    wrap = (lambda task: task) if raise_dropouts else _reply_on_dropout
    app = ClientApp()
    app.train()(wrap(train))
    app.evaluate()(wrap(evaluate_local))
    app.query()(wrap(profile))
    return app
