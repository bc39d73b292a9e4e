"""The warm-start template: a process that has imported torch and forks ranks on request.

``python -m spark_torch.node.template_main SOCKET OWNER_PID`` imports torch (and spark_torch's rank
entry points) once, with every thread pool at one thread so that it has no thread but its main
one, listens on a Unix socket in a private (0700) directory, and answers requests from node
runners (its peer must be the same user: ``SO_PEERCRED``). It lives as long as its owner (the
driver in local mode; the executor JVM in distributed mode, so every Python worker of an
executor shares it), watched through a pidfd: no polling. If a node runner goes away while
its rank runs (its connection closes), the template kills that rank's process group. A request carries the rank's
argv, environment and working directory and, as passed file descriptors, its stdin, stdout,
stderr and report pipes. The template forks; the child becomes the rank: a new session, those
descriptors as 0/1/2, the rank's environment, directory and ``sys.argv``, fresh random seeds,
torch's thread count from the rank's ``OMP_NUM_THREADS``, the parent-death signal, then
``python -m spark_torch.rank.function_main`` (or ``script_main``) runs in it exactly as in a cold start.
The template answers with the child's pid and, when the child exits, its exit status.

The template itself never runs user code, never initializes CUDA and never starts a thread,
so every run's ranks are forks of the same pristine process: nothing leaks from run to run.
Protocol (one JSON message per packet on a ``SOCK_SEQPACKET`` connection): the request
``{"argv", "env", "cwd"}`` with its descriptors (``socket.send_fds``); the answers
``{"pid": N}`` and later ``{"exit": CODE}`` (negative: killed by that signal).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import sys
from typing import Any

from spark_torch import envnames

__all__ = ["main", "THREAD_ENV", "MAX_REQUEST"]

#: the template's own thread pools: one thread each, so that it has no thread to lose in fork()
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
MAX_REQUEST = 4 << 20
#: at most this many file descriptors per request (stdin, stdout, stderr, two report pipes)
MAX_FDS = 8


def _become_rank(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: turn into the rank described by ``request`` (never returns)."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        os.setsid()
        stdin, stdout, stderr, *extra = fds
        for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
            os.dup2(fd, target)
        env = dict(request["env"])
        if extra:
            env[envnames.REPORT_FDS] = ",".join(str(fd) for fd in extra)
        for fd in (stdin, stdout, stderr):
            if fd > 2:
                os.close(fd)
        env[envnames.PARENT_PID] = str(os.getppid())  # this template: it dies with the node runner
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"] or "/")
        _reseed_and_size_threads()
        module, *args = request["argv"]
        sys.argv = ["-m", *args]
        sys.path[0] = os.getcwd()  # what `python -m` puts first
        import runpy

        sys.modules.pop(module, None)  # imported by the template (warm bytecode); run it afresh as __main__
        runpy.run_module(module, run_name="__main__", alter_sys=True)  # ends with os._exit
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - a rank that could not start
        import traceback

        traceback.print_exc()
    os._exit(code)


def _reseed_and_size_threads() -> None:
    """A fork inherits the template's random state and thread settings: make them the rank's."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


class _Template:
    def __init__(self, path: str, owner: int) -> None:
        self.path = path
        # SEQPACKET: a request arrives whole, with its descriptors, or not at all
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        if os.path.exists(path):
            os.unlink(path)  # a dead template's socket
        self.listener.bind(path)
        os.chmod(path, 0o600)
        self.listener.listen(16)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.wakeup_r, wakeup_w = os.pipe()
        os.set_blocking(self.wakeup_r, False)
        os.set_blocking(wakeup_w, False)
        signal.set_wakeup_fd(wakeup_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the selector through the pipe
        self.selector.register(self.wakeup_r, selectors.EVENT_READ, "child")
        self.owner_fd = os.pidfd_open(owner)  # readable once the owner exits
        self.selector.register(self.owner_fd, selectors.EVENT_READ, "owner")
        self.children: dict[int, socket.socket] = {}

    def serve(self) -> None:
        while True:
            for key, _ in self.selector.select():
                if key.data == "owner":
                    self._shutdown()
                    return
                if key.data == "accept":
                    self._accept()
                elif key.data == "child":
                    try:
                        os.read(self.wakeup_r, 4096)
                    except BlockingIOError:
                        pass
                    self._reap()
                else:
                    self._drop(key.fileobj)  # type: ignore[arg-type]  # a client went away

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
        if uid != os.getuid():
            conn.close()
            return
        try:
            conn.settimeout(10.0)
            message, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, MAX_FDS)
            request = json.loads(message.decode("utf-8"))
            if len(fds) < 3 or not isinstance(request, dict):
                raise ValueError("a request needs argv/env/cwd and at least 3 descriptors")
        except (OSError, ValueError) as exc:
            conn.close()
            print(f"spark_torch template: refused a request ({exc})", file=sys.stderr, flush=True)
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self.selector.close()
            self.listener.close()
            for other in self.children.values():
                other.close()
            conn.close()
            _become_rank(request, fds)
        for fd in fds:
            os.close(fd)
        conn.settimeout(None)
        conn.sendall(json.dumps({"pid": pid}).encode())
        self.children[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, "client")
        self._reap()  # it may already have exited

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            try:
                self.selector.unregister(conn)
                conn.sendall(json.dumps({"exit": code}).encode())
            except (OSError, KeyError, ValueError):
                pass
            conn.close()

    def _drop(self, conn: socket.socket) -> None:
        """A node runner's connection closed while its rank runs: the node runner died, and its
        rank (its process group) goes with it, as a rank started by the node runner would."""
        try:
            if conn.recv(1):
                return
        except OSError:
            pass
        self.selector.unregister(conn)
        for pid, owner in list(self.children.items()):
            if owner is conn:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def _shutdown(self) -> None:
        """The owner is gone: stop every rank still running and remove the socket."""
        for pid in list(self.children):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            os.unlink(self.path)
        except OSError:
            pass


def main(argv: list[str]) -> int:
    """Import torch, listen on ``argv[0]``, print ``ready`` and serve until process ``argv[1]`` exits."""
    os.environ.update(THREAD_ENV)
    import runpy  # noqa: F401 - used by the children

    from spark_torch.rank import function_main, script_main  # noqa: F401 - the children's entry points, imported once

    try:
        import torch  # noqa: F401 - the point: ranks start with it imported
        import torch.distributed  # noqa: F401
    except ImportError:
        pass
    template = _Template(argv[0], int(argv[1]))
    print("ready", flush=True)
    template.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
