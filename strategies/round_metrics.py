"""Round bookkeeping keys: what the straggler-aware strategies add to each round's
train MetricRecord in the run's Result.
"""

from __future__ import annotations

# Round bookkeeping the straggler-aware strategies add to each train MetricRecord.
ROUND_PARTICIPANTS = "participants"
"""Nodes whose fresh update went into the round."""
ROUND_LATE_UPDATES = "late-updates"
"""Updates from earlier rounds folded into the round (staleness-discounted)."""
ROUND_STRAGGLERS = "stragglers"
"""Nodes sampled for the round that had not replied when it closed."""
ROUND_DEADLINE_S = "deadline-s"
"""The round's deadline in clock seconds (-1: none)."""
ROUND_DEADLINE_PERCENTILE = "deadline-percentile"
"""The percentile of recent durations the round's adaptive deadline was taken at
(-1: not adaptive)."""
ROUND_CLOCK_S = "clock-s"
"""Clock time (virtual seconds in simulation) when the round's model was made."""
ROUND_STALENESS = "staleness"
"""Mean staleness (model versions) of the updates in an asynchronous version."""
