"""Rank 0 hosts the run's rendezvous store on the node's own address, when node 0 did not host
it before the ranks started (warm starts off, or its store host was not ready in time: see
:mod:`spark_torch.node.store_host`).

torch's ``env://`` rendezvous would make rank 0 the server of a ``TCPStore`` listening on every
interface, with no authentication. Told by its node (``SPARK_TORCH_HOST_STORE=1``), rank 0
imports torch before the user's code, hosts the store on ``MASTER_ADDR:MASTER_PORT`` only
(:func:`spark_torch.shared.bound_store.host_store`) and sets ``TORCHELASTIC_USE_AGENT_STORE=True``, so
that its own ``init_process_group(init_method="env://")`` connects to it as a client, as under
torchrun's agent. The store lives as long as the rank. The variable is removed before the
user's code runs. When the store cannot be hosted (the port is taken), torch's own server is
left to try, as before, and a line on stderr says why.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from typing import Any

from spark_torch.base import envnames
from spark_torch.shared.bound_store import host_store

__all__ = ["host_rendezvous_store", "STORE_TIMEOUT"]

#: how long the store waits for a key (torch's default process-group timeout)
STORE_TIMEOUT = timedelta(minutes=30)

#: the hosted store: its server runs while this reference lives
_hosted: list[Any] = []


def host_rendezvous_store() -> bool:
    """Host the store when this rank's node asked for it; True when it is hosted here."""
    if os.environ.pop(envnames.HOST_STORE, None) != "1":
        return False
    try:
        host = os.environ[envnames.MASTER_ADDR]
        port = int(os.environ[envnames.MASTER_PORT])
        world_size = int(os.environ[envnames.WORLD_SIZE])
        _hosted.append(host_store(host, port, world_size, STORE_TIMEOUT))
    except Exception as exc:  # noqa: BLE001 - torch's own server then tries, as without us
        print(
            f"spark_torch: rank 0 could not host the rendezvous store on its node's address ({type(exc).__name__}: "
            f"{exc}); init_process_group(env://) hosts it as torch does, on every interface",
            file=sys.stderr,
        )
        return False
    os.environ[envnames.TORCHELASTIC_USE_AGENT_STORE] = "True"
    return True
