"""At the rendezvous: does every node see the run's storage?

Each node reads back the marker the driver wrote into the run's directory
(:meth:`~spark_torch.reporting.storage.RunStorage.visible`) and says so in its hello. A storage
the user chose (``storage_path=``), or one the run resumes from, that some node cannot see stops
the run there, before any rank starts, naming the storage and the nodes: otherwise it fails at
the first ``report(checkpoint=...)`` on such a node, after training time was spent. The default
storage that some node cannot see only earns a warning at the rendezvous, naming it and the
nodes (a run that never checkpoints does not need it there).
"""

from __future__ import annotations

from typing import Any

from spark_torch.shared.spec import RunSpec

__all__ = ["storage_hello", "storage_problem", "storage_needed", "SEEN"]

#: the hello key: True when this node sees the run's storage; absent without storage
SEEN = "storage_seen"


def storage_hello(run: RunSpec) -> dict[str, Any]:
    """This node's part of the hello: whether it sees the run's storage (and why not)."""
    if run.storage is None:
        return {}
    from spark_torch.reporting.storage import RunStorage

    try:
        seen = RunStorage(run.storage.base, run.run_id, run.storage.options).visible(run.storage.token)
        why = "" if seen else "the driver's marker is not there"
    except Exception as exc:  # noqa: BLE001 - every fsspec backend raises its own kinds
        seen, why = False, f"{type(exc).__name__}: {exc}"[:300]
    return {SEEN: seen, "storage_why": why}


def storage_needed(run: RunSpec) -> bool:
    """Whether the run cannot go on when a node does not see its storage: the user chose it, or
    the run resumes from it (else a warning is enough)."""
    return run.storage is not None and (run.storage.required or run.resume_url is not None)


def storage_problem(run: RunSpec, peers: list[dict[str, Any]]) -> str | None:
    """Why the run cannot go on with this storage (one line naming it and the nodes), or None."""
    if run.storage is None:
        return None
    blind = [(node, peer) for node, peer in enumerate(peers) if peer.get(SEEN) is False]
    if not blind:
        return None
    from spark_torch.reporting.storage import RunStorage

    url = RunStorage(run.storage.base, run.run_id, run.storage.options).url
    nodes = "; ".join(
        f"node {node} on {peer.get('host', '?')} ({peer.get('storage_why') or 'not visible'})" for node, peer in blind
    )
    return (
        f"the run's storage {url} is not visible from {len(blind)} of {len(peers)} nodes: {nodes}. Every node "
        "reads and writes checkpoints there: pass storage_path= on storage every node can reach (a shared "
        "filesystem mounted at the same path, or an fsspec URL such as s3://bucket/runs)"
    )
