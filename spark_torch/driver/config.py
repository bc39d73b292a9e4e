"""Validated, immutable options of a :class:`~spark_torch.Distributor`."""

from __future__ import annotations

import json
import numbers
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from spark_torch import settings
from spark_torch.base.envnames import RESERVED
from spark_torch.errors import ConfigurationError
from spark_torch.ft.env import NAMES as REPLICA_GROUP_NAMES
from spark_torch.ft.lighthouse import LighthouseOptions

__all__ = ["DistributorConfig", "LogRanks"]

LogRanks = Literal["all"] | frozenset[int] | None
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int (numpy integers too), or TypeError/ConfigurationError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {minimum}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ConfigurationError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _plain(value: Any) -> bool:
    """Whether ``value`` survives JSON (how the options reach the ranks)."""
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _normalise_log_ranks(value: Any) -> LogRanks:
    if value is None or value == "all":
        return "all"
    if value == "none" or value == [] or value == ():
        return frozenset()
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        ranks = list(value)
        if all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks):
            return frozenset(ranks)
    raise ConfigurationError(f"log_ranks must be 'all', None (all), or a list of rank numbers like [0], got {value!r}")


@dataclass(frozen=True)
class DistributorConfig:
    """Everything a user chose, checked once. Errors name the field, the value and the rule."""

    num_processes: int = 1
    local_mode: bool = True
    use_gpu: bool | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    timeout: float | None = None
    log_ranks: Any = "all"
    log_dir: str | None = None
    max_restarts: int = 0
    ranks_per_task: int | None = None
    progress: bool | None = None
    storage_path: str | None = None
    run_id: str | None = None
    keep_checkpoints: int | None = None
    mlflow: bool | None = None
    #: may hold credentials: never in the repr, and errors name its keys only
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    checkpoint_score_attribute: str | None = None
    checkpoint_score_order: str = "max"
    #: elastic membership: the fewest ranks a run goes on with (None: num_processes, a fixed size)
    min_processes: int | None = None
    #: an attempt below full size restarts larger at its next checkpoint once slots are free
    elastic_grow: bool = False
    #: per-step fault tolerance: this many torchft replica groups of num_processes / replica_groups ranks
    replica_groups: int = 1
    #: the lighthouse's quorum rules (replica_groups > 1; None: torchft's defaults)
    lighthouse_options: LighthouseOptions | None = None
    #: a replica group's run (set by the group layer, not by users): the other groups' run ids, in
    #: the same storage; an attempt resumes from the newest checkpoint of its own run and theirs
    peer_runs: tuple[str, ...] = ()
    #: a replica group's run in local mode (set by the group layer, not by users): the ranks of
    #: every group, which share the driver's cores (None: ``num_processes``)
    host_ranks: int | None = None
    #: a replica group's run in distributed mode (set by the group layer, not by users): what the
    #: nodes' relays prove to the lighthouse's gate (spark_torch.ft.node_relay); never printed
    lighthouse_secret: bytes = field(default=b"", repr=False)
    # the settings of spark_torch.settings.SETTINGS given as keywords (None: environment, Spark conf, default)
    channel_host: Any = None
    channel_bind_address: Any = None
    channel_ports: Any = None
    rendezvous_timeout: Any = None
    heartbeat: Any = None
    result_transfer: Any = None
    executor_wait: Any = None
    warm_start: Any = None
    warm_start_idle: Any = None
    ship_package: Any = None
    elastic_wait: Any = None
    stall_timeout: Any = None
    stall_action: Any = None
    stall_all_threads: Any = None
    stall_source_lines: Any = None
    spark_logs: Any = None

    def __post_init__(self) -> None:
        self._check_reporting()
        for setting in settings.SETTINGS:
            object.__setattr__(self, setting.name, settings.check_value(setting.name, getattr(self, setting.name)))
        object.__setattr__(self, "num_processes", _check_int("num_processes", self.num_processes, 1))
        object.__setattr__(self, "max_restarts", _check_int("max_restarts", self.max_restarts, -1))
        if self.progress is not None and not isinstance(self.progress, bool):
            raise TypeError(f"progress must be True, False or None (auto), got {self.progress!r}")
        if self.min_processes is not None:
            object.__setattr__(self, "min_processes", _check_int("min_processes", self.min_processes, 1))
            if self.min_processes > self.num_processes:
                raise ConfigurationError(
                    f"min_processes={self.min_processes} is more than num_processes={self.num_processes}; "
                    "min_processes is the fewest ranks the run may go on with"
                )
            if self.local_mode and self.min_processes != self.num_processes:
                raise ConfigurationError(
                    "min_processes applies to distributed mode (local_mode=False): in local mode every rank runs "
                    "on the driver, whose size does not change"
                )
        if not isinstance(self.elastic_grow, bool):
            raise TypeError(f"elastic_grow must be True or False, got {self.elastic_grow!r}")
        if self.ranks_per_task is not None:
            object.__setattr__(self, "ranks_per_task", _check_int("ranks_per_task", self.ranks_per_task, 1))
            if self.local_mode:
                raise ConfigurationError(
                    "ranks_per_task applies to distributed mode (local_mode=False); in local mode "
                    "every rank runs on the driver"
                )
            if self.num_processes % self.ranks_per_task:
                raise ConfigurationError(
                    f"num_processes={self.num_processes} is not a multiple of ranks_per_task="
                    f"{self.ranks_per_task}: every barrier task (node) runs the same number of ranks"
                )
        if not isinstance(self.local_mode, bool):
            raise TypeError(f"local_mode must be True or False, got {self.local_mode!r}")
        if self.use_gpu is not None and not isinstance(self.use_gpu, bool):
            raise TypeError(f"use_gpu must be True, False or None (auto), got {self.use_gpu!r}")
        if not isinstance(self.env, Mapping):
            raise TypeError(f"env must be a dict of str to str, got {type(self.env).__name__}")
        env: dict[str, str] = {}
        for key, value in self.env.items():
            if not isinstance(key, str) or not key or "=" in key:
                raise ConfigurationError(f"env has an invalid variable name {key!r}")
            if key in RESERVED:
                raise ConfigurationError(
                    f"env may not set {key}: spark_torch sets it for every rank "
                    f"(reserved: {', '.join(sorted(RESERVED))})"
                )
            env[key] = str(value)
        object.__setattr__(self, "env", env)
        if self.timeout is not None:
            if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)):
                raise TypeError(f"timeout must be a number of seconds or None, got {self.timeout!r}")
            if not self.timeout > 0:
                raise ConfigurationError(f"timeout must be > 0 seconds, got {self.timeout}")
        object.__setattr__(self, "log_ranks", _normalise_log_ranks(self.log_ranks))
        if self.log_dir is not None:
            object.__setattr__(self, "log_dir", os.path.abspath(os.fspath(self.log_dir)))
        self._check_replica_groups()

    def _check_replica_groups(self) -> None:
        groups = _check_int("replica_groups", self.replica_groups, 1)
        object.__setattr__(self, "replica_groups", groups)
        if self.lighthouse_options is not None and not isinstance(self.lighthouse_options, LighthouseOptions):
            raise TypeError(
                "lighthouse_options must be a spark_torch.ft.lighthouse.LighthouseOptions or None, got "
                f"{self.lighthouse_options!r}"
            )
        if groups == 1:
            return
        if self.num_processes % groups:
            raise ConfigurationError(
                f"num_processes={self.num_processes} is not a multiple of replica_groups={groups}: every replica group "
                f"runs the same number of ranks; choose num_processes = replica_groups x ranks per group "
                f"(e.g. num_processes={groups * max(1, self.num_processes // groups)})"
            )
        if self.ranks_per_task is not None and (self.num_processes // groups) % self.ranks_per_task:
            raise ConfigurationError(
                f"replica_groups={groups} gives groups of {self.num_processes // groups} ranks, not a multiple of "
                f"ranks_per_task={self.ranks_per_task}: a replica group is whole nodes (barrier tasks)"
            )
        if self.min_processes is not None and self.min_processes != self.num_processes:
            raise ConfigurationError(
                f"min_processes does not apply with replica_groups={groups}: a lost group restarts alone and rejoins "
                "(docs/fault-tolerance.md); leave min_processes unset"
            )
        if self.elastic_grow:
            raise ConfigurationError(f"elastic_grow does not apply with replica_groups={groups}: leave it False")
        clash = sorted(REPLICA_GROUP_NAMES & set(self.env))
        if clash:
            raise ConfigurationError(
                f"env may not set {', '.join(clash)} with replica_groups={groups}: spark_torch sets them for every rank"
            )
        if self.run_id is not None and len(self.run_id) > 60:
            raise ConfigurationError(
                f"run_id {self.run_id!r} is {len(self.run_id)} characters; with replica_groups each group's run is "
                "named run_id-gN, so run_id may have at most 60"
            )

    def _check_reporting(self) -> None:
        if self.storage_path is not None:
            if not isinstance(self.storage_path, (str, os.PathLike)) or not os.fspath(self.storage_path):
                raise TypeError(f"storage_path must be a directory or an fsspec URL, got {self.storage_path!r}")
            object.__setattr__(self, "storage_path", os.fspath(self.storage_path))
        if self.run_id is not None and (not isinstance(self.run_id, str) or not _RUN_ID.fullmatch(self.run_id)):
            raise ConfigurationError(
                f"run_id must be 1-64 letters, digits, '.', '_' or '-' (it names a directory), got {self.run_id!r}"
            )
        if self.keep_checkpoints is not None:
            object.__setattr__(self, "keep_checkpoints", _check_int("keep_checkpoints", self.keep_checkpoints, 1))
        # the options may hold credentials: the errors name their type and keys, never a value
        if not isinstance(self.storage_options, Mapping) or not all(isinstance(k, str) for k in self.storage_options):
            raise TypeError(
                f"storage_options must be a dict of fsspec keyword arguments with string keys, got a "
                f"{type(self.storage_options).__name__}"
            )
        unplain = [k for k, v in self.storage_options.items() if not _plain(v)]
        if unplain:  # ranks on other hosts open the storage with them
            raise TypeError(
                f"storage_options {unplain} must hold plain values (strings, numbers, lists, dicts): the ranks "
                "open the storage with them on their own hosts"
            )
        object.__setattr__(self, "storage_options", dict(self.storage_options))
        if self.checkpoint_score_attribute is not None and (
            not isinstance(self.checkpoint_score_attribute, str) or not self.checkpoint_score_attribute
        ):
            raise TypeError(
                f"checkpoint_score_attribute must be a metric name, got {self.checkpoint_score_attribute!r}"
            )
        if self.checkpoint_score_order not in ("max", "min"):
            raise ConfigurationError(
                f"checkpoint_score_order must be 'max' or 'min', got {self.checkpoint_score_order!r}"
            )
        if self.mlflow is not None and not isinstance(self.mlflow, bool):
            raise TypeError(
                f"mlflow must be True, False or None (on when an MLflow run is active), got {self.mlflow!r}"
            )

    def given_settings(self) -> dict[str, Any]:
        """The settings given as keywords (see :func:`spark_torch.settings.resolve`)."""
        return {s.name: getattr(self, s.name) for s in settings.SETTINGS}

    def shows_rank(self, rank: int) -> bool:
        """Whether the driver prints this rank's output."""
        return self.log_ranks == "all" or rank in self.log_ranks
