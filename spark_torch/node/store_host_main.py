"""The run's rendezvous store, hosted before the ranks start (as torchrun's agent does).

``python -m spark_torch.node.store_host_main PORT WORLD_SIZE`` (forked from the warm-start template, so
torch is already imported) starts torch's ``TCPStore`` server on ``PORT``, writes ``ready`` to
its stdout and waits until it is stopped. Ranks then run with
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

__all__ = ["main"]


def main(argv: list[str]) -> int:
    """Host the store on port ``argv[0]`` for ``argv[1]`` ranks until SIGTERM/SIGKILL."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    port, world_size = int(argv[0]), int(argv[1])
    store = TCPStore(
        "127.0.0.1", port, world_size, True, timeout=datetime.timedelta(minutes=30), wait_for_workers=False
    )
    os.write(1, b"ready\n")
    while True:  # the node runner stops it (SIGTERM, its process group) once the ranks are gone
        signal.pause()
    del store  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
