"""The run's rendezvous store, hosted before the ranks start (as torchrun's agent does).

``python -m spark_torch.node.store_host_main PORT WORLD_SIZE HOST`` (forked from the warm-start
template, so torch is already imported, or started cold) starts torch's ``TCPStore`` server on
``HOST:PORT``, writes ``ready`` to its stdout and waits until it is stopped. The store (no
authentication) listens on the node's own address only (loopback in local mode), never on every
interface as torch's own server does: it binds and listens itself and hands torch the
socket (``master_listen_fd``). Ranks then run with
``TORCHELASTIC_USE_AGENT_STORE=True``: ``init_process_group`` connects every rank, rank 0
included, as a client of this store.

Why: when rank 0 hosts the store itself (the default without an agent), a rank that calls
``init_process_group`` even a few milliseconds before rank 0 gets "connection refused" and
torch's client retries with a backoff: measured 0.3-0.75 s lost in such runs. A store that is
listening before any rank starts removes that race.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys

from spark_torch.base import envnames
from spark_torch.base.prctl import die_with_parent_thread
from spark_torch.shared.bound_store import host_store

__all__ = ["main"]


def _die_with_parent() -> None:
    """Started cold: die with the node runner (``SPARK_TORCH_PARENT_PID``), as a rank does."""
    parent = os.environ.get(envnames.PARENT_PID, "")
    die_with_parent_thread()
    if parent.isdigit() and os.getppid() != int(parent):
        os._exit(1)


def main(argv: list[str]) -> int:
    """Host the store on ``argv[2]:argv[0]`` for ``argv[1]`` ranks until SIGTERM/SIGKILL."""
    _die_with_parent()
    port, world_size, host = int(argv[0]), int(argv[1]), argv[2]
    store = host_store(host, port, world_size, datetime.timedelta(minutes=30))
    os.write(1, b"ready\n")
    while True:  # the node runner stops it (SIGTERM, its process group) once the ranks are gone
        signal.pause()
    del store  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
