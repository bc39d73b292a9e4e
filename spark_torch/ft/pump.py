"""Heartbeats the lighthouse gets for the replica groups whose ranks still live (:class:`Pump`).

torchft's lighthouse counts a replica as alive while heartbeats for its replica id keep coming,
and a quorum waits for every replica it counts as alive. Each group's rank 0 heartbeats from its
torchft Manager (every 100 ms), but those heartbeats cross the node's relay, the driver's gate
and the hideout's relay (Python threads in busy processes) and can arrive late on a loaded
machine: a short heartbeat timeout would then drop a slow but healthy group. Who knows whether a
group's ranks live is the node that waits on their processes, and through it the driver.

So a pump next to the lighthouse (a thread in the lighthouse's own process,
:mod:`spark_torch.ft.hideout`, with a GIL of its own) heartbeats, every :data:`PUMP_SECONDS`,
every replica id it has seen heartbeating on the lighthouse (its status page, read every
:data:`DISCOVER_EVERY` beats) until the driver
retires that id's group (:meth:`Pump.retire`: a rank of the group ended, or its attempt did):
from then on only the dead Manager's own heartbeats could keep it, and they stopped with it, so
the lighthouse drops it after its short heartbeat timeout. A replica id's group is its trailing
digits before torchft's ``:UUID`` (``spark_torch_group_1:...``, ``train_ddp_1:...``); an id
without them is not vouched for. An id is vouched for until its group is retired, or a newer id
of the same group appears (a restarted group's Manager, or a second Manager of the same group).
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import re
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["Pump", "PUMP_SECONDS", "group_of", "replica_ids"]

logger = logging.getLogger(__name__)

#: how often the pump heartbeats each replica it vouches for (and reads the status page)
PUMP_SECONDS = 0.05
#: the status page is read every this many heartbeats (a new Manager heartbeats itself meanwhile;
#: a retire reads it at once)
DISCOVER_EVERY = 2
#: how long one heartbeat or one read of the status page may take
CALL_SECONDS = 2.0
#: a heartbeat as torchft 0.2.0's status page lists it: ``REPLICA_ID: seen 0.004s ago``
_HEARTBEAT = re.compile(r"^\s*(\S+): seen \S+ ago\s*$", re.MULTILINE)
_GROUP = re.compile(r"(\d+)$")


def replica_ids(status_page: str) -> list[str]:
    """The replica ids on the lighthouse's status page, as listed (with torchft's ``:UUID``)."""
    return [match.group(1) for match in _HEARTBEAT.finditer(status_page)]


def group_of(replica_id: str) -> int | None:
    """The replica group of a replica id: the trailing digits of its name before torchft's
    ``:UUID`` suffix (None: no digits there)."""
    match = _GROUP.search(replica_id.split(":", 1)[0])
    return int(match.group(1)) if match else None


class Pump:
    """Vouches for the live replica groups on the lighthouse at ``127.0.0.1:port`` (see the
    module's docstring) from a thread of its own, until :meth:`close` (idempotent).
    ``heartbeat(replica_id)`` sends one heartbeat (default: torchft's ``LighthouseClient`` from
    ``core``, its compiled module); ``status()`` returns the status page (default: ``GET /status``)."""

    def __init__(
        self,
        port: int,
        core: Any = None,
        heartbeat: Callable[[str], None] | None = None,
        status: Callable[[], str] | None = None,
        interval: float = PUMP_SECONDS,
    ) -> None:
        self._port = port
        if heartbeat is None:
            client = core.LighthouseClient(f"http://127.0.0.1:{port}", timedelta(seconds=CALL_SECONDS))
            heartbeat = lambda replica_id: client.heartbeat(replica_id, timedelta(seconds=CALL_SECONDS))  # noqa: E731
        self._heartbeat = heartbeat
        self._status = status or self._read_status
        self._interval = interval
        self._lock = threading.Lock()
        #: replica id -> group, for the ids vouched for now
        self._vouched: dict[str, int] = {}
        #: every id seen (vouched for, retired or superseded): never vouched for again once dropped
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._failures = 0
        self._thread = threading.Thread(target=self._run, name="spark-torch-lighthouse-pump", daemon=True)
        self._thread.start()

    @property
    def vouched(self) -> dict[str, int]:
        """The replica ids vouched for now, each with its group."""
        with self._lock:
            return dict(self._vouched)

    def _read_status(self) -> str:
        connection = http.client.HTTPConnection("127.0.0.1", self._port, timeout=CALL_SECONDS)
        try:
            connection.request("GET", "/status")
            response = connection.getresponse()
            return response.read().decode("utf-8", "replace") if response.status == 200 else ""
        finally:
            connection.close()

    def _discover(self, retiring: int | None = None) -> None:
        """Read the status page: adopt each id not seen before (a newer id of a group supersedes
        the one vouched for); with ``retiring``, every id of that group is dropped instead."""
        page = ""
        with contextlib.suppress(OSError, http.client.HTTPException):
            page = self._status()
        with self._lock:
            for replica_id in replica_ids(page):
                group = group_of(replica_id)
                if replica_id in self._seen or group is None:
                    continue
                self._seen.add(replica_id)
                if group == retiring:
                    continue
                for old in [old for old, g in self._vouched.items() if g == group]:
                    del self._vouched[old]
                self._vouched[replica_id] = group
            if retiring is not None:
                for old in [old for old, g in self._vouched.items() if g == retiring]:
                    del self._vouched[old]

    def retire(self, group: int) -> None:
        """Group ``group``'s ranks ended (or are ending): stop vouching for every replica id of
        it seen so far, at once; an id of it that appears later (its restart) is vouched for."""
        with self._lock:
            for old in [old for old, g in self._vouched.items() if g == group]:
                del self._vouched[old]
        self._discover(retiring=group)  # an id the pump had not read yet is the dead one's too

    def _run(self) -> None:
        ticks = 0
        while not self._stop.wait(self._interval):
            if ticks % DISCOVER_EVERY == 0:
                self._discover()
            ticks += 1
            for replica_id in self.vouched:
                with self._lock:
                    retired = replica_id not in self._vouched
                if self._stop.is_set():
                    return
                if retired:
                    continue
                try:
                    self._heartbeat(replica_id)
                except Exception as exc:  # noqa: BLE001 - a missed beat; the lighthouse may be stopping
                    self._failures += 1
                    if self._failures == 1:
                        logger.warning("spark_torch: a heartbeat for %s failed: %s", replica_id, exc)

    def close(self) -> None:
        """Stop heartbeating (idempotent)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * CALL_SECONDS)
