"""Playing another user of the host for real: uid 65534 (nobody) in a forked child, and a folder
every user may write to where it plants things (``/tmp``-like, or ``~/spark_torch_runs`` made
under ``umask 000``). Needs root (the tests run as root here)."""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable

__all__ = ["NOBODY", "as_user", "open_folder"]

#: uid 65534 (nobody); also the group nogroup, nobody's primary group
NOBODY = 65534


def as_user(uid: int, gid: int, plant: Callable[[], None]) -> None:
    """Run ``plant`` in a forked child that is the user ``uid`` (group ``gid``, no other groups,
    umask 000); raises if it failed (its traceback on stderr)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            os.umask(0)
            plant()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"the child playing uid {uid} failed (its traceback is on stderr)")


def open_folder() -> str:
    """A new folder every user may write to (``0777``, no sticky bit), outside the tests' private
    temporary folders so that uid 65534 reaches it; the caller removes it."""
    base = tempfile.mkdtemp(prefix="spark-torch-open-storage-", dir=os.environ.get("SPARK_TORCH_TEST_TMP_BASE", "/tmp"))
    os.chmod(base, 0o777)
    return base
