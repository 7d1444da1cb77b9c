"""Keys on the wire, in one place (kebab-case, like Flower's own ``num-examples``).

Client -> server keys travel in the reply's ``MetricRecord``; server -> client keys
travel in the train ``ConfigRecord``. See docs/ARCHITECTURE-level contract in
README ("Keys on the wire").
"""

# Client -> server (reply MetricRecord) ---------------------------------------
NUM_EXAMPLES = "num-examples"
"""Samples trained on (Flower's convention; used as the FedAvg weight)."""
TRAIN_TIME_S = "train-time-s"
"""Seconds the node spent computing this task (virtual seconds in simulation)."""
NUM_STEPS = "num-steps"
"""Optimiser steps actually taken (fewer than assigned means partial work)."""
SAMPLES_PER_S = "samples-per-s"
ENERGY_J = "energy-j"
POWER_W = "power-w"
BATTERY_PCT = "battery-pct"
TEMP_C = "temp-c"
COMM_TIME_S = "comm-time-s"
"""Seconds spent moving the model down and the update up (simulation reports it)."""
PARTITION_ID = "partition-id"
"""Which simulated node answered (simulation only; stable across engines)."""

OPTIONAL_METRIC_KEYS = (SAMPLES_PER_S, ENERGY_J, POWER_W, BATTERY_PCT, TEMP_C)

# Evaluation replies ------------------------------------------------------------
EVAL_LOSS = "eval-loss"
EVAL_ACC = "eval-acc"

# Server -> client (train ConfigRecord) -------------------------------------------
SERVER_ROUND = "server-round"
DEADLINE_S = "deadline-s"
"""Stop training after this many seconds and report the partial work."""
LOCAL_STEPS = "local-steps"
"""Optimiser steps assigned to this node this round."""
LEARNING_RATE = "lr"
BATCH_SIZE = "batch-size"

# Record names inside a Message's RecordDict (Flower's FedAvg defaults) ----------
ARRAYS = "arrays"
METRICS = "metrics"
CONFIG = "config"
EVAL_TIME_S = "eval-time-s"
"""Seconds an evaluation task took (virtual seconds in simulation)."""
TRAIN_LOSS = "train-loss"
"""Mean training loss over the steps taken."""
PROXIMAL_MU = "proximal-mu"
"""FedProx's mu, as Flower's FedProx puts it in the train ConfigRecord."""

# Profiling query (board clients) ------------------------------------------------------
PROFILE_STEPS = "profile-steps"
"""Query ConfigRecord: training steps a node times to measure its speed."""
DEVICE_RECORD = "device"
"""Query reply: ConfigRecord with the node's telemetry (CPU, memory, power...)."""
