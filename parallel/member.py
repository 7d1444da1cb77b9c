"""What a member of a span job is given and what it hands back.

The board's ClientApp (:mod:`flowerbed.clients.span_app`) turns a Flower message
into a :class:`MemberPlan` plus a :class:`MemberContext` (what the board knows
about itself: its advertised address, its disk store, its data, an emulated
speed), calls the mode's runner (:mod:`flowerbed.parallel.modes`) and turns the
:class:`MemberResult` into the reply. A runner never raises for a lost peer: it
returns ``ok=False`` with the failure, so the strategy always hears from every
survivor (an error reply is kept for problems of the plan or the board).

A member's state (weights, buffers, SGD momentum, by full-model name) comes out
of a module with :func:`module_state` and goes in with :func:`load_module_state`
(shapes checked; every mode uses these two). Moving states between members goes
through :func:`exchange_ring` (every member
sends to its successor and receives from its predecessor at once: replication)
and :func:`send_state` / :func:`recv_state` (one pair: layers moving at a
segment start). States travel as serialised bytes, so names, dtypes and shapes
arrive intact whatever the layer holds.

Every training mode's runner starts the same way: :func:`plan_training` reads
the plan's training settings and imports its loss, :func:`plan_optimizer` builds
the optimiser of the parameters the member holds; a name that does not import is
a :class:`PlanError` before the member joins its group.
"""

from __future__ import annotations

import io
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flowerbed import keys
from torch import nn

from .emulation import DeviceSpeed
from .group import check_bindable
from .plan import MemberPlan, PlanError
from .store import MOMENTUM_PREFIX, LayerStore, State
from .user_code import LossFn, Training, UserCodeError

MetricValue = int | float | list[int] | list[float]
MOMENTUM_BUFFER = "momentum_buffer"
"""``torch.optim.SGD``'s per-parameter state key."""
OPTIMIZER_SEP = "@"
"""Separates a parameter's name from an optimiser state key (:func:`optimizer_key`)."""


@dataclass
class MemberContext:
    """What a board knows about itself (from its node_config).

    Attributes
    ----------
    address : str
        The address its peers reach (node_config ``address``).
    store_root : Path
        Folder of its on-disk :class:`LayerStore` (node_config ``state-dir``).
    node_id : int
        Flower's node id (for logs).
    speed : DeviceSpeed, optional
        Emulated device speed (simulation and tests only).
    local_data : callable, optional
        Loads the board's own training data ``(x, y)`` (node_config
        ``dataset-path``); None when the board has none, and jobs then use their
        built-in dataset.
    label : str
        Free-form device label (node_config ``device``).
    crash_at_step : int
        Test aid: the member's process exits abruptly (no reply, no goodbye to
        its peers) when it reaches this global step; -1 never.
    """

    address: str
    store_root: Path
    node_id: int = 0
    speed: DeviceSpeed | None = None
    local_data: Callable[[], tuple[np.ndarray, np.ndarray]] | None = None
    label: str = ""
    crash_at_step: int = -1

    def store(self, job: str) -> LayerStore:
        return LayerStore(self.store_root, job)

    def check_address(self) -> None:
        """Raise :class:`RendezvousError` unless this machine owns its address."""
        check_bindable(self.address, 0)


@dataclass
class MemberResult:
    """A member's answer for one segment (or one query).

    ``arrays`` holds the model state the member reports (full-model names),
    ``optimizer`` its optimiser state (same names), ``metrics`` its measurements.
    ``ok`` is False when the segment stopped early; ``failure`` then says why and
    ``metrics`` carries ``span-failed-step`` and ``span-consistent-step``.
    """

    ok: bool
    metrics: dict[str, MetricValue]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    optimizer: dict[str, np.ndarray] = field(default_factory=dict)
    failure: str = ""
    info: dict[str, Any] = field(default_factory=dict)


def median_or_zero(values: Sequence[float]) -> float:
    """The median of a member's timings (robust to one-off stalls), 0 for none."""
    return float(statistics.median(values)) if values else 0.0


def mean_or_zero(values: Sequence[float]) -> float:
    """The mean of a member's timings, 0 for none: what the server multiplies by
    a segment's steps, so that their sum is the segment's time."""
    return float(statistics.fmean(values)) if values else 0.0


def lost_ranks_metric(lost_ranks: tuple[int, ...]) -> dict[str, MetricValue]:
    """The reply metric naming the peers a member found gone
    (:attr:`~flowerbed.parallel.group.PeerFailure.lost_ranks`); none when empty."""
    return {keys.SPAN_LOST_RANKS: list(lost_ranks)} if lost_ranks else {}


def segment_result(
    metrics: dict[str, MetricValue],
    failure: str,
    lost_ranks: tuple[int, ...],
    setup: Mapping[str, float],
    module: nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
) -> MemberResult:
    """A segment member's reply: ok when ``failure`` is empty; ``metrics`` gain the
    peers it found gone (:func:`lost_ranks_metric`) and its set-up times
    (``setup``: :meth:`~flowerbed.parallel.setup_time.SetupClock.metrics`). An ok
    member that returns weights (``module`` given) sends them with its optimiser
    state."""
    ok = not failure
    result = MemberResult(ok=ok, metrics=metrics, failure=failure)
    if ok and module is not None:
        result.arrays, result.optimizer = result_arrays(module_state(module, optimizer))
    result.metrics.update(lost_ranks_metric(lost_ranks))
    result.metrics.update(setup)
    return result


def plan_training(plan: MemberPlan) -> tuple[Training, LossFn]:
    """The plan's training settings and its loss, imported now: a loss or an
    optimiser factory that does not import is a :class:`PlanError`."""
    try:
        training = Training.from_options(plan.options)
        return training, training.loss_fn()
    except UserCodeError as err:
        raise PlanError(f"plan training: {err}") from None


def plan_optimizer(
    training: Training, plan: MemberPlan, params: Iterable[nn.Parameter]
) -> torch.optim.Optimizer:
    """The optimiser of ``params``: the job's own factory
    (:meth:`Training.make_optimizer`) or, without one, SGD with the plan's
    learning rate, momentum and weight decay; a factory that fails is a
    :class:`PlanError`."""
    try:
        optimizer: torch.optim.Optimizer = training.make_optimizer(
            params,
            plan.lr,
            lambda ps: torch.optim.SGD(
                ps, lr=plan.lr, momentum=plan.momentum, weight_decay=plan.weight_decay
            ),
        )
    except UserCodeError as err:
        raise PlanError(f"plan training: {err}") from None
    return optimizer


def module_state(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> State:
    """Copies of a module's weights and buffers and of its optimiser's state, by
    full-model name: what a member saves, replicates and replies
    (:mod:`~flowerbed.parallel.store`'s layout).

    A parameter's SGD momentum buffer is ``"momentum:" + name``; any other
    tensor its optimiser keeps (Adam's ``exp_avg``, ``step`` ...) is
    ``"momentum:" + name + "@" + key`` (:func:`optimizer_key`), so a user's
    ``torch.optim`` optimiser continues across segments as in one process.
    """
    state: State = {k: v.detach().clone() for k, v in module.state_dict().items()}
    if optimizer is not None:
        for name, param in module.named_parameters():
            for key, value in optimizer.state.get(param, {}).items():
                if isinstance(value, bool) or value is None:
                    continue
                if isinstance(value, int | float):
                    value = torch.tensor(value)
                if isinstance(value, torch.Tensor):
                    state[MOMENTUM_PREFIX + optimizer_key(name, key)] = (
                        value.detach().clone()
                    )
    return state


def optimizer_key(param: str, key: str) -> str:
    """State name of a parameter's optimiser entry ``key`` (without the
    ``"momentum:"`` prefix): the parameter's name for SGD's momentum buffer,
    ``param + "@" + key`` for any other."""
    return param if key == MOMENTUM_BUFFER else f"{param}{OPTIMIZER_SEP}{key}"


def optimizer_param(name: str) -> str:
    """The parameter an optimiser-state name (prefix removed) belongs to."""
    return name.split(OPTIMIZER_SEP, 1)[0]


def load_module_state(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    state: Mapping[str, torch.Tensor | np.ndarray],
    *,
    strict: bool = False,
) -> None:
    """Load :func:`module_state`'s layout (tensors or NumPy arrays) into a module.

    Every weight and buffer of ``module`` is required, with its shape; optimiser
    state is optional (a fresh optimiser starts without), a momentum buffer must
    have its parameter's shape. Names the module lacks are ignored (a stage or a tile
    member holds part of the model) unless ``strict`` (the whole model). Raises
    :class:`PlanError` naming what does not fit; nothing is loaded then.
    """
    weights = {k: v for k, v in state.items() if not k.startswith(MOMENTUM_PREFIX)}
    expected = module.state_dict()
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected)) if strict else []
    if missing or extra:
        raise PlanError(
            f"the state does not fit this member's layers: {len(missing)} arrays "
            f"missing, e.g. {missing[:3]}, {len(extra)} unexpected, e.g. "
            f"{extra[:3]}: server and board build different models"
        )
    params = dict(module.named_parameters())
    for name, value in state.items():
        if name.startswith(MOMENTUM_PREFIX):
            base = name[len(MOMENTUM_PREFIX) :]
            # momentum and moment buffers have their parameter's shape; scalars
            # (a step count) have none
            like = params.get(base) if OPTIMIZER_SEP not in base else None
        else:
            like = expected.get(name)
        if like is not None and tuple(value.shape) != tuple(like.shape):
            raise PlanError(
                f"array {name!r} has shape {list(value.shape)}, the model's is "
                f"{list(like.shape)}: server and board build different models"
            )
    module.load_state_dict({k: _tensor(weights[k]) for k in expected})
    if optimizer is None:
        return
    for name, param in params.items():
        buffer = state.get(MOMENTUM_PREFIX + name)
        if buffer is not None:
            momentum = _tensor(buffer).to(param.dtype)
            optimizer.state[param][MOMENTUM_BUFFER] = momentum
        entry = MOMENTUM_PREFIX + name + OPTIMIZER_SEP
        for key, value in state.items():
            if key.startswith(entry):
                optimizer.state[param][key[len(entry) :]] = _tensor(value)


def result_arrays(
    state: Mapping[str, torch.Tensor],
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A :func:`module_state` split for :class:`MemberResult`: the weights, and
    the momentum buffers without their prefix (the ClientApp adds it back)."""
    arrays = {
        k: v.numpy() for k, v in state.items() if not k.startswith(MOMENTUM_PREFIX)
    }
    momentum = {
        k[len(MOMENTUM_PREFIX) :]: v.numpy()
        for k, v in state.items()
        if k.startswith(MOMENTUM_PREFIX)
    }
    return arrays, momentum


def _tensor(value: torch.Tensor | np.ndarray) -> torch.Tensor:
    """A tensor owning its memory (a message's arrays may be read-only views)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return torch.from_numpy(np.array(value))


def state_to_bytes(state: Mapping[str, torch.Tensor]) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save({k: v.detach().contiguous() for k, v in state.items()}, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def bytes_to_state(payload: torch.Tensor) -> State:
    return dict(torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True))


def send_state(state: Mapping[str, torch.Tensor], dst: int) -> int:
    """Send ``state`` to rank ``dst``; return the bytes sent."""
    import torch.distributed as dist

    payload = state_to_bytes(state)
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64), dst)
    dist.send(payload, dst)
    return int(payload.numel())


def recv_state(src: int) -> State:
    """Receive a state sent by :func:`send_state` from rank ``src``."""
    import torch.distributed as dist

    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src)
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(payload, src)
    return bytes_to_state(payload)


@dataclass(frozen=True)
class Exchange:
    """Outcome of :func:`exchange_ring`: the predecessor's state and the timing."""

    received: State
    sent_bytes: int
    seconds: float


def exchange_ring(
    state: Mapping[str, torch.Tensor], rank: int, world_size: int
) -> Exchange:
    """Send ``state`` to the ring successor, receive the predecessor's, at once.

    Sizes first, then payloads, each as a pair of non-blocking send/receive, so no
    member waits on another's send (no deadlock whatever the order of arrival).
    ``seconds`` is the payload exchange's duration after a barrier, so it measures
    the link rather than the slowest member's arrival.
    """
    import torch.distributed as dist

    succ, pred = (rank + 1) % world_size, (rank - 1) % world_size
    payload = state_to_bytes(state)
    size_out = torch.tensor([payload.numel()], dtype=torch.int64)
    size_in = torch.zeros(1, dtype=torch.int64)
    works = [dist.isend(size_out, succ), dist.irecv(size_in, pred)]
    for work in works:
        if work is not None:
            work.wait()
    incoming = torch.empty(int(size_in.item()), dtype=torch.uint8)
    dist.barrier()
    begin = time.perf_counter()
    works = [dist.isend(payload, succ), dist.irecv(incoming, pred)]
    for work in works:
        if work is not None:
            work.wait()
    seconds = time.perf_counter() - begin
    return Exchange(bytes_to_state(incoming), int(payload.numel()), seconds)
