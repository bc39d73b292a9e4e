"""Which replica groups created a torchft Manager, as the run's lighthouse saw them
(:class:`ManagerWatch`).

A function that never creates a Manager runs ``replica_groups`` copies that never sync: no
error, no quorum. Every torchft Manager heartbeats to the lighthouse from its creation on, under
its replica id (``spark_torch_group_N:UUID`` when :func:`spark_torch.ft.manager` made it), and
the lighthouse lists the heartbeats on its status page (``GET /status``, HTML, on the port it
listens on). The driver reads that page while the groups run, from its own machine (over plain
HTTP, never through a proxy), and the run warns about the groups never seen there.
"""

from __future__ import annotations

import contextlib
import http.client
import re
import threading

from spark_torch.ft.rank import replica_id

__all__ = ["ManagerWatch", "heartbeating", "POLL_SECONDS"]

#: how often the status page is read until every group was seen there
POLL_SECONDS = 0.5
#: a heartbeat as torchft 0.2.0's status page lists it: ``REPLICA_ID: seen 0.004s ago``
_HEARTBEAT = re.compile(r"^\s*(\S+): seen \S+ ago\s*$", re.MULTILINE)


def heartbeating(status_page: str) -> set[str]:
    """The replica ids on the lighthouse's status page, without torchft's ``:UUID`` suffix."""
    return {match.group(1).split(":", 1)[0] for match in _HEARTBEAT.finditer(status_page)}


class ManagerWatch:
    """Reads the lighthouse's status page at ``host:port`` every :data:`POLL_SECONDS` from
    :meth:`start` until every one of ``groups`` groups was seen there or :meth:`stop`."""

    def __init__(self, host: str, port: int, groups: int) -> None:
        self._host, self._port = host, port
        self._groups = {replica_id(group): group for group in range(groups)}
        self._lock = threading.Lock()
        self._seen: set[int] = set()
        #: a replica id that is not one of spark_torch's: the user made the Manager with their own
        self._foreign = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spark-torch-manager-watch", daemon=True)

    def start(self) -> ManagerWatch:
        self._thread.start()
        return self

    def _done(self) -> bool:
        with self._lock:
            return self._foreign or len(self._seen) == len(self._groups)

    def _poll(self) -> None:
        """One read of the status page; a lighthouse that does not answer is not an error."""
        connection = http.client.HTTPConnection(self._host, self._port, timeout=2.0)
        page = ""
        with contextlib.suppress(OSError, http.client.HTTPException):
            connection.request("GET", "/status")
            response = connection.getresponse()
            if response.status == 200:
                page = response.read().decode("utf-8", "replace")
        connection.close()
        ids = heartbeating(page)
        with self._lock:
            self._seen.update(self._groups[name] for name in ids if name in self._groups)
            self._foreign = self._foreign or any(name not in self._groups for name in ids)

    def _run(self) -> None:
        while not self._done() and not self._stop.wait(POLL_SECONDS):
            self._poll()

    def stop(self) -> list[int]:
        """Stop reading (one last read while the lighthouse still runs); the groups never seen
        (none when a Manager under the user's own replica id was)."""
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=5.0)
        if not self._done():
            self._poll()
        with self._lock:
            return [] if self._foreign else sorted(set(self._groups.values()) - self._seen)
