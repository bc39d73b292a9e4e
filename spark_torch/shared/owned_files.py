"""Files and folders that only this user's process may have made: the one set of checks behind
``log_dir``'s rank logs, the Flight Recorder trace files and the warm-start template's sockets,
and the per-user folders of the last two (:func:`private_folder`, and the fallback folders it
takes, which live as long as the process that made them).

A path in a shared place (a ``log_dir`` others can write to, the temporary directory) can hold
something planted there: a symbolic link or a hard link to a victim's file (writing would change
it), a FIFO (opening it would block), a folder of another user (who could swap its contents).
These functions refuse all of them with :class:`UnsafePathError`, whose ``reason`` says what
was found.
"""

from __future__ import annotations

import atexit
import errno
import logging
import os
import re
import shutil
import stat
import tempfile
import threading

__all__ = ["UnsafePathError", "open_own_file", "own_directory", "private_folder", "sweep_stale_folders"]

logger = logging.getLogger(__name__)


class UnsafePathError(OSError):
    """A path that is not this user's own regular file or folder; ``reason`` says what it is."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path} {reason}")
        self.path = path
        self.reason = reason


def open_own_file(path: str, *, append: bool, dir_fd: int | None = None) -> int:
    """A descriptor of ``path`` for writing, created 0600 if missing: only a regular file of this
    user with one name (never through a symbolic link, never a FIFO: opened non-blocking, a FIFO
    cannot block the caller). With ``append`` it is opened for appending, otherwise emptied, but
    only after the checks (a hard link is refused before it is truncated). ``dir_fd``: ``path`` is
    relative to that folder."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | (os.O_APPEND if append else 0)
    try:
        fd = os.open(path, flags, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        reasons = {errno.ELOOP: "is a symbolic link", errno.ENXIO: "is a named pipe (FIFO), not a regular file"}
        raise UnsafePathError(path, reasons.get(exc.errno or 0, f"cannot be opened ({exc.strerror})")) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise UnsafePathError(path, f"is not a regular file of this user (owner uid {info.st_uid})")
        if info.st_nlink != 1:
            raise UnsafePathError(
                path,
                f"has {info.st_nlink} names (a hard link: writing would also change the file under its other name)",
            )
        os.set_blocking(fd, True)  # a regular file: writes block as usual
        os.fchmod(fd, 0o600)  # also when our own file existed with wider permissions
        if not append:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def own_directory(path: str, *, private: bool, dir_fd: int | None = None) -> int:
    """A descriptor of the folder ``path`` (created 0700 if missing), which must be a folder of
    this user (not a symbolic link) that nobody else may write to; with ``private``, that nobody
    else may read either. ``dir_fd``: ``path`` is relative to that folder (so a parent checked
    before cannot be swapped under it). The caller closes the descriptor."""
    try:
        os.mkdir(path, 0o700, dir_fd=dir_fd)
    except FileExistsError:
        pass
    except OSError as exc:
        raise UnsafePathError(path, f"cannot be created ({exc.strerror})") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        reason = "is a symbolic link" if exc.errno == errno.ELOOP else f"is not a usable folder ({exc.strerror})"
        raise UnsafePathError(path, reason) from None
    info = os.fstat(fd)
    others = 0o077 if private else 0o022
    if info.st_uid != os.getuid() or info.st_mode & others:
        os.close(fd)
        raise UnsafePathError(
            path,
            f"is not a folder of this user that only it may {'use' if private else 'write to'} "
            f"(owner uid {info.st_uid}, mode {oct(stat.S_IMODE(info.st_mode))})",
        )
    return fd


#: per-user folders refused in this process: (name, base) -> the private folder used instead
_fallbacks: dict[tuple[str, str], str] = {}
#: (name, base) whose stale fallback folders this process has swept
_swept: set[tuple[str, str]] = set()
_fallback_lock = threading.Lock()


def private_folder(name: str, *, base: str | None = None) -> str:
    """This user's private folder ``BASE/NAME-UID`` (created 0700; ``base``: the temporary
    directory when None), checked. Its name is predictable, so another local user may have made
    it first, or it may have lost its permissions: then it is never used, and this process takes
    a private folder instead (``$XDG_RUNTIME_DIR/NAME`` when that is this user's private folder,
    else a new ``BASE/NAME-UID-PID.START-XXXXXXXX`` of this process, removed when it exits and,
    if it could not, by the next process that looks for that folder), with one WARNING naming
    the refused path. Raises :class:`UnsafePathError` only when no private folder can be had."""
    base = base or tempfile.gettempdir()
    path = os.path.join(base, f"{name}-{os.getuid()}")
    with _fallback_lock:
        if (name, base) in _fallbacks:
            return _fallbacks[(name, base)]
        if (name, base) not in _swept:
            _swept.add((name, base))
            sweep_stale_folders(base, name)
        try:
            os.close(own_directory(path, private=True))
            return path
        except UnsafePathError as exc:
            refused = exc
        instead = _fallback(name, base)
        _fallbacks[(name, base)] = instead
    logger.warning(
        "spark_torch: refused the folder %s (%s: another user's, or readable or writable by others); "
        "using the private folder %s instead. Remove the refused folder (or set TMPDIR) to get it back.",
        refused.path,
        refused.reason,
        instead,
    )
    return instead


def _fallback(name: str, base: str) -> str:
    """``$XDG_RUNTIME_DIR/NAME`` when that is this user's own private folder, else a new one of
    this process (removed at its exit)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isabs(runtime):
        try:
            info = os.stat(runtime)
            if info.st_uid == os.getuid() and stat.S_ISDIR(info.st_mode) and not info.st_mode & 0o077:
                path = os.path.join(runtime, name)
                os.close(own_directory(path, private=True))
                return path
        except OSError:  # UnsafePathError too: on to a folder of our own
            pass
    pid = os.getpid()
    path = tempfile.mkdtemp(prefix=f"{name}-{os.getuid()}-{pid}.{_started(pid) or 0}-", dir=base)
    atexit.register(_remove_own, path, pid)
    return path


def _remove_own(path: str, pid: int) -> None:
    """At exit: remove the fallback folder ``path`` if this is the process that made it (a fork
    inherits the handler)."""
    if os.getpid() == pid:
        shutil.rmtree(path, ignore_errors=True)


def _started(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, ``/proc/PID/stat``), or None: no such
    process (or no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    try:
        return int(data[data.rindex(b")") + 2 :].split()[19])
    except (ValueError, IndexError):
        return None


def sweep_stale_folders(base: str, name: str) -> list[str]:
    """Remove this user's fallback folders ``BASE/NAME-UID-PID.START-*`` whose process is gone
    (no process ``PID``, or one that started at another time: the pid was reused) and that
    :func:`private_folder` could not remove at exit (a process ended with ``os._exit`` or a
    signal); another user's folder, or anything not a folder, is never touched. Returns the removed."""
    uid = os.getuid()
    pattern = re.compile(rf"{re.escape(name)}-{uid}-(\d+)\.(\d+)-[A-Za-z0-9_]+\Z")
    removed: list[str] = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    for entry in entries:
        found = pattern.match(entry.name)
        if found is None:
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
            continue
        pid, started = int(found.group(1)), int(found.group(2))
        now = _started(pid)
        if now is not None and (now == started or started == 0):
            continue  # its process runs (0: made where /proc was not readable; kept while the pid lives)
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed
