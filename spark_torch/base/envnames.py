"""Every environment variable spark_torch sets for a rank or passes between its processes,
named once (the user's settings are in :mod:`spark_torch.settings`, with their variables).

Pure constants: imported by the driver, node and rank layers alike; nothing here reads the
environment.
"""

from __future__ import annotations

__all__ = [
    "FULL_TRACEBACK",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "THREAD_VARS",
    "IMPORT_SIZED_THREAD_VARS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_USE_AGENT_STORE",
    "HOST_STORE",
    "RUN_ID",
    "NODE_MARKER",
    "NODE_TOKEN",
    "MARK_SLOT",
    "RESTART_COUNT",
    "PARENT_PID",
    "REPORT_FDS",
    "STORAGE",
    "CHECKPOINT",
    "START_STEP",
    "DATA_FILE",
    "DATA_COLUMNS",
    "DATA_ROWS",
    "REPLICA_GROUP_ID",
    "NUM_REPLICA_GROUPS",
    "TORCHFT_LIGHTHOUSE",
    "RUST_LOG",
    "RUST_LOG_DEFAULT",
    "CLI_VERBOSE",
    "DS_ACCELERATOR",
    "STACK_FILE",
    "SAMPLE_SECONDS",
    "STACK_ALL_THREADS",
    "STACK_SOURCE_LINES",
    "FR_BUFFER_SIZE",
    "NCCL_TRACE_BUFFER_SIZE",
    "STORAGE_OPTIONS",
    "RESERVED",
    "SCRUBBED",
]

# torchrun's contract: every rank gets these (documented in spark_torch.rank.function_main)
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
NODE_RANK = "NODE_RANK"
GROUP_RANK = "GROUP_RANK"
GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE"
ROLE_RANK = "ROLE_RANK"
ROLE_WORLD_SIZE = "ROLE_WORLD_SIZE"
ROLE_NAME = "ROLE_NAME"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
#: thread pools sized per rank (Spark pins OMP_NUM_THREADS=1 for Python tasks)
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
#: thread pools sized once, when their library is imported (numpy's OpenBLAS): a fork cannot
#: resize them (spark_torch.node.template.protocol starts such a rank cold unless they are 1)
IMPORT_SIZED_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS")
TORCHELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"
TORCHELASTIC_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
TORCHELASTIC_MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
#: where torch's ``@record`` writes a rank's error (read back as its traceback)
TORCHELASTIC_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
#: the rendezvous store is hosted before the ranks start (node 0 only)
TORCHELASTIC_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"

# ours, for every rank (and everything it starts: also the node's marker for orphan searches)
RUN_ID = "SPARK_TORCH_RUN_ID"
#: a random token drawn by each node for each attempt (:func:`spark_torch.node.workdir.node_marker`)
NODE_TOKEN = "SPARK_TORCH_NODE_TOKEN"
#: a node's marker: these three of every rank's variables, which everything the rank starts
#: inherits (:func:`spark_torch.node.workdir.node_marker`), find the node's processes of this
#: attempt: the token tells them from another run with the same run id, or the next attempt
NODE_MARKER = (RUN_ID, NODE_RANK, NODE_TOKEN)
#: the warm-start template's last variable: room in its environment block that each of its
#: children overwrites with its node's marker (:mod:`spark_torch.node.template.child`)
MARK_SLOT = "SPARK_TORCH_MARK_SLOT"
RESTART_COUNT = "SPARK_TORCH_RESTART_COUNT"

# between a node runner and its ranks (internal)
#: the process a rank must die with (its node runner, or the warm-start template)
PARENT_PID = "SPARK_TORCH_PARENT_PID"
#: "1" for rank 0 when node 0 did not host the rendezvous store before the ranks started (warm
#: starts off, or its store host not ready in time): rank 0 hosts it on MASTER_ADDR only
#: (:mod:`spark_torch.rank.store`), which removes the variable before the user's code runs
HOST_STORE = "SPARK_TORCH_HOST_STORE"
#: "W,R": the pipe ends a rank writes its reports to and reads the answers from
REPORT_FDS = "SPARK_TORCH_REPORT_FDS"
#: the path of the node's storage.json (:meth:`spark_torch.shared.workdir_files.WorkdirFiles.storage`),
#: the run's storage for checkpoint uploads (its schema: :class:`spark_torch.shared.workdir_files.StorageFile`)
STORAGE = "SPARK_TORCH_STORAGE"
#: local directory of the checkpoint this attempt resumed from
CHECKPOINT = "SPARK_TORCH_CHECKPOINT"
#: the step of that checkpoint: the next report() is step START + 1
START_STEP = "SPARK_TORCH_START_STEP"
#: run_on_dataframe: the node's Arrow file, the explicit columns (JSON), every node's row count (JSON)
DATA_FILE = "SPARK_TORCH_DATA_FILE"
DATA_COLUMNS = "SPARK_TORCH_DATA_COLUMNS"
DATA_ROWS = "SPARK_TORCH_DATA_ROWS"
#: replica groups (:mod:`spark_torch.ft.env`): the rank's group, how many there are, the
#: lighthouse's address (torchft's own name: its Manager reads it when given no address)
REPLICA_GROUP_ID = "REPLICA_GROUP_ID"
NUM_REPLICA_GROUPS = "NUM_REPLICA_GROUPS"
TORCHFT_LIGHTHOUSE = "TORCHFT_LIGHTHOUSE"
#: the log filter of torchft's Rust side (its Manager server logs ~9 INFO lines a step); a replica
#: group's ranks and the lighthouse's process get RUST_LOG_DEFAULT unless the user set RUST_LOG
#: (spark_torch.node.rank_env, spark_torch.ft.hideout)
RUST_LOG = "RUST_LOG"
RUST_LOG_DEFAULT = "warn"

#: stall detection: where a rank's sampler writes its main thread's stack, how often, and
#: whether it adds every other thread's stack (spark_torch.rank.sampler)
STACK_FILE = "SPARK_TORCH_STACK_FILE"
SAMPLE_SECONDS = "SPARK_TORCH_SAMPLE_SECONDS"
STACK_ALL_THREADS = "SPARK_TORCH_STACK_ALL_THREADS"
#: "0": the rank's sampler reads no source line (``stall_source_lines=False``: none is ever in a stack it writes)
STACK_SOURCE_LINES = "SPARK_TORCH_STACK_SOURCE_LINES"
#: torch's Flight Recorder: how many collectives each process group remembers (the newer name
#: covers gloo and NCCL, the older one NCCL in earlier torch releases)
FR_BUFFER_SIZE = "TORCH_FR_BUFFER_SIZE"
NCCL_TRACE_BUFFER_SIZE = "TORCH_NCCL_TRACE_BUFFER_SIZE"

#: DeepSpeed's accelerator choice: ``cpu`` for DeepspeedTorchDistributor ranks without GPUs
DS_ACCELERATOR = "DS_ACCELERATOR"

#: the ``spark-torch`` command keeps Spark's own log level (``--verbose`` does the same)
CLI_VERBOSE = "SPARK_TORCH_CLI_VERBOSE"
#: the ``spark-torch`` command's storage options when ``--storage-options`` is not given: JSON,
#: or ``@FILE`` (credentials stay off the command line, which every local user can read)
STORAGE_OPTIONS = "SPARK_TORCH_STORAGE_OPTIONS"

#: set by the launcher for every rank; a user's ``env=`` may not override them
RESERVED = frozenset({RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, GROUP_RANK, MASTER_ADDR, MASTER_PORT})

#: never reach user code, nor a warm-start template's or a reaper's environment: Spark's own
#: secrets (``_SPARK_AUTH_SECRET`` is set for executors and their Python workers when
#: spark.authenticate is on; the Py4J gateway and worker-factory secrets; a Spark Connect
#: token), the ports they protect, the ``spark-torch`` command's storage credentials, and a
#: torchrun agent's store from an outer launcher
SCRUBBED = frozenset(
    {
        STORAGE_OPTIONS,
        "_SPARK_AUTH_SECRET",
        "PYSPARK_GATEWAY_SECRET",
        "PYSPARK_GATEWAY_PORT",
        "PYTHON_WORKER_FACTORY_SECRET",
        "PYTHON_WORKER_FACTORY_PORT",
        "SPARK_CONNECT_AUTHENTICATE_TOKEN",
        TORCHELASTIC_USE_AGENT_STORE,
    }
)

#: read on the driver: set to 1 for spark_torch's errors with every internal frame and their whole
#: chain (by default they leave ``run()`` with the user's frames and the message only)
FULL_TRACEBACK = "SPARK_TORCH_FULL_TRACEBACK"
