"""The immutable description of one run, resolved once on the driver and read everywhere else.

:class:`LaunchPlan` is how the run is laid out (from :func:`spark_torch.driver.run.plan.make_plan`);
:class:`RunSpec` adds what to run, the run's identity and where the driver's channel is. The
same ``RunSpec`` object travels to every node (pickled into the barrier task in distributed
mode) and is wrapped, not copied, by each node's :class:`~spark_torch.node.rank_group.NodeSpec`. Pure data:
imports nothing from Spark or torch, so the executor side may import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spark_torch.settings import Settings

__all__ = [
    "LaunchPlan",
    "GpuFallback",
    "ChannelSpec",
    "StagedCache",
    "DataSpec",
    "StorageSpec",
    "RunSpec",
    "FILE_ARGUMENT",
    "file_argument",
]


@dataclass(frozen=True)
class GpuFallback:
    """Why a run with ``use_gpu=None`` trains on CPU although the driver machine has GPUs: it has
    fewer than the run has ranks (a one-GPU laptop running two ranks). ``str()`` is the driver's
    warning.

    Attributes:
        ranks: the run's ranks (``num_processes``).
        gpus: the GPUs of the machine (their ``CUDA_VISIBLE_DEVICES`` ids), fewer than ``ranks``.
    """

    ranks: int
    gpus: tuple[str, ...]

    def __str__(self) -> str:
        found = len(self.gpus)
        return (
            f"spark_torch: {self.ranks} ranks but this machine has {found} GPU(s) ({', '.join(self.gpus)}): "
            f"training on CPU. Pass num_processes<={found} to train on the GPUs, use_gpu=True to make this an "
            "error, or use_gpu=False to silence this"
        )


@dataclass(frozen=True)
class LaunchPlan:
    """How a run is laid out (what :meth:`spark_torch.Distributor.plan` returns): nodes (Spark
    barrier tasks; the driver in local mode), ranks per node, devices.

    Attributes:
        local_mode: all ranks on the driver machine.
        num_nodes: Spark barrier tasks (1 in local mode).
        procs_per_node: ranks per node; ``world_size`` is ``num_nodes * procs_per_node``.
        use_gpu: whether the ranks use GPUs (and NCCL).
    """

    local_mode: bool
    num_nodes: int
    procs_per_node: int
    use_gpu: bool
    #: GPUs of the driver machine when it runs the ranks, one per rank in rank order (local
    #: mode: every rank sees all of them; distributed mode on a local master: node k gets its
    #: slice). Empty when Spark assigns GPUs to tasks, or without GPUs.
    local_gpus: tuple[str, ...] = ()
    #: OMP/MKL threads per rank (Spark sets OMP_NUM_THREADS=1 for Python tasks); None: leave the
    #: inherited value (the user or the cluster chose it)
    threads_per_rank: int | None = 1
    #: why GPUs that exist are not used (``use_gpu=None`` with fewer GPUs than ranks), for the
    #: driver's log; None when they are used or there are none
    gpu_fallback: GpuFallback | None = None

    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return self.num_nodes * self.procs_per_node


@dataclass(frozen=True)
class ChannelSpec:
    """Where nodes reach the driver's channel, and the run's secret (never printed)."""

    host: str
    port: int
    secret: bytes = field(repr=False)
    #: a quiet connection sends a heartbeat this often; silence for 4 heartbeats drops it
    heartbeat: float = 2.0
    #: how long a node waits for the rendezvous through the channel before falling back to allGather
    rendezvous_timeout: float = 60.0

    @property
    def address(self) -> str:
        """``host:port`` (IPv6 in brackets), for messages."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class StagedCache:
    """``run_on_dataframe(..., reuse_staged=True)``: the kept shards of this attempt
    (:mod:`spark_torch.shared.staged_shards`). ``key``: the driver's digest of the DataFrame's plan,
    the columns and the layout; ``generation``: one staging of it; ``reuse``: the nodes take kept
    shards (their input is a placeholder row) instead of staging theirs from the input;
    ``root``: where they are kept (local mode: the driver's folder; None: the node's Spark local dir)."""

    key: str
    generation: str
    reuse: bool = False
    root: str | None = None


@dataclass(frozen=True)
class DataSpec:
    """``run_on_dataframe``: the columns arriving as each node's rows; ``explicit``: tuples, not
    dicts; ``cache``: the kept shards (``reuse_staged``), else None."""

    columns: tuple[str, ...]
    explicit: bool = False
    cache: StagedCache | None = None


@dataclass(frozen=True)
class StorageSpec:
    """Where report() keeps the run's checkpoints and metrics (the run's data is under
    ``base/run_id``), how to open it, and the marker token ranks check it by."""

    base: str
    #: written into the run's directory by the driver: a rank that cannot read it back is on a
    #: host that does not see the storage
    token: str = field(default="", repr=False)
    #: fsspec's keyword arguments (credentials: never printed, never in a rank's environment)
    options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    #: chosen by the user (``storage_path=``): every node must see it, or the run stops at the
    #: rendezvous; the default storage only fails a rank that uses it (report(checkpoint=...))
    required: bool = False


#: starts an argument that names a file of ``RunSpec.files`` (NUL never occurs in a real argument)
FILE_ARGUMENT = "\x00spark_torch_file:"


def file_argument(name: str) -> str:
    """The script argument that the nodes replace by the path of ``RunSpec.files[name]``."""
    return FILE_ARGUMENT + name


@dataclass(frozen=True)
class RunSpec:
    """A run as every node sees it, resolved once on the driver; each attempt gets its own copy
    (``dataclasses.replace``) with that attempt's size, restart count and resume point."""

    plan: LaunchPlan
    run_id: str
    #: the restarts within this ``run()`` call before this attempt (0 for the call's first): the
    #: ranks' ``TORCHELASTIC_RESTART_COUNT``/``SPARK_TORCH_RESTART_COUNT``. Not the attempt's index
    #: in the run's history, which counts on across calls that resume a run_id
    #: (``AttemptRecord.attempt``; the driver's ``Attempt.attempt``)
    restart_count: int = 0
    max_restarts: int = 0
    #: function mode: cloudpickled ``(fn, args, kwargs)``
    payload: bytes | None = field(default=None, repr=False)
    #: script mode: absolute path and arguments
    script: str | None = None
    script_argv: tuple[str, ...] = ()
    #: files every node writes into its scratch directory before the ranks start (name -> content);
    #: an argument ``file_argument(name)`` of ``script_argv`` becomes that file's path there
    files: Mapping[str, bytes] = field(default_factory=dict, repr=False)
    #: the user's extra variables for every rank
    extra_env: Mapping[str, str] = field(default_factory=dict)
    #: the driver's working directory (ranks start there when it exists on their host)
    cwd: str | None = None
    #: the driver's Python version (``platform.python_version()``)
    driver_python: str = ""
    #: the driver's spark_torch (:func:`spark_torch.version.package_identity`): every node runs the same
    driver_package: str = ""
    data: DataSpec | None = None
    channel: ChannelSpec | None = None
    #: distributed mode: a directory of the driver's for rank 0's result (handed over by file
    #: when node 0 can write it: same host or shared filesystem)
    result_dir: str | None = None
    #: written by the driver into ``result_dir``: node 0 hands the result over only into a
    #: directory that holds it (and is private to this user)
    result_token: str = field(default="", repr=False)
    #: the user's settings, resolved once on the driver (:mod:`spark_torch.settings`)
    settings: Settings = field(default_factory=Settings.defaults)
    #: report()/checkpoints: the run's storage, and the checkpoint this attempt resumes from
    storage: StorageSpec | None = None
    resume_step: int = 0
    resume_url: str | None = None
    #: replica groups in distributed mode: what the node's relay to the lighthouse proves to the
    #: driver's gate (``spark_torch.ft.node_relay``; empty: no relay); never printed
    lighthouse_secret: bytes = field(default=b"", repr=False)

    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return self.plan.world_size
