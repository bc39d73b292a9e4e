"""The run's storage on a local (or mounted) filesystem: writes that are durable and private.

Durable: what report() copied and the manifests are fsynced before it returns. Private: a run's
folder is created ``0700`` and each file the run writes there ``0600`` (a checkpoint's files
too, whatever their modes in the rank's folder), so other users of the host read none of it,
whatever the umask. Shared team storage: a storage folder with the set-group-ID bit (``chmod
2770 TEAM_DIR``, the usual mark of a group's folder) makes its runs' folders ``2770`` and
their files ``0660``: the folder's group reads and writes them, other users still nothing. Only
what this user owns is changed. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import stat
from typing import IO

__all__ = ["fsync_path", "fsync_copy", "shared", "make_dir", "open_file", "restrict_tree"]


def fsync_path(path: str, directory: bool = False) -> None:
    """Flush ``path`` (a file, or a folder's entries) to disk."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_copy(source: str, target: str) -> None:
    """Flush to disk what was copied from ``source`` into ``target`` (its files and their
    directories): a checkpoint is durable before report() returns, not only in the page cache."""
    for dirpath, _dirs, files in os.walk(source):
        copied = os.path.join(target, os.path.relpath(dirpath, source))
        for name in files:
            fsync_path(os.path.join(copied, name))
        fsync_path(copied, directory=True)
    fsync_path(os.path.dirname(target), directory=True)


def shared(base: str) -> bool:
    """Whether ``base`` (the storage folder) is a team's: it has the set-group-ID bit."""
    try:
        return bool(os.stat(base).st_mode & stat.S_ISGID)
    except OSError:
        return False


def _modes(base: str) -> tuple[int, int]:
    """(a folder's mode, a file's mode) for the runs under ``base``."""
    return (0o2770, 0o660) if shared(base) else (0o700, 0o600)


def _restrict(path: str, mode: int) -> None:
    """``chmod`` to ``mode`` when this user owns ``path`` (a teammate's stays as it is)."""
    with contextlib.suppress(OSError):
        if os.lstat(path).st_uid == os.getuid():
            os.chmod(path, mode, follow_symlinks=False)


def make_dir(base: str, path: str) -> None:
    """``path`` (a run's folder, or one inside it) created if missing, with the runs' folder mode."""
    os.makedirs(path, exist_ok=True)
    _restrict(path, _modes(base)[0])


def open_file(base: str, path: str, mode: str) -> IO[str]:
    """``open(path, mode)`` (text, UTF-8) for writing, created with the runs' file mode."""
    file_mode = _modes(base)[1]
    fh = open(path, mode, encoding="utf-8", opener=lambda p, flags: os.open(p, flags, file_mode))  # noqa: SIM115
    _restrict(path, file_mode)
    return fh


def restrict_tree(base: str, root: str) -> None:
    """Every folder and file under ``root`` (a copied checkpoint) to the runs' modes."""
    folder, file = _modes(base)
    _restrict(root, folder)
    for dirpath, dirs, files in os.walk(root):
        for name in dirs:
            _restrict(os.path.join(dirpath, name), folder)
        for name in files:
            _restrict(os.path.join(dirpath, name), file)
