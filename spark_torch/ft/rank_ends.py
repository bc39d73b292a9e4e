"""The driver hears at once that a replica group's rank ended (:func:`rank_ended`).

A node knows the moment one of its ranks ends (it waits on their processes) and tells the
driver at once: in local mode the node runner is a thread of the driver
(``LocalIO.rank_failed``), in distributed mode its first failure comes over the run's channel
before anything else. Each replica group's runs have a run id of their own (``RUN_ID-gN``);
while a run with replica groups goes, :func:`listening` maps each group's run id to what
retires the group on the lighthouse (:meth:`~spark_torch.ft.lighthouse.Lighthouse.retire`), and
those two places call :func:`rank_ended` with their run's id. A run without replica groups
has no listener: the call does nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

__all__ = ["listening", "rank_ended"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_listeners: dict[str, Callable[[], None]] = {}


@contextmanager
def listening(listeners: Mapping[str, Callable[[], None]]) -> Iterator[None]:
    """While the block runs, :func:`rank_ended` with one of ``listeners``' run ids calls its listener."""
    with _lock:
        _listeners.update(listeners)
    try:
        yield
    finally:
        with _lock:
            for run_id in listeners:
                _listeners.pop(run_id, None)


def rank_ended(run_id: str) -> None:
    """A rank of the run ``run_id`` ended (failed, or its node stops the others): tell its
    listener, if any (never raises: the caller is about a failure of its own)."""
    with _lock:
        listener = _listeners.get(run_id)
    if listener is None:
        return
    try:
        listener()
    except Exception as exc:  # noqa: BLE001 - the lighthouse's own timeout still drops the group
        logger.warning("spark_torch: could not tell the lighthouse that a rank of %s ended: %s", run_id, exc)
