"""The run's storage as one ``run()`` call uses it: created and marked when the call starts
(:func:`open_storage`), the checkpoint each attempt resumes from (:func:`newest_checkpoint`), each
attempt's end and the call's end in the run's log (:func:`record_attempt_end`, :func:`run_outcome`:
the call's end taken from its last attempt's outcome), and the default storage's retention
(:func:`prune_default`)."""

from __future__ import annotations

import logging
import time

from spark_torch.driver.attempts import END_RULES
from spark_torch.driver.config import DistributorConfig
from spark_torch.driver.result import AttemptEnd, AttemptRecord
from spark_torch.driver.run.outcome import AttemptOutcome, Interrupted
from spark_torch.errors import ConfigurationError
from spark_torch.reporting.ranking import CheckpointInfo
from spark_torch.reporting.run_log import Outcome, attempt_row, prune_unreported
from spark_torch.reporting.run_log import record as log_call
from spark_torch.reporting.storage import DEFAULT_STORAGE, RunStorage, storage_error

__all__ = ["open_storage", "prune_default", "newest_checkpoint", "record_attempt_end", "run_outcome"]

logger = logging.getLogger(__name__)


def open_storage(config: DistributorConfig, run_id: str, token: str) -> RunStorage | None:
    """The run's storage, created and marked now; without an explicit ``storage_path`` a
    default that cannot be created only disables checkpoints (with a warning). Whatever an fsspec
    backend raises becomes one ConfigurationError naming the URL; a local run folder that is
    refused (a link, another user's: :mod:`~spark_torch.reporting.local_files`) is one with
    either storage."""
    storage = RunStorage(config.storage_path or DEFAULT_STORAGE, run_id, config.storage_options)
    try:
        storage.create(token)
    except ConfigurationError:
        raise  # a run folder refused (a link, another user's): says which and what to do, default storage too
    except Exception as exc:  # noqa: BLE001 - every backend raises its own kinds (TypeError, botocore's...)
        if config.storage_path is not None:
            raise ConfigurationError(
                f"storage_path={config.storage_path!r}: cannot create the run's directory; "
                f"{storage_error(storage.url, exc)}"
            ) from exc
        logger.warning(
            "spark_torch: checkpoints are disabled: the default storage %s cannot be created (%s); "
            "pass storage_path= to use report(checkpoint=...)",
            storage.url,
            exc,
        )
        return None
    return storage


def prune_default(storage: RunStorage) -> None:
    """Retention of the default storage (:data:`~spark_torch.reporting.run_log.KEEP_UNREPORTED_RUNS`)."""
    try:
        prune_unreported(storage.base, storage.options, spare=storage.run_id)
    except Exception as exc:  # noqa: BLE001 - the run's own outcome matters more than old runs
        logger.warning("spark_torch: could not remove old runs that reported nothing from %s: %s", storage.base, exc)


def newest_checkpoint(storage: RunStorage, peer_runs: tuple[str, ...]) -> CheckpointInfo | None:
    """The checkpoint an attempt resumes from: the newest complete one of this run and of its
    ``peer_runs`` (a replica group's: the other groups', in the same storage), this run's on a tie.
    A peer whose storage cannot be read is left out (its checkpoints are its own group's to resume)."""
    found = [storage.latest()]
    for peer in peer_runs:
        try:
            found.append(RunStorage(storage.base, peer, storage.options).latest())
        except Exception as exc:  # noqa: BLE001 - this run's own checkpoint still serves
            logger.warning(
                "spark_torch: the checkpoints of %s could not be read: %s", peer, storage_error(storage.base, exc)
            )
    complete = [checkpoint for checkpoint in found if checkpoint is not None]
    return max(complete, key=lambda checkpoint: checkpoint.step) if complete else None  # max keeps the first of equals


def record_attempt_end(storage: RunStorage | None, attempt: AttemptRecord) -> None:
    """Add the attempt's end to the run's log (``spark-torch runs show``)."""
    error = (attempt.error.type_name, attempt.error.first_line) if attempt.error is not None else None
    end = str(attempt.end) if attempt.end is not None else "?"
    row = attempt_row(
        attempt.attempt,
        attempt.world_size,
        attempt.nodes,
        str(attempt.reason),
        end,
        error,
        attempt.size_note,
        time.time(),
    )
    log_call(storage, {**row, "detail": str(attempt.grow)} if attempt.grow is not None else row)


def run_outcome(error: BaseException | None, last: AttemptOutcome | None) -> Outcome:
    """How the call ended: from the outcome of its last attempt when that attempt's end is what
    the call raised; an error raised outside an attempt's end (before the first attempt, between
    two, or rank 0's value that does not unpickle) is a failure, or an interrupt (Ctrl-C)."""
    if error is None:
        return Outcome.SUCCEEDED
    if last is None or last.end is AttemptEnd.SUCCEEDED:
        return Outcome.INTERRUPTED if isinstance(error, KeyboardInterrupt) else Outcome.FAILED
    if isinstance(last.cause, Interrupted) and not isinstance(last.cause.interrupt, KeyboardInterrupt):
        return Outcome.FAILED  # stopped because another replica group failed the run
    return END_RULES[last.end].call
