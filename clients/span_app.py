"""The ClientApp boards run for jobs that span devices (pipeline, all-reduce, tiles).

Point a Flower App's ``clientapp`` at ``flowerbed.clients.span_app:app`` and start
each board's SuperNode with the address its peers reach::

    flower-supernode --superlink SERVER:8000 \\
        --node-config "address='192.168.1.12' device='rpi4b'"

node_config (per board):

- ``address`` (required): this board's IP (or host name) on the network the
  members share; rank 0 hosts the rendezvous on it and every member binds gloo
  to it. A query checks that it is one of the board's own addresses.
- ``state-dir``: folder for the member's on-disk layer store (own snapshots and
  neighbour replicas, :class:`~flowerbed.parallel.store.LayerStore`); default
  ``<tmp>/flowerbed-span/node-<node id>``.
- ``dataset-path``: the board's own training data (image folder or ``.npz``,
  :mod:`flowerbed.clients.local_data`), used when it holds the first stage of a
  job whose dataset is ``local``.
- ``device``: a label echoed in replies.
- ``emulate-gflops`` (simulation and tests): emulate a device training at this
  many GFLOP/s (real compute plus a sleep up to the device's time);
  ``slow-from-step`` and ``slow-factor`` make it that much slower from a global
  step on; ``crash-at-step`` makes the ClientApp's process exit abruptly when
  a pipeline segment reaches that global step (a board losing power).

Messages: ``train`` carries a plan (:class:`~flowerbed.parallel.plan.MemberPlan`)
and the layers the server sends; the plan names the model and, when the job
has its own, the loss and optimiser factory as ``"package.module:attribute"``
(:class:`~flowerbed.parallel.user_code.Training`), which this process imports,
so they must be installed on the board; the reply holds the member's layers
(``arrays``), optimiser state (``optimizer``), measurements (``metrics``) and a
``span`` ConfigRecord (address, ``failure`` text). A lost peer is not an error:
the reply says ``span-ok = 0`` with the step it stopped at and the ranks it
found gone (``span-lost-ranks``); a ClientApp whose SuperNode dies during a
segment ends itself, so its peers stop at once. ``query`` profiles the
board for the plan's mode; ``evaluate`` evaluates the whole model. Problems of the
plan or the board (bad plan, rendezvous port in use, address not this board's,
missing data) are error replies naming the problem; the SuperNode keeps running.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Mapping
from logging import ERROR
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flowerbed import keys
from flowerbed.data import DataError
from flowerbed.parallel.emulation import DeviceSpeed
from flowerbed.parallel.group import RendezvousError
from flowerbed.parallel.job_data import load_job_dataset
from flowerbed.parallel.member import MemberContext, MemberResult
from flowerbed.parallel.modes import EVALUATORS, PROFILERS, RUNNERS, resolve
from flowerbed.parallel.pipeline.stage import LOCAL_DATASET
from flowerbed.parallel.plan import MemberPlan, PlanError, check_address
from flowerbed.parallel.store import MOMENTUM_PREFIX
from flowerbed.parallel.user_code import build_layers
from flowerbed.parallel.watchdog import start_supernode_watchdog
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.supercore import log

ADDRESS = "address"
STATE_DIR = "state-dir"
DATASET_PATH = "dataset-path"
DEVICE = "device"
EMULATE_GFLOPS = "emulate-gflops"
SLOW_FROM_STEP = "slow-from-step"
SLOW_FACTOR = "slow-factor"
CRASH_AT_STEP = "crash-at-step"

ERROR_CODE = ErrorCode.CLIENT_APP_RAISED_EXCEPTION

app = ClientApp()


class SpanBoardError(ValueError):
    """A board setting that stops this board from taking part."""


def _node_number(node_config: Mapping[str, Any], key: str, default: float) -> float:
    value = node_config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SpanBoardError(f"node_config '{key}' must be a number, got {value!r}")
    return float(value)


def member_context(context: Context) -> MemberContext:
    """The :class:`MemberContext` a node_config describes (see the module doc)."""
    node_config = dict(context.node_config)
    try:
        address = check_address(node_config.get(ADDRESS), f"node_config '{ADDRESS}'")
    except PlanError as err:
        raise SpanBoardError(str(err)) from None
    root = node_config.get(STATE_DIR) or str(
        Path(tempfile.gettempdir()) / "flowerbed-span" / f"node-{context.node_id}"
    )
    speed = None
    if EMULATE_GFLOPS in node_config:
        gflops = _node_number(node_config, EMULATE_GFLOPS, 0.0)
        try:
            speed = DeviceSpeed(
                flops_per_s=gflops * 1e9,
                slow_from_step=int(_node_number(node_config, SLOW_FROM_STEP, -1)),
                slow_factor=_node_number(node_config, SLOW_FACTOR, 1.0),
            )
        except ValueError as err:
            raise SpanBoardError(f"node_config emulation: {err}") from None
    path = node_config.get(DATASET_PATH, "")
    local_data = None
    if isinstance(path, str) and path:

        def local_data() -> tuple[np.ndarray, np.ndarray]:
            from flowerbed.clients.local_data import load_local_data

            data = load_local_data(path)
            return data.x, data.y

    return MemberContext(
        address=address,
        store_root=Path(str(root)),
        node_id=context.node_id,
        speed=speed,
        local_data=local_data,
        label=str(node_config.get(DEVICE, "")),
        crash_at_step=int(_node_number(node_config, CRASH_AT_STEP, -1)),
    )


def error_reply(message: Message, err: Exception) -> Message:
    """The error reply naming a problem of the plan or the board."""
    reason = f"flowerbed span client: {err}"
    log(ERROR, "%s reply is an error: %s", message.metadata.message_type, reason)
    return Message(Error(code=ERROR_CODE, reason=reason), reply_to=message)


def member_reply(
    message: Message, member: MemberContext, result: MemberResult
) -> Message:
    """The reply carrying a runner's :class:`MemberResult` (module doc)."""
    content = RecordDict({keys.METRICS: MetricRecord(dict(result.metrics))})
    if result.arrays:
        content[keys.ARRAYS] = ArrayRecord(
            {k: Array(np.asarray(v)) for k, v in result.arrays.items()}
        )
    if result.optimizer:
        content[keys.SPAN_OPTIMIZER] = ArrayRecord(
            {k: Array(np.asarray(v)) for k, v in result.optimizer.items()}
        )
    info: dict[str, Any] = {
        ADDRESS: member.address,
        DEVICE: member.label,
        "failure": result.failure,
    }
    info.update(result.info)
    content[keys.SPAN_RECORD] = ConfigRecord(info)
    return Message(content, reply_to=message)


def message_config(message: Message) -> ConfigRecord:
    """The message's ``config`` ConfigRecord (empty when it has none)."""
    return message.content.config_records.get(keys.CONFIG, ConfigRecord())


def message_arrays(message: Message) -> dict[str, np.ndarray]:
    """The message's model and optimiser arrays, as a runner takes them."""
    out: dict[str, np.ndarray] = {}
    for name in (keys.ARRAYS, keys.SPAN_OPTIMIZER):
        if name in message.content.array_records:
            prefix = MOMENTUM_PREFIX if name == keys.SPAN_OPTIMIZER else ""
            for key, array in message.content.array_records[name].items():
                out[prefix + key] = array.numpy()
    return out


def span_query(message: Message) -> dict[str, Any]:
    """The decoded ``span-query`` JSON of a query or evaluate message."""
    raw = message_config(message).get(keys.SPAN_QUERY)
    if not isinstance(raw, str):
        raise PlanError(
            f"the query has no {keys.SPAN_QUERY!r} JSON: not a span job query"
        )
    try:
        query = json.loads(raw)
    except ValueError as err:
        raise PlanError(f"{keys.SPAN_QUERY!r} is not valid JSON: {err}") from None
    if not isinstance(query, dict) or not isinstance(query.get("mode"), str):
        raise PlanError(f"{keys.SPAN_QUERY!r} must be an object with a 'mode'")
    return query


HANDLED = (SpanBoardError, PlanError, RendezvousError, DataError, ValueError)
"""Exceptions that become error replies (the plan or the board is wrong)."""


@app.train()
def train(message: Message, context: Context) -> Message:
    """Run one segment of the plan's mode; reply with state and measurements.

    A watchdog ends this process if its SuperNode dies meanwhile
    (:mod:`flowerbed.parallel.watchdog`), so that its peers stop at once."""
    start_supernode_watchdog()
    try:
        member = member_context(context)
        plan = MemberPlan.from_config(message_config(message))
        runner = resolve(RUNNERS, plan.mode)
        result = runner(plan, member, message_arrays(message))
    except HANDLED as err:
        return error_reply(message, err)
    return member_reply(message, member, result)


@app.query()
def query(message: Message, context: Context) -> Message:
    """Profile this board for a span job (and check its advertised address)."""
    try:
        member = member_context(context)
        member.check_address()
        request = span_query(message)
        profiler = resolve(PROFILERS, request["mode"])
        result = profiler(request, member)
    except HANDLED as err:
        return error_reply(message, err)
    return member_reply(message, member, result)


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    """Evaluate the whole model the message carries on the job's held-out data.

    A mode with its own evaluator (:data:`flowerbed.parallel.modes.EVALUATORS`)
    uses it; otherwise the query names the layered model (``model``,
    ``model_args``) and the ``dataset``: a built-in one's test split, or for
    ``local`` the board's own data (which then measures fit to its training
    data). Evaluation reports accuracy and cross-entropy, whatever loss the
    job trains with.
    """
    try:
        member = member_context(context)
        request = span_query(message)
        if request["mode"] in EVALUATORS:
            evaluator = resolve(EVALUATORS, request["mode"])
            return member_reply(
                message, member, evaluator(request, member, message_arrays(message))
            )
        model = build_layers(str(request.get("model", "")), request.get("model_args"))
        state = {
            k: torch.from_numpy(np.array(v))
            for k, v in message_arrays(message).items()
            if not k.startswith(MOMENTUM_PREFIX)
        }
        try:
            model.load_state_dict(state)
        except RuntimeError as err:
            raise SpanBoardError(
                f"the server's model does not fit {request.get('model')}: {err}"
            ) from None
        dataset = str(request.get("dataset", ""))
        if dataset == LOCAL_DATASET:
            if member.local_data is None:
                raise SpanBoardError(
                    "dataset 'local' but no node_config 'dataset-path'"
                )
            x, y = member.local_data()
        else:
            data = load_job_dataset(dataset)
            x, y = data.x_test, data.y_test
        from flowerbed.clients.board_app import chunked_evaluate  # evaluate only

        begin = time.monotonic()
        loss, acc = chunked_evaluate(model, x, y)
    except HANDLED as err:
        return error_reply(message, err)
    metrics = {
        keys.NUM_EXAMPLES: len(y),
        keys.EVAL_LOSS: loss,
        keys.EVAL_ACC: acc,
        keys.EVAL_TIME_S: time.monotonic() - begin,
    }
    return Message(RecordDict({keys.METRICS: MetricRecord(metrics)}), reply_to=message)
