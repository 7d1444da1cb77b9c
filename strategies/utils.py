"""Deprecated: the strategies' shared mechanics now live in modules named for
what they hold. Import from those; this alias goes in the next release.

=================================  ==========================================
what                               where
=================================  ==========================================
reply checks (``ReplyRejected``)   ``flowerbed.replies``
staleness discounts                ``flowerbed.strategies.staleness``
round bookkeeping keys             ``flowerbed.strategies.round_metrics``
streaming aggregation              ``flowerbed.strategies.accumulation``
sampling and quarantine            ``flowerbed.strategies.sampling``
messages in flight                 ``flowerbed.strategies.inflight``
checkpoints                        ``flowerbed.strategies.checkpoints``
=================================  ==========================================
"""

from __future__ import annotations

from flowerbed.moved import moved_names

_HOMES: dict[str, str] = {
    "ArraySpec": "flowerbed.replies",
    "Arrival": "flowerbed.strategies.inflight",
    "CHECKPOINT_FORMAT": "flowerbed.strategies.checkpoints",
    "CheckpointError": "flowerbed.strategies.checkpoints",
    "FOLD_CHUNK": "flowerbed.strategies.accumulation",
    "InFlight": "flowerbed.strategies.inflight",
    "MAX_METRIC_MAGNITUDE": "flowerbed.replies",
    "MAX_NUM_EXAMPLES": "flowerbed.replies",
    "MAX_STEPS": "flowerbed.replies",
    "MAX_TIME_S": "flowerbed.replies",
    "METRIC_RANGES": "flowerbed.replies",
    "MIN_TIME_S": "flowerbed.replies",
    "MetricsAccumulator": "flowerbed.strategies.accumulation",
    "PAD_FROM": "flowerbed.strategies.accumulation",
    "Quarantine": "flowerbed.strategies.sampling",
    "R": "flowerbed.replies",
    "ROUND_CLOCK_S": "flowerbed.strategies.round_metrics",
    "ROUND_DEADLINE_PERCENTILE": "flowerbed.strategies.round_metrics",
    "ROUND_DEADLINE_S": "flowerbed.strategies.round_metrics",
    "ROUND_LATE_UPDATES": "flowerbed.strategies.round_metrics",
    "ROUND_PARTICIPANTS": "flowerbed.strategies.round_metrics",
    "ROUND_STALENESS": "flowerbed.strategies.round_metrics",
    "ROUND_STRAGGLERS": "flowerbed.strategies.round_metrics",
    "ReplyRejected": "flowerbed.replies",
    "ReplyStream": "flowerbed.strategies.inflight",
    "STALENESS_FUNCTIONS": "flowerbed.strategies.staleness",
    "StalenessFn": "flowerbed.strategies.staleness",
    "TIME_METRICS": "flowerbed.replies",
    "Ticket": "flowerbed.strategies.inflight",
    "UNAVAILABLE_CODES": "flowerbed.replies",
    "Update": "flowerbed.strategies.accumulation",
    "UpdateAccumulator": "flowerbed.strategies.accumulation",
    "WAIT_FOR_NODES_S": "flowerbed.strategies.sampling",
    "_assigned_steps": "flowerbed.strategies.inflight",
    "_checkpoint_error": "flowerbed.strategies.checkpoints",
    "_content": "flowerbed.replies",
    "_digest": "flowerbed.strategies.checkpoints",
    "_metric_shape": "flowerbed.strategies.accumulation",
    "_number": "flowerbed.replies",
    "_read_only": "flowerbed.strategies.accumulation",
    "_rejection": "flowerbed.strategies.accumulation",
    "_single_metricrecord": "flowerbed.replies",
    "_sum_dtype": "flowerbed.strategies.accumulation",
    "cast_array": "flowerbed.replies",
    "check_evaluate_reply": "flowerbed.replies",
    "check_metrics": "flowerbed.replies",
    "check_positive": "flowerbed.strategies.accumulation",
    "check_train_reply": "flowerbed.replies",
    "constant_staleness": "flowerbed.strategies.staleness",
    "enough_usable": "flowerbed.strategies.inflight",
    "hinge_staleness": "flowerbed.strategies.staleness",
    "load_checkpoint": "flowerbed.strategies.checkpoints",
    "metric_history_from_json": "flowerbed.strategies.checkpoints",
    "metric_history_to_json": "flowerbed.strategies.checkpoints",
    "metricrecord_to_json": "flowerbed.strategies.checkpoints",
    "polynomial_staleness": "flowerbed.strategies.staleness",
    "records_of": "flowerbed.replies",
    "remove_stale_temporaries": "flowerbed.strategies.checkpoints",
    "resolve_staleness_fn": "flowerbed.strategies.staleness",
    "round_rng": "flowerbed.strategies.sampling",
    "sample_nodes": "flowerbed.strategies.sampling",
    "save_checkpoint": "flowerbed.strategies.checkpoints",
    "spec_of": "flowerbed.replies",
    "to_arrayrecord": "flowerbed.strategies.accumulation",
    "to_numpy": "flowerbed.strategies.accumulation",
}


__getattr__ = moved_names(__name__, _HOMES)


def __dir__() -> list[str]:
    return sorted(_HOMES)
