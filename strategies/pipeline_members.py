"""The members of a :class:`~flowerbed.strategies.PipelineTraining` job: who is
admitted (profiled, each layer timed), who is usable for the next segment, and
which live members evaluate the model.

:class:`PipelineMembers` is PipelineTraining's base: it holds these steps of its
rounds apart from the rounds themselves (:mod:`flowerbed.strategies.pipeline`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from logging import INFO
from typing import Any

from flowerbed import keys
from flowerbed.parallel.pipeline.planner import Layout, PipelinePlanner
from flowerbed.parallel.pipeline.stage import INPUT_SHAPE, LOCAL_DATASET
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

from .pipeline_options import PipelinePlanning, Pipelining
from .pipeline_plan import stage_limit, usable_members
from .pipeline_rounds import read_profiles
from .span import SpanJobStrategy, SpanMember


class PipelineMembers(SpanJobStrategy):
    """Admission, usable members and evaluation of a pipeline job (module doc).

    The attributes below are PipelineTraining's (its class doc).
    """

    model: str
    model_args: dict[str, Any]
    input_shape: tuple[int, ...]
    dataset: str
    batch_size: int
    num_layers: int
    pipelining: Pipelining
    planning: PipelinePlanning
    planner: PipelinePlanner
    layout: Layout | None
    members: dict[int, SpanMember]
    profiled_power: dict[int, float]

    # ------------------------------------------------------------------ members
    def _request(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "model": self.model,
            "model_args": self.model_args,
            "micro_batch": self.batch_size // self.pipelining.micro_batches,
            INPUT_SHAPE: list(self.input_shape),
            "repeats": self.planning.profile_repeats,
            "dataset": self.dataset,
            "step": self.step,
        }

    def admit(self, grid: Grid, node_ids: Iterable[int]) -> list[int]:
        """Profile the nodes not yet known; add the usable ones as members."""
        ids = [
            n
            for n in node_ids
            if n not in self.members and n not in self.lost and n not in self.refused
        ]
        if not ids:
            return []
        found, errors = self.profile_members(
            grid, ids, self._request(), self.planning.query_timeout_s
        )
        self.refused.update(errors)
        profiles, rejected = read_profiles(found, self.num_layers)
        self.refused.update(rejected)
        self.members.update({n: m for n, m in found.items() if n in profiles})
        self.planner.profiled(profiles)
        self.profiled_power.update({n: self.planner.power[n] for n in profiles})
        if profiles and self.layout is not None:
            log(INFO, "PipelineTraining: new members %s", sorted(profiles))
        return sorted(profiles)

    def _usable(self) -> list[int]:
        """Candidate members in stage order (:func:`usable_members`)."""
        fixed = self.planner.fixed_sizes
        return usable_members(
            self.layout,
            self.members,
            self.lost,
            self.dataset == LOCAL_DATASET,
            stage_limit(self.num_layers, self.planning, self.pipelining, fixed),
            self.planner.power,
        )

    def live_members(self) -> list[int]:
        return sorted(m for m in self.members if m not in self.lost)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Evaluation messages to ``fraction_evaluate`` of the live members (at
        least ``min_evaluate_nodes``) with the whole model and
        :meth:`evaluation_query`. Unlike FedAvg it never waits for nodes to
        connect: lost boards are not asked."""
        del grid
        if self.fraction_evaluate == 0.0:
            return []
        live = self.live_members()
        count = max(
            math.ceil(len(live) * self.fraction_evaluate), self.min_evaluate_nodes
        )
        config = ConfigRecord(dict(config))
        config[keys.SERVER_ROUND] = server_round
        config[keys.SPAN_QUERY] = json.dumps(self.evaluation_query(), sort_keys=True)
        content = RecordDict(
            {self.arrayrecord_key: arrays, self.configrecord_key: config}
        )
        return [
            Message(content, dst_node_id=node_id, message_type=MessageType.EVALUATE)
            for node_id in live[:count]
        ]
