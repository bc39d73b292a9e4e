"""How long a stop may take, named once: the node's grace for its ranks and the driver's wait
derived from it.

A node stops its ranks with SIGTERM, :data:`RANK_GRACE_SECONDS`, SIGKILL
(:mod:`spark_torch.node.process_tree`); the reaper of a node runner that died does the same. The
driver, after it told the nodes to stop (a timeout, Ctrl-C, another node failed), waits
:data:`DRIVER_STOP_WAIT_SECONDS` for them before it cancels the Spark job or starts the next
attempt, so the next attempt's ranks never start while the last one's are still in their grace.
Node 0's rendezvous store host gets its own, shorter grace, :data:`STORE_HOST_GRACE_SECONDS`.
Pure constants: no imports.
"""

from __future__ import annotations

__all__ = [
    "RANK_GRACE_SECONDS",
    "INTERRUPT_GRACE_SECONDS",
    "STOP_MARGIN_SECONDS",
    "DRIVER_STOP_WAIT_SECONDS",
    "STORE_HOST_GRACE_SECONDS",
]

#: SIGTERM to SIGKILL for a node's ranks (the node runner's stop, and its reaper's)
RANK_GRACE_SECONDS = 5.0
#: after Ctrl-C (or another exception in the node runner), the ranks get this long instead
INTERRUPT_GRACE_SECONDS = 2.0
#: the node's time to hear the stop, collect its ranks' exits and say so, on top of the grace
STOP_MARGIN_SECONDS = 2.0
#: how long the driver waits for the nodes it told to stop, before it cancels the Spark job or
#: restarts: the node's grace plus the margin
DRIVER_STOP_WAIT_SECONDS = RANK_GRACE_SECONDS + STOP_MARGIN_SECONDS
#: SIGTERM to SIGKILL for node 0's rendezvous store host (:mod:`spark_torch.node.store_host`):
#: it holds no user state, so it gets little time
STORE_HOST_GRACE_SECONDS = 2.0
