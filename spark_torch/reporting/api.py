"""Inside a rank: report metrics and checkpoints as training goes, and resume from the latest.

::

    import spark_torch

    def train():
        start = 0
        checkpoint = spark_torch.get_checkpoint()     # None on a fresh start
        if checkpoint is not None:
            with checkpoint.as_directory() as directory:  # or checkpoint / "state.pt"
                state = torch.load(os.path.join(directory, "state.pt"))
            model.load_state_dict(state["model"]); start = state["epoch"] + 1
        for epoch in range(start, 10):
            ...
            with tempfile.TemporaryDirectory() as tmp:
                if dist.get_rank() == 0:
                    torch.save({"model": model.state_dict(), "epoch": epoch}, f"{tmp}/state.pt")
                spark_torch.report({"loss": loss, "epoch": epoch}, checkpoint=tmp)

:func:`report` is a collective: every rank calls it the same number of times, in the same
order. It returns on every rank only once rank 0's metrics are recorded and the checkpoint
(the files every rank passed, merged into one directory) is persisted in the run's storage, so
a rank that dies right after ``report()`` has lost nothing. Works in function and script mode,
local and distributed mode. This module imports neither torch nor pyspark.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import threading
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

from spark_torch.base import envnames
from spark_torch.reporting import loader_positions
from spark_torch.shared.stacks import note_progress, working
from spark_torch.shared.workdir_files import StorageFile

if TYPE_CHECKING:
    from spark_torch.reporting.checkpoint import Checkpoint

__all__ = [
    "report",
    "get_checkpoint",
    "follow_steps",
    "MAX_METRICS_BYTES",
    "RECORDED_KEYS",
    "NOT_EVERY_RANK",
    "GROUP_KEY",
    "SKIPPED_KEY",
    "count_skipped",
]

#: the key of the replica group a row came from (runs with ``replica_groups``)
GROUP_KEY = "replica_group"

#: what spark_torch records with every step's metrics (not names a rank may report); the last,
#: ``replica_group``, only in runs with replica groups
RECORDED_KEYS = ("step", "time", "attempt", "world_size", GROUP_KEY)
#: the committed steps a replica group missed, in the rows of a DataFrame run with replica groups
#: (:mod:`spark_torch.ft.data_position`); refused as a metric name in every run, as the ones above
SKIPPED_KEY = "skipped_batches"

#: how the driver's answer begins when a rank ended without calling report() for a step
NOT_EVERY_RANK = "report() is a collective every rank must call"

#: bound on one step's metrics (they travel in one message to the driver, and into every row)
MAX_METRICS_BYTES = 64 * 1024


def get_checkpoint() -> Checkpoint | None:
    """The latest persisted checkpoint of this run, a :class:`~spark_torch.Checkpoint` of a local
    directory every rank can read; None on a fresh start. (It is the checkpoint this attempt of
    the run started from: after a restart, or a new ``run()`` with the same ``run_id``, the
    newest complete one.)

    As in Ray Train, ``with checkpoint.as_directory() as d:`` gives that directory; the
    checkpoint also works wherever a path does: ``checkpoint / "state.pt"`` (a ``pathlib.Path``),
    ``open(os.path.join(checkpoint, ...))``, ``os.fspath(checkpoint)``, ``str(checkpoint)``.
    """
    from spark_torch.reporting.checkpoint import Checkpoint

    path = os.environ.get(envnames.CHECKPOINT)
    if not path:
        return None
    return Checkpoint(path=path, step=int(os.environ.get(envnames.START_STEP, "0") or 0))


def _text(what: str, text: str) -> str:
    """``text`` if it can travel (valid Unicode: a lone surrogate cannot be encoded as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"report(): {what} is a string that is not valid Unicode ({exc.reason} at position {exc.start}); "
            "decode bytes with errors='replace' before reporting them"
        ) from None
    return text


def _number(key: str, value: Any) -> Any:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return _text(f"metric {key!r}", value)
    item = getattr(value, "item", None)  # a 0-d tensor or a numpy scalar
    if callable(item) and not isinstance(value, numbers.Number):
        try:
            value = item()
        except (ValueError, RuntimeError) as exc:
            raise TypeError(f"report(): metric {key!r} is not a single number ({exc})") from None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else repr(value)  # nan/inf survive as text
    raise TypeError(
        f"report(): metric {key!r} is a {type(value).__name__}; metrics are numbers, strings, "
        "booleans or None (use .item() on a tensor, or log arrays as files in the checkpoint)"
    )


def _clean(metrics: Any) -> dict[str, Any]:
    if not isinstance(metrics, dict):
        raise TypeError(f"report() takes a dict of metrics, got {type(metrics).__name__}")
    clean = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise TypeError(f"report(): metric names are strings, got {key!r}")
        _text(f"metric name {key!r}", key)
        if key in RECORDED_KEYS or key == SKIPPED_KEY:
            raise ValueError(f"report(): {key!r} is recorded by spark_torch; name your metric differently")
        clean[key] = _number(key, value)
    size = len(json.dumps(clean))
    if size > MAX_METRICS_BYTES:
        raise ValueError(
            f"report(): the metrics take {size} bytes as JSON, more than {MAX_METRICS_BYTES}; report a few "
            "numbers per step and write bigger things (arrays, text) as files into the checkpoint"
        )
    return clean


class _Reporter:
    """This rank's end of the report pipes (one per process)."""

    def __init__(self, fds: str) -> None:
        write_fd, read_fd = (int(x) for x in fds.split(","))
        self._out: IO[str] = os.fdopen(write_fd, "w", encoding="utf-8", closefd=False)
        self._in: IO[str] = os.fdopen(read_fd, "r", encoding="utf-8", closefd=False)
        self._lock = threading.Lock()
        self.rank = int(os.environ.get(envnames.RANK, "0"))
        self.step = int(os.environ.get(envnames.START_STEP, "0") or 0)
        group = os.environ.get(envnames.REPLICA_GROUP_ID, "")
        in_group = group.isdigit() and bool(os.environ.get(envnames.NUM_REPLICA_GROUPS))
        #: rank 0 of a replica group tags its rows with the group
        self.tags: dict[str, Any] = {GROUP_KEY: int(group)} if in_group and self.rank == 0 else {}
        self._storage: Any = None

    def storage(self) -> Any:
        if self._storage is None:
            from spark_torch.reporting.storage import RunStorage

            path = os.environ.get(envnames.STORAGE)
            if not path:
                raise RuntimeError(
                    "report(checkpoint=...): this run has no storage for checkpoints (the default "
                    "~/spark_torch_runs could not be created on the driver; see its warning): pass "
                    "storage_path= to the Distributor"
                )
            described = StorageFile.read(path)
            self._storage = RunStorage(described.spec().base, described.run_id, described.spec().options)
            if not self._storage.visible(described.token):
                host = os.uname().nodename
                raise RuntimeError(
                    f"report(checkpoint=...): the run's storage {self._storage.url} is not visible from "
                    f"{host}. Runs whose ranks are on several hosts need storage_path= on storage every "
                    "node can reach: a shared filesystem, or an fsspec URL such as s3://bucket/runs"
                )
        return self._storage

    def report(self, metrics: dict[str, Any], checkpoint: str | os.PathLike[str] | None) -> None:
        with self._lock:
            source = _step_source
            step = self.step + 1 if source is None else int(source())
            if step <= self.step:
                return  # torchft's step did not move on (the step was dropped): reported already, on every rank alike
            positions = loader_positions.current()  # kept with the step's checkpoint, whichever rank passed one
            if checkpoint is not None:
                with _local_directory(checkpoint) as directory, working():  # stall detection: uploading is progress
                    self.storage().upload(directory, step)
            message: dict[str, Any] = {
                "step": step,
                "metrics": {**metrics, **self.tags, **_skipped()} if self.rank == 0 else None,
                "checkpoint": checkpoint is not None,
            }
            if positions:
                message[loader_positions.KEY] = positions
            self._out.write(json.dumps(message) + "\n")
            self._out.flush()
            reply = self._answer_for(step)
            error = reply.get("error")
            if error and str(error).startswith(NOT_EVERY_RANK):
                raise RuntimeError(f"report(): step {step} cannot complete: {error}")
            if error:
                raise RuntimeError(f"report(): step {step} could not be persisted: {error}")
            self.step = step

    def _answer_for(self, step: int) -> dict[str, Any]:
        """The node's answer for ``step``; an answer for an earlier step (a replay) is skipped."""
        while True:
            line = self._in.readline()
            if not line:
                raise RuntimeError("report(): the node runner is gone (the run was stopped)")
            reply = json.loads(line)
            answered = reply.get("step") if isinstance(reply, dict) else None
            if isinstance(answered, int) and answered < step:
                continue
            if answered != step:
                raise RuntimeError(
                    f"report(): step {step} got the answer of step {answered!r}; report() calls are out of step"
                )
            return dict(reply)


def _local_directory(checkpoint: str | os.PathLike[str]) -> contextlib.AbstractContextManager[str]:
    """The local directory of ``checkpoint``: a path as it is; a :class:`Checkpoint` through
    ``as_directory()`` (a remote one is downloaded for the upload, then removed)."""
    from spark_torch.reporting.checkpoint import Checkpoint

    if isinstance(checkpoint, Checkpoint):
        return checkpoint.as_directory()
    return contextlib.nullcontext(os.fspath(checkpoint))


_reporter: _Reporter | None = None
_reporter_lock = threading.Lock()
#: where report() takes its step from instead of counting its calls (torchft's committed step)
_step_source: Callable[[], int] | None = None
#: the committed steps this rank's replica group missed, for its rows (:func:`count_skipped`)
_skipped_source: Callable[[], int] | None = None


def follow_steps(source: Callable[[], int] | None) -> None:
    """From now on :func:`report` records the step ``source()`` returns (:func:`spark_torch.ft.manager`
    passes its Manager's ``current_step``) instead of counting its calls, and skips a call whose
    step is not past the last one reported, so no step is reported twice: a step torchft dropped,
    or a replica group restarted and healed from a peer, repeats none. ``None``: count again."""
    global _step_source
    _step_source = source


def count_skipped(source: Callable[[], int] | None) -> None:
    """From now on rank 0's rows carry ``skipped_batches``: ``source()``, the committed steps this
    rank's replica group missed (:mod:`spark_torch.ft.data_position`). ``None``: no longer."""
    global _skipped_source
    _skipped_source = source


def _skipped() -> dict[str, int]:
    source = _skipped_source
    return {SKIPPED_KEY: int(source())} if source is not None else {}


def report(metrics: dict[str, Any], *, checkpoint: str | os.PathLike[str] | None = None) -> None:
    """Record ``metrics`` (rank 0's are kept, with a ``step``) and persist ``checkpoint``.

    A collective: every rank calls it the same number of times. ``checkpoint`` is a local
    directory this rank wrote, as a path or a :class:`~spark_torch.Checkpoint`
    (``Checkpoint.from_directory(d)``, as in Ray Train). Any rank may pass one: sharded saves,
    where each rank writes its own files, merge into one checkpoint; files with the same name:
    the last writer wins.
    Returns once everything is persisted on every rank. Metric values are numbers, strings,
    booleans or None (0-d tensors and numpy scalars are converted). In a replica group whose
    Manager :func:`spark_torch.ft.manager` made, the step is torchft's committed step and a call
    at a step already reported is skipped (:func:`follow_steps`); the row names the group.

    Raises:
        RuntimeError: outside a rank started by spark_torch, when persisting failed, or when a
            rank ended without calling it for this step (the message names the ranks).
        TypeError: a metric that is not a single value.
        ValueError: a metric name or string that is not valid Unicode; metrics over
            :data:`MAX_METRICS_BYTES`; a name spark_torch records itself (:data:`RECORDED_KEYS`:
            step, time, attempt, world_size, replica_group; and ``skipped_batches``, which a
            DataFrame run with replica groups records: :func:`count_skipped`).
    """
    global _reporter
    clean = _clean(metrics)
    with _reporter_lock:
        if _reporter is None:
            fds = os.environ.get(envnames.REPORT_FDS)
            if not fds:
                raise RuntimeError(
                    "spark_torch.report() works inside ranks started by spark_torch "
                    "(Distributor.run or spark-torch run)"
                )
            _reporter = _Reporter(fds)
        reporter = _reporter
    note_progress()  # stall detection: a rank that reports makes progress
    reporter.report(clean, checkpoint)
    note_progress()
