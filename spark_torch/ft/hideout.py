"""torchft's lighthouse where no other user can reach it (:class:`Hideout`).

torchft's lighthouse is a TCP server that authenticates nobody: a process of another user of
the driver's machine that reaches it can join a quorum, claim the highest step and become the
group every other heals from, and torchft's ``PGTransport`` unpickles what a heal source sends.
So the driver runs the lighthouse in a child process of its own network namespace (Linux
``unshare``: as root a network namespace, else a user namespace that maps only this user, and
its network namespace): it listens on that namespace's loopback, which no other process of the
machine can reach. Its only way in is a Unix socket in a fresh ``0700`` folder of this user,
relayed inside the namespace to the lighthouse (:class:`~spark_torch.ft.relay.Relay`). The
driver's gate (:mod:`spark_torch.ft.gate`) passes the ranks' connections to that socket.

The child also runs the lighthouse's pump (:class:`~spark_torch.ft.pump.Pump`): it heartbeats
every replica group the driver has not retired, from this process and its own GIL, so that
the lighthouse's short heartbeat timeout never drops a live group whose own heartbeats are late;
the driver writes ``retire GROUP`` on the child's stdin (:meth:`Hideout.retire`) the moment it
learns that a rank of the group ended, and the lighthouse drops that group a heartbeat timeout
later. The child stops when the driver closes its stdin (or dies: the pipe closes with it). Where the
kernel refuses the namespaces (user namespaces off, a container's seccomp), :meth:`Hideout.start`
says why and the caller falls back to a lighthouse on loopback (docs/security.md).

``python -m spark_torch.ft.hideout FOLDER MIN_REPLICAS JOIN_MS TICK_MS HEARTBEAT_MS`` is the
child (``-`` for torchft's default); it loads torchft's compiled module only, not torch.
"""

from __future__ import annotations

import ctypes
import fcntl
import glob
import importlib.util
import os
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from types import ModuleType
from typing import Any

from spark_torch.base.envnames import RUST_LOG, RUST_LOG_DEFAULT
from spark_torch.ft.pump import Pump
from spark_torch.ft.relay import Relay

__all__ = ["Hideout", "NoHideout", "START_SECONDS", "SOCKET_NAME", "RETIRE"]

#: how long the child may take to say it is ready
START_SECONDS = 30.0
#: how long close() waits for the child after closing its stdin, before SIGKILL
STOP_SECONDS = 5.0
#: the Unix socket in the hideout's folder
SOCKET_NAME = "lighthouse.sock"
#: the line ``retire GROUP`` on the child's stdin: that group's ranks ended (:meth:`Pump.retire`)
RETIRE = "retire"
_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000
_SIOCSIFFLAGS, _IFF_UP, _IFF_LOOPBACK, _IFF_RUNNING = 0x8914, 0x1, 0x8, 0x40


class NoHideout(OSError):
    """The lighthouse could not be hidden (the kernel refused a namespace, or the child did not start)."""


class Hideout:
    """The child process that hosts the lighthouse in its own network namespace; ``path`` is
    its Unix socket. :meth:`close` (idempotent) stops it and removes its folder."""

    def __init__(self, process: subprocess.Popen[str], folder: str) -> None:
        self._process: subprocess.Popen[str] | None = process
        self._lock = threading.Lock()  # retire() from the groups' threads, close() from the driver's
        self.folder = folder
        self.path = os.path.join(folder, SOCKET_NAME)

    @classmethod
    def start(cls, options: tuple[int, int | None, int | None, int | None]) -> Hideout:
        """Start the child with torchft's options ``(min_replicas, join_timeout_ms,
        quorum_tick_ms, heartbeat_timeout_ms)``; NoHideout saying why when it cannot."""
        folder = tempfile.mkdtemp(prefix="spark-torch-lighthouse-")  # 0700
        argv = [
            sys.executable,
            "-m",
            "spark_torch.ft.hideout",
            folder,
            *("-" if v is None else str(v) for v in options),
        ]
        # the child imports this package from where this process has it, installed or not; torchft's
        # server logs at warning (3 INFO lines per quorum tick otherwise) unless the user set RUST_LOG
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
        process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            close_fds=True,
            env={**os.environ, "PYTHONPATH": path, RUST_LOG: os.environ.get(RUST_LOG, RUST_LOG_DEFAULT)},
        )
        hideout = cls(process, folder)
        assert process.stdout is not None
        ready, _, _ = select.select([process.stdout], [], [], START_SECONDS)
        line = process.stdout.readline().strip() if ready else f"not ready within {START_SECONDS:.0f} s"
        if line != "ready":
            hideout.close()
            raise NoHideout(line or f"the lighthouse's process ended (exit code {process.poll()}) before it was ready")
        return hideout

    def retire(self, group: int) -> None:
        """Group ``group``'s ranks ended: the child's pump stops vouching for it at once
        (:class:`~spark_torch.ft.pump.Pump`); nothing once the child is stopped."""
        with self._lock:
            process = self._process
            if process is None or process.stdin is None:
                return
            try:
                process.stdin.write(f"{RETIRE} {int(group)}\n")
                process.stdin.flush()
            except (OSError, ValueError):  # the child ended (its pipe closed)
                pass

    def close(self) -> None:
        """Stop the child (its stdin closes; SIGKILL after :data:`STOP_SECONDS`) and remove the folder."""
        with self._lock:
            process, self._process = self._process, None
        if process is not None:
            for stream in (process.stdin, process.stdout):
                if stream is not None:
                    try:
                        stream.close()
                    except OSError:
                        pass
            try:
                process.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(STOP_SECONDS)
        shutil.rmtree(self.folder, ignore_errors=True)


def _enter_private_network() -> None:
    """Move this (single-threaded) process into a network namespace of its own, with its
    loopback up; as another user than root, inside a user namespace that maps only this user."""
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.geteuid(), os.getegid()
    if libc.unshare(_CLONE_NEWNET if uid == 0 else _CLONE_NEWUSER | _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"unshare: {os.strerror(errno)}")
    if uid != 0:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as fh:
                fh.write(text)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as control:
        flags = _IFF_UP | _IFF_LOOPBACK | _IFF_RUNNING
        fcntl.ioctl(control, _SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags))


def _torchft_core() -> ModuleType:
    """torchft's compiled module alone (torchft's package imports torch: seconds)."""
    spec = importlib.util.find_spec("torchft")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("torchft")
    found = glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "_torchft*.so"))
    core = importlib.util.spec_from_file_location("torchft._torchft", found[0]) if found else None
    if core is None or core.loader is None:
        raise ModuleNotFoundError("torchft._torchft")
    module = importlib.util.module_from_spec(core)
    core.loader.exec_module(module)
    return module


def main(argv: list[str]) -> int:
    """The child: see the module's docstring."""
    folder, *values = argv
    try:
        _enter_private_network()
    except OSError as exc:
        print(f"the kernel refused a private network namespace ({exc})", flush=True)
        return 3
    options: dict[str, Any] = dict(
        zip(("min_replicas", "join_timeout_ms", "quorum_tick_ms", "heartbeat_timeout_ms"), values)
    )
    core = _torchft_core()
    server = core.LighthouseServer(
        bind="127.0.0.1:0", **{name: int(value) for name, value in options.items() if value != "-"}
    )
    port = int(server.address().rsplit(":", 1)[1])
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = os.path.join(folder, SOCKET_NAME)
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(socket.SOMAXCONN)
    # only this user can open the 0700 folder: every connection is this user's
    relay = Relay(
        listener,
        lambda: socket.create_connection(("127.0.0.1", port), timeout=5),
        lambda conn, peer: True,
        name="spark-torch-lighthouse-hideout",
    )
    pump = Pump(port, core)
    print("ready", flush=True)
    try:
        for line in sys.stdin:  # until the driver closes it, or dies
            words = line.split()
            if len(words) == 2 and words[0] == RETIRE and words[1].isdigit():
                pump.retire(int(words[1]))
    finally:
        pump.close()
        relay.close()
        server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
