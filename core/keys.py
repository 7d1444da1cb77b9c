"""Keys on the wire, in one place (kebab-case, like Flower's own ``num-examples``).

Client -> server keys travel in the reply's ``MetricRecord``; server -> client keys
travel in the train ``ConfigRecord``. docs/architecture.md ("Data flow") shows where
each travels; docs/deploy-boards.md (section 10) lists what a ClientApp reports.
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
START_WAIT_S = "start-wait-s"
"""Seconds from the deadline's origin (the task's creation on the server) to the
first training step: queueing, delivery and the ClientApp's start-up. A reply
with ``num-steps`` 0 and ``start-wait-s`` >= ``deadline-s`` got its task too late
to train (the board ClientApp reports it whenever the task had a deadline)."""
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
MIN_BATCH_SIZE = "min-batch-size"
"""With ``deadline-s``: a node that cannot finish one step of ``batch-size`` in
time trains one step on the largest batch that fits, if that batch holds at least
this many samples (work sized to the deadline per device)."""

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

# Jobs that span devices (flowerbed.parallel; span ClientApp replies) ----------------
SPAN_OK = "span-ok"
"""1 when the member finished its segment, 0 when it stopped on a lost peer."""
SPAN_FAILED_STEP = "span-failed-step"
"""Global step in progress when the segment stopped (-1: before the first step)."""
SPAN_LOST_RANKS = "span-lost-ranks"
"""Ranks a member that stopped on a lost peer found gone (their liveness port
refused or did not answer; absent when it found none)."""
SPAN_CONSISTENT_STEP = "span-consistent-step"
"""Newest global step at which the member holds both its own layers and its ring
predecessor's replica on disk (-1: none)."""
SPAN_FORWARD_S = "span-forward-s"
"""Median seconds of one micro-batch's forward pass on this member's layers."""
SPAN_BACKWARD_S = "span-backward-s"
"""Median seconds of one micro-batch's backward pass on this member's layers."""
SPAN_STEP_S = "span-step-s"
"""Mean wall seconds per step after the first (pipeline flush included)."""
SPAN_SETUP_S = "span-setup-s"
"""Seconds from the message's arrival to the first step (join, load, layer moves)."""
SPAN_REPLICATE_S = "span-replicate-s"
"""Mean seconds of one replication: the state copy, its save and the exchange
with the ring neighbours."""
SPAN_REPLICATE_BYTES = "span-replicate-bytes"
"""Bytes of one replication sent to the ring successor."""
SPAN_MOVED_BYTES = "span-moved-bytes"
"""Bytes of layer state received from peers at the segment start."""
SPAN_LINK_S = "span-link-s"
SPAN_LINK_BYTES_PER_S = "span-link-bytes-per-s"
"""Measured bandwidth of the link to the ring successor (probe or replication)."""
SPAN_HOLDS = "span-holds"
"""Layer states the member holds on disk: flat ``[step, first, stop]`` triples."""
SPAN_LAYER_FORWARD_S = "span-layer-forward-s"
SPAN_LAYER_BACKWARD_S = "span-layer-backward-s"
"""Profile replies: per-layer forward/backward seconds of one micro-batch (lists)."""
SPAN_OVERRUN_S = "span-overrun-s"
"""Seconds by which real compute exceeded an emulated device's time (0 on boards)."""
SPAN_STEP_COMPUTE_S = "span-step-compute-s"
"""All-reduce members: seconds of forward + backward compute of each step (list)."""
SPAN_STEP_COMM_S = "span-step-comm-s"
"""All-reduce members: seconds of each step not spent computing: the exposed
gradient all-reduce (list)."""
SPAN_LR = "span-lr"
"""All-reduce members: learning rate of the segment's last step."""
SPAN_QUERY = "span-query"
"""Query ConfigRecord key: JSON of the profiling request (mode and its settings)."""
SPAN_RECORD = "span"
"""Reply ConfigRecord with the member's address, failure text and other facts."""
SPAN_OPTIMIZER = "optimizer"
"""Reply/train ArrayRecord with optimiser state (momentum), model state names."""

# Fused-tile jobs (flowerbed.parallel.tiles.runner; span ClientApp replies) ------
TILES_SPEED = "tiles-speed"
"""Profile reply: forward multiply-accumulates per second of forward + backward on
the model's first layers (the tile planner's device speed)."""
TILES_MEMORY_BYTES = "tiles-memory-bytes"
"""Profile reply: bytes of memory available on the board."""
TILES_COMPUTE_S = "tiles-compute-s"
"""Median seconds per step computing (tiles, halo included, and the head)."""
TILES_LINK_S = "tiles-link-s"
"""Median seconds per step exchanging (halos, gather, all-reduce, waiting)."""
TILES_LINK_BYTES = "tiles-link-bytes"
"""Median bytes the member sent per step."""
TILES_MACS = "tiles-macs"
"""Forward multiply-accumulates of the member's tiles per step (halo included)."""
TILES_ACTIVATION_BYTES = "tiles-activation-bytes"
"""Peak bytes of tensors autograd kept for backward in one step (measured)."""
TILES_PEAK_RSS_BYTES = "tiles-peak-rss-bytes"
"""Peak resident memory of the member's process (measured)."""
