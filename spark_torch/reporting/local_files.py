"""The run's storage on a local (or mounted) filesystem: writes that are durable, private, and
never through another user's link.

Durable: what report() copied and the manifests are fsynced before it returns.

Private: a run's folder is created ``0700`` and each file the run writes there ``0600`` (a
checkpoint's files too, whatever their modes in the rank's folder), whatever the umask; a
storage folder spark_torch creates (the default ``~/spark_torch_runs``, and any missing folder
above a ``storage_path``) is ``0700``.

Never through a link: every use opens the run's folder relative to the storage folder without
following a link and checks who owns it, then opens everything in it relative to that
descriptor, again without following links (``O_NOFOLLOW``; a named pipe cannot block: opened
non-blocking). A run's folder, or anything in it, that is a symbolic link, a hard link (a file
to write), not the kind expected, or another user's is refused with
:class:`~spark_torch.errors.ConfigurationError` naming the path and what to do; nothing is read
or written through it. The storage folder itself is the user's choice and may be a link.

Shared team storage: a storage folder with the set-group-ID bit (``chgrp TEAM DIR; chmod 2770
DIR``) makes its runs' folders ``2770`` and their files ``0660``, so the folder's group reads
and writes them. There, and only there, a run's folder or entry of another user is accepted
when that user is a member of the folder's group, the entry has that group, and other users may
not write to it; other users, and links, are still refused. Only what this user owns is
``chmod``-ed. Standard library only (and spark_torch's errors).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import pwd
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from spark_torch.errors import ConfigurationError

__all__ = ["Owners", "RunFolder", "run_folder", "remove_run", "refusal", "listed_runs"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_COPY_CHUNK = 1 << 24


def refusal(path: str, reason: str) -> ConfigurationError:
    """The error for a run folder or entry that is not used: the path, why, what to do."""
    return ConfigurationError(
        f"the run's storage {path} {reason}: spark_torch neither follows nor writes into it (another user may "
        "have put it there to have this run write into their files or yours). Remove it if you know it, or "
        "pass another run_id= or storage_path=: a folder only you can write to, or a team's folder with the "
        "team's group and the set-group-ID bit (chgrp TEAM DIR; chmod 2770 DIR; see docs/security.md)"
    )


@functools.lru_cache(maxsize=256)
def _member(uid: int, gid: int) -> bool:
    """Whether the user ``uid`` is a member of the group ``gid`` (as the system's user database says)."""
    try:
        user = pwd.getpwuid(uid)
    except KeyError:
        return False
    return gid == user.pw_gid or gid in os.getgrouplist(user.pw_name, user.pw_gid)


@dataclass(frozen=True)
class Owners:
    """Who may own what is in a run's folder: this user; in a team's folder (set-group-ID) also
    a member of the folder's ``group``."""

    uid: int
    #: the storage folder's group when it has the set-group-ID bit, else None (private storage)
    group: int | None

    @classmethod
    def of(cls, base: os.stat_result) -> Owners:
        """The owners for a run under the storage folder ``base`` (its ``stat``)."""
        return cls(os.getuid(), base.st_gid if base.st_mode & stat.S_ISGID else None)

    @property
    def folder_mode(self) -> int:
        return 0o700 if self.group is None else 0o2770

    @property
    def file_mode(self) -> int:
        return 0o600 if self.group is None else 0o660

    def problem(self, info: os.stat_result) -> str | None:
        """Why an entry with ``info`` (its ``fstat``) may not be used, or None."""
        if info.st_uid == self.uid:
            return None
        if self.group is None:
            return f"belongs to another user (uid {info.st_uid})"
        if not _member(info.st_uid, self.group):
            return (
                f"belongs to a user (uid {info.st_uid}) who is not a member of the team folder's group "
                f"(gid {self.group})"
            )
        if info.st_gid != self.group:
            return f"belongs to another user (uid {info.st_uid}) and not to the team folder's group (gid {self.group})"
        if info.st_mode & 0o002:
            mode = oct(stat.S_IMODE(info.st_mode))
            return f"belongs to another user (uid {info.st_uid}) and every user may write to it (mode {mode})"
        return None

    def check(self, fd: int, path: str, kind: str) -> os.stat_result:
        """``fd`` (opened from ``path``) checked: of ``kind`` ("folder", "file") and an owner's;
        ours gets our mode. Closes ``fd`` and raises the refusal otherwise."""
        info = os.fstat(fd)
        wanted = stat.S_ISDIR(info.st_mode) if kind == "folder" else stat.S_ISREG(info.st_mode)
        why = None if wanted else f"is not a {'folder' if kind == 'folder' else 'regular file'}"
        why = why or self.problem(info)
        if why:
            os.close(fd)
            raise refusal(path, why)
        if info.st_uid == self.uid:
            mode = self.folder_mode if kind == "folder" else self.file_mode
            if stat.S_IMODE(info.st_mode) != mode:
                with contextlib.suppress(OSError):  # a mounted filesystem may not keep modes
                    os.fchmod(fd, mode)
        return info


def _open(path: str, flags: int, dir_fd: int, shown: str, mode: int = 0o600) -> int:
    """``os.open`` of an entry never through a link; a link or a named pipe raises the refusal."""
    try:
        return os.open(path, flags, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            raise refusal(shown, "is a named pipe (FIFO), not a regular file") from None
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        link = exc.errno == errno.ELOOP  # O_DIRECTORY on a link: ENOTDIR, as for a file
        with contextlib.suppress(OSError):
            link = link or stat.S_ISLNK(os.lstat(path, dir_fd=dir_fd).st_mode)
        if link:
            raise refusal(shown, "is a symbolic link") from None
        if flags & os.O_DIRECTORY:
            raise refusal(shown, "is not a folder") from None
        raise


def _open_folder(parent: int, name: str, shown: str, owners: Owners, create: bool) -> int:
    """A checked descriptor of the folder ``name`` in ``parent`` (created first if ``create``)."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, owners.folder_mode, dir_fd=parent)
    fd = _open(name, _DIR_FLAGS, parent, shown)
    owners.check(fd, shown, "folder")
    return fd


def _make_private_dirs(path: str) -> None:
    """``path`` and the missing folders above it created ``0700`` whatever the umask."""
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    if parent and parent != path:
        _make_private_dirs(parent)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        return
    os.chmod(path, 0o700)


def _remove_tree(parent: int, name: str) -> None:
    """Remove the entry ``name`` of ``parent`` (a folder: with everything in it), never following a link."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        os.unlink(name, dir_fd=parent)  # a link or a file: only its name goes
        return
    try:
        with os.scandir(fd) as entries:
            for entry in list(entries):
                if entry.is_dir(follow_symlinks=False):
                    _remove_tree(fd, entry.name)
                else:
                    os.unlink(entry.name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent)


@dataclass
class RunFolder:
    """A run's folder, opened without following a link and checked: ``fd`` is its descriptor
    (valid inside :func:`run_folder`), ``path`` its name for messages."""

    fd: int
    path: str
    owners: Owners
    base_fd: int

    def _shown(self, *parts: str) -> str:
        return os.path.join(self.path, *parts)

    @contextlib.contextmanager
    def folder(self, name: str, create: bool = False) -> Iterator[int]:
        """A checked descriptor of the folder ``name`` in the run's folder (created if ``create``)."""
        fd = _open_folder(self.fd, name, self._shown(name), self.owners, create)
        try:
            yield fd
        finally:
            os.close(fd)

    def names(self) -> list[str]:
        """The entries of the run's folder."""
        return os.listdir(self.fd)

    def read(self, *parts: str) -> bytes | None:
        """The bytes of the file ``parts`` (a name, or a folder's name and a file's), None if missing."""
        try:
            with contextlib.ExitStack() as stack:
                parent = self.fd if len(parts) == 1 else stack.enter_context(self.folder(parts[0]))
                fd = _open(parts[-1], _READ_FLAGS, parent, self._shown(*parts))
                self.owners.check(fd, self._shown(*parts), "file")
                with os.fdopen(fd, "rb") as fh:
                    return fh.read()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _writable(self, name: str, dir_fd: int, shown: str, append: bool) -> int:
        """A checked descriptor of the file ``name`` in ``dir_fd`` for writing (created with the file mode)."""
        fd = _open(name, _WRITE_FLAGS | (os.O_APPEND if append else 0), dir_fd, shown, self.owners.file_mode)
        info = self.owners.check(fd, shown, "file")
        if info.st_nlink != 1:
            os.close(fd)
            raise refusal(
                shown,
                f"has {info.st_nlink} names (a hard link: writing would also change the file under its other name)",
            )
        os.set_blocking(fd, True)
        if not append:
            os.ftruncate(fd, 0)
        return fd

    def append(self, name: str, text: str) -> None:
        """Append ``text`` to the file ``name`` of the run's folder."""
        fd = self._writable(name, self.fd, self._shown(name), append=True)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)

    def write(self, name: str, text: str, folder: str | None = None, atomic: bool = False) -> None:
        """``name`` (in the run's folder, or in its ``folder``) written with ``text``; with
        ``atomic``, to a temporary name first, fsynced, then renamed, and the rename fsynced."""
        with contextlib.ExitStack() as stack:
            dir_fd = self.fd if folder is None else stack.enter_context(self.folder(folder, create=True))
            target = name + ".tmp" if atomic else name
            shown = self._shown(*(p for p in (folder, target) if p))
            with os.fdopen(self._writable(target, dir_fd, shown, append=False), "w", encoding="utf-8") as fh:
                fh.write(text)
                if atomic:
                    fh.flush()
                    os.fsync(fh.fileno())
            if atomic:
                os.rename(target, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)  # replaces a link, never follows it
                os.fsync(dir_fd)

    def copy_in(self, source: str, name: str) -> None:
        """The files of the local folder ``source`` copied into the folder ``name`` (merged with
        what is there), each written, fsynced and given the run's file mode; then their folders
        fsynced."""
        with self.folder(name, create=True) as top:
            for dirpath, _dirs, files in os.walk(source, followlinks=True):
                relative = os.path.relpath(dirpath, source)
                parts = [] if relative == "." else relative.split(os.sep)
                with contextlib.ExitStack() as stack:
                    dir_fd = top
                    for depth in range(len(parts)):
                        shown = self._shown(name, *parts[: depth + 1])
                        dir_fd = _open_folder(dir_fd, parts[depth], shown, self.owners, create=True)
                        stack.callback(os.close, dir_fd)
                    for file in files:
                        self._copy_file(os.path.join(dirpath, file), file, dir_fd, self._shown(name, *parts, file))
                    os.fsync(dir_fd)
        os.fsync(self.fd)

    def _copy_file(self, source: str, name: str, dir_fd: int, shown: str) -> None:
        with open(source, "rb") as src:
            target = self._writable(name, dir_fd, shown, append=False)
            try:
                info = os.fstat(src.fileno())
                offset = 0
                while offset < info.st_size:
                    sent = os.sendfile(target, src.fileno(), offset, min(_COPY_CHUNK, info.st_size - offset))
                    if sent == 0:
                        break
                    offset += sent
                os.utime(target, ns=(info.st_atime_ns, info.st_mtime_ns))
                os.fsync(target)
            finally:
                os.close(target)

    def remove(self, name: str) -> None:
        """Remove the entry ``name`` of the run's folder (with everything in it), no link followed."""
        _remove_tree(self.fd, name)


@contextlib.contextmanager
def run_folder(base: str, run_id: str, create: bool = False) -> Iterator[RunFolder]:
    """The run's folder ``base/run_id`` opened and checked, for one use. With ``create``,
    ``base`` (``0700``) and the run's folder are made when missing. Raises
    ``FileNotFoundError`` when there is no such folder,
    :class:`~spark_torch.errors.ConfigurationError` when it is refused."""
    if create:
        _make_private_dirs(base)
    base_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the user's choice: may be a link
    try:
        owners = Owners.of(os.fstat(base_fd))
        path = os.path.join(base, run_id)
        fd = _open_folder(base_fd, run_id, path, owners, create)
        try:
            yield RunFolder(fd, path, owners, base_fd)
        finally:
            os.close(fd)
    finally:
        os.close(base_fd)


def remove_run(base: str, run_id: str) -> None:
    """Remove the run's folder (checked first: a refused one raises)."""
    with run_folder(base, run_id) as run:
        _remove_tree(run.base_fd, run_id)


def listed_runs(base: str, marker: str) -> list[str]:
    """The names of the run folders under ``base`` holding a ``marker`` file, that are not links
    and that an owner of :class:`Owners` holds (another user's are not listed); none when ``base``
    does not exist."""
    try:
        owners = Owners.of(os.stat(base))
        names = os.listdir(base)
    except (FileNotFoundError, NotADirectoryError):
        return []
    runs = []
    for name in names:
        try:
            folder, mark = os.lstat(os.path.join(base, name)), os.lstat(os.path.join(base, name, marker))
        except OSError:
            continue
        if stat.S_ISDIR(folder.st_mode) and stat.S_ISREG(mark.st_mode) and owners.problem(folder) is None:
            runs.append(name)
    return sorted(runs)
