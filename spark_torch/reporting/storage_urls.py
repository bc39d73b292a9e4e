"""The run storage's addresses: which are local paths, DBFS's two spellings, a run's own
directory split into its storage and run id, and the one sentence a storage failure reads as.

Pure functions over strings (and one ``isdir`` for the DBFS mount): the layout under an address
is :mod:`spark_torch.reporting.storage`'s.
"""

from __future__ import annotations

import os

__all__ = ["DBFS_MOUNT", "is_local_url", "local_base", "split_run_path", "storage_error"]

#: Databricks mounts DBFS here on the driver and every executor
DBFS_MOUNT = "/dbfs"


def is_local_url(url: str) -> bool:
    """A path of this machine (or a mount), not an fsspec URL."""
    return "://" not in url and not url.startswith("dbfs:")


def local_base(base: str) -> str:
    """``dbfs:/path`` as ``/dbfs/path`` where Databricks mounts DBFS (the mount needs nothing); elsewhere as
    ``dbfs://path`` for fsspec's Databricks filesystem (which needs ``storage_options={"instance": ..., "token":
    ...}``; fsspec would take ``dbfs:/path`` for a local directory named ``dbfs:``). Other storage unchanged."""
    if base.startswith("dbfs:"):
        path = base[len("dbfs:") :].lstrip("/")
        return os.path.join(DBFS_MOUNT, path) if os.path.isdir(DBFS_MOUNT) else f"dbfs://{path}"
    return base


def storage_error(url: str, exc: BaseException) -> str:
    """One sentence about a storage failure, whatever fsspec backend raised it."""
    return (
        f"the run's storage {url} cannot be used ({type(exc).__name__}: {exc}); check the path or URL, that its "
        "filesystem package is installed (s3fs for s3://, gcsfs for gs://, adlfs for abfss://) and the "
        "credentials it needs (storage_options=, e.g. {'key': ..., 'secret': ...} or {'client_kwargs': "
        "{'endpoint_url': ...}} for S3; {'instance': ..., 'token': ...} for dbfs:// off Databricks)"
    )


def split_run_path(path: str) -> tuple[str, str]:
    """A run's own directory (``STORAGE/RUN_ID``, a path or URL) as ``(STORAGE, RUN_ID)``."""
    if is_local_url(path):
        trimmed = os.path.normpath(os.path.abspath(os.path.expanduser(path)))
        return os.path.dirname(trimmed), os.path.basename(trimmed)
    base, _, run_id = path.rstrip("/").rpartition("/")
    return base, run_id
