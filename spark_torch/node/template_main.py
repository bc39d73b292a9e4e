"""The warm-start template: a process that has imported torch and forks ranks on request.

``python -m spark_torch.node.template_main SOCKET OWNER_PID [IDLE_SECONDS]`` imports torch (and
spark_torch's rank entry points) once, with every thread pool at one thread so that it has no
thread but its main one, listens on a Unix socket in a private (0700) directory, and answers
requests from node runners (its peer must be the same user: ``SO_PEERCRED``). It lives as long
as its owner (the driver in local mode; the executor JVM in distributed mode, so every Python
worker of an executor shares it), watched through a pidfd: no polling; and it ends after
``IDLE_SECONDS`` with no rank running (the latest request's ``idle`` replaces it). If a node
runner goes away while its rank runs (its connection closes), the template kills that rank's
process group.

A request carries the rank's argv, environment, working directory, umask and resource limits
(the node runner's, as a cold rank would inherit them) and, as passed file descriptors, its
stdin, stdout, stderr and report pipes. The template forks; the child becomes the rank: a new
session, those descriptors as 0/1/2 and every other descriptor closed, the limits and umask, the
rank's environment, directory and ``sys.argv``, fresh random seeds, torch's thread count from
the rank's ``OMP_NUM_THREADS``, then ``python -m spark_torch.rank.function_main`` (or
``script_main``) runs in it exactly as in a cold start (the rank arms its own parent-death
signal). The child waits for the template's go before any of that: it comes only once the pid
reached the node runner, so a rank whose runner left mid-request never runs.

Settings Python, the dynamic loader, malloc and torch read when the interpreter starts cannot
change after the fork: the node runner keys templates by them and starts each template with
them (:mod:`spark_torch.node.warm`).

Failures stay with their connection, by construction: every event (a connection, a request, a
rank's exit, a runner leaving) is handled under one guard whose failure (a runner that left
before its answer, ``fork()`` refused by a pids limit, a request that does not parse, ...) closes
that connection only, releases its rank and logs one line to the template's stderr. The
template itself never runs user code, never initializes CUDA and never starts a thread, so
every run's ranks are forks of the same pristine process: nothing leaks from run to run.

Protocol (one JSON message per packet on a ``SOCK_SEQPACKET`` connection): the request
``{"argv", "env", "cwd", "umask", "rlimits", "idle"}`` with its descriptors
(``socket.send_fds``); the answers ``{"pid": N}`` or ``{"error": TEXT}`` (no rank: start it
cold), and later ``{"exit": CODE}`` (negative: killed by that signal).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import selectors
import signal
import socket
import struct
import sys
import time
from typing import Any, NoReturn

from spark_torch import envnames

__all__ = ["main", "THREAD_ENV", "MAX_REQUEST", "RLIMITS"]

#: the template's own thread pools: one thread each, so that it has no thread to lose in fork()
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
MAX_REQUEST = 4 << 20
#: at most this many file descriptors per request (stdin, stdout, stderr, two report pipes)
MAX_FDS = 8
#: the resource limits a rank gets from its node runner (a cold rank inherits them all)
RLIMITS = ("NOFILE", "CORE", "STACK", "AS", "DATA", "NPROC", "MEMLOCK", "CPU")
#: a connection that sent no request within this long is closed (a runner sends it at once)
REQUEST_SECONDS = 30.0
#: accept() failing for lack of descriptors: listen again after this long instead of spinning
ACCEPT_PAUSE_SECONDS = 0.5

_LISTENER = "listener"
_OWNER = "owner"


class _Rank:
    """One forked child (a rank or a store host) until it is reaped."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.pidfd: int | None = None  # readable once the child exited
        self.go: int | None = None  # the write end the child waits on before it becomes the rank
        self.client: _Client | None = None


class _Client:
    """One node runner's connection: first its request, then its rank's lifetime."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.since = time.monotonic()
        self.rank: _Rank | None = None
        self.closed = False


def _log(message: str) -> None:
    """One line to the template's stderr; a broken stderr must not end the template."""
    with contextlib.suppress(Exception):
        print(f"spark_torch template {os.getpid()}: {message}", file=sys.stderr, flush=True)


def _kill(pid: int) -> None:
    """SIGKILL a child and its process group (it may not have called setsid() yet). Safe
    against pid reuse: an unreaped child keeps its pid, and so the group id, taken."""
    for send in (os.killpg, os.kill):
        with contextlib.suppress(OSError):
            send(pid, signal.SIGKILL)


def _check_request(request: Any, fds: list[int]) -> dict[str, Any]:
    """The request, or ValueError naming what is wrong with it."""
    if not isinstance(request, dict) or len(fds) < 3:
        raise ValueError("a request is a JSON object with argv/env/cwd and at least 3 descriptors")
    argv, env = request.get("argv"), request.get("env")
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        raise ValueError("argv must be a non-empty list of strings")
    if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
        raise ValueError("env must map strings to strings")
    if not isinstance(request.get("cwd"), (str, type(None))) or not isinstance(request.get("umask"), (int, type(None))):
        raise ValueError("cwd must be a string and umask an integer")
    limits = request.get("rlimits", {})
    if not isinstance(limits, dict) or any(
        name not in RLIMITS or not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, int) for x in v))
        for name, v in limits.items()
    ):
        raise ValueError(f"rlimits must map names of {RLIMITS} to [soft, hard]")
    idle = request.get("idle")
    if idle is not None and (not isinstance(idle, (int, float)) or idle <= 0):
        raise ValueError("idle must be a positive number of seconds")
    return request


class _Template:
    def __init__(self, path: str, owner: int, idle: float | None) -> None:
        self.path = path
        self.idle = idle
        # SEQPACKET: a request arrives whole, with its descriptors, or not at all
        self.listener: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        if os.path.exists(path):
            os.unlink(path)  # a dead template's socket
        self.listener.bind(path)
        os.chmod(path, 0o600)
        info = os.stat(path)
        self.identity = (info.st_dev, info.st_ino)  # the path is ours to remove while it is this socket
        # a burst of node runners (many nodes on one executor) must queue, not be refused
        self.listener.listen(socket.SOMAXCONN)
        self.listener.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, _LISTENER)
        self.owner_fd = os.pidfd_open(owner)  # readable once the owner exits
        self.selector.register(self.owner_fd, selectors.EVENT_READ, _OWNER)
        self.clients: set[_Client] = set()
        self.ranks: dict[int, _Rank] = {}
        self.idle_since = time.monotonic()
        self.accept_paused_until: float | None = None
        self.owner_gone = False

    # -- the loop ----------------------------------------------------------------------------
    def serve(self) -> None:
        """Serve until the owner exits, or until idle with the socket gone and nothing left."""
        while not self.owner_gone:
            if self.listener is None and not self.clients and not self.ranks:
                return  # idle: the socket was removed and every connection served
            for key, _ in self.selector.select(self._timeout()):
                self._handle(key.data)
                if self.owner_gone:
                    break
            self._expire()
        self._shutdown()

    def _handle(self, what: Any) -> None:
        """One event, under the guard: its failure ends that connection only."""
        try:
            if what == _OWNER:
                self.owner_gone = True
            elif what == _LISTENER:
                if self.listener is not None:
                    self._accept()
            elif isinstance(what, _Client):
                if not what.closed:  # its rank's exit, earlier in this batch, may have closed it
                    self._on_client(what)
            elif isinstance(what, _Rank):
                self._on_exit(what)
        except Exception as exc:  # noqa: BLE001 - the guard: one connection, never the template
            self._failed(what, exc)

    def _failed(self, what: Any, exc: Exception) -> None:
        if isinstance(what, _Client):
            _log(f"closed a node runner's connection: {type(exc).__name__}: {exc}")
        elif isinstance(what, _Rank):
            _log(f"lost track of child {what.pid}: {type(exc).__name__}: {exc}")
        else:
            _log(f"{what}: {type(exc).__name__}: {exc}")
        if isinstance(what, _Client):
            if what.rank is None:  # still waiting for its answer: tell it why (it starts the rank cold)
                with contextlib.suppress(Exception):
                    what.conn.send(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
            self._close(what, kill=True)
        elif isinstance(what, _Rank):
            self._forget(what)
            if what.client is not None:
                self._close(what.client, kill=False)
        elif what == _LISTENER:
            self._pause_accepting()

    def _timeout(self) -> float | None:
        """Until the next deadline: a request due, the idle timeout, accepting again."""
        deadlines = [c.since + REQUEST_SECONDS for c in self.clients if c.rank is None]
        if self.idle is not None and self.listener is not None and not self.ranks and not self.clients:
            deadlines.append(self.idle_since + self.idle)
        if self.accept_paused_until is not None:
            deadlines.append(self.accept_paused_until)
        if any(r.pidfd is None for r in self.ranks.values()):
            deadlines.append(time.monotonic() + 0.5)  # no pidfd to wake us: look again soon
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _expire(self) -> None:
        now = time.monotonic()
        for client in [c for c in self.clients if c.rank is None and now - c.since > REQUEST_SECONDS]:
            self._failed(client, TimeoutError(f"no request within {REQUEST_SECONDS:g}s"))
        for rank in [r for r in self.ranks.values() if r.pidfd is None]:
            self._handle(rank)
        if self.accept_paused_until is not None and now >= self.accept_paused_until and self.listener is not None:
            self.accept_paused_until = None
            with contextlib.suppress(Exception):
                self.selector.register(self.listener, selectors.EVENT_READ, _LISTENER)
        if (
            self.idle is not None and self.listener is not None and not self.ranks and not self.clients
            and now - self.idle_since >= self.idle
        ):
            self._stop_listening()

    # -- connections and requests ------------------------------------------------------------
    def _accept(self) -> bool:
        """Take one connection from the queue; False when none is waiting."""
        assert self.listener is not None
        try:
            conn, _ = self.listener.accept()
        except BlockingIOError:
            return False
        except OSError as exc:  # EMFILE, ENFILE, ENOBUFS: the queue waits
            _log(f"cannot accept a connection now: {exc}")
            self._pause_accepting()
            return False
        client = _Client(conn)
        try:
            conn.setblocking(False)
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            if struct.unpack("3i", creds)[1] != os.getuid():
                conn.close()
                return True
            self.clients.add(client)
            self.selector.register(conn, selectors.EVENT_READ, client)
        except Exception as exc:  # noqa: BLE001 - this connection only
            _log(f"closed a new connection: {type(exc).__name__}: {exc}")
            self._close(client, kill=False)
        return True

    def _pause_accepting(self) -> None:
        """accept() fails (no descriptors left): stop listening for a moment instead of
        spinning on a listener that stays readable; connections wait in the queue."""
        if self.listener is not None and self.accept_paused_until is None:
            with contextlib.suppress(Exception):
                self.selector.unregister(self.listener)
            self.accept_paused_until = time.monotonic() + ACCEPT_PAUSE_SECONDS

    def _on_client(self, client: _Client) -> None:
        if client.rank is not None:
            self._on_runner_event(client)
            return
        try:
            message, fds, flags, _ = socket.recv_fds(client.conn, MAX_REQUEST, MAX_FDS)
        except BlockingIOError:
            return
        try:
            if not message and not fds:
                self._close(client, kill=False)  # it left without asking
                return
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise ValueError(f"a request over {MAX_REQUEST} bytes or {MAX_FDS} descriptors")
            request = _check_request(json.loads(message.decode("utf-8")), fds)
            if request.get("idle") is not None:
                self.idle = float(request["idle"])  # the latest run's setting
            self._start_rank(client, request, fds)
        finally:
            for fd in fds:  # the child has its own copies; a refused request's are closed here
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _start_rank(self, client: _Client, request: dict[str, Any], fds: list[int]) -> None:
        go_r, go_w = os.pipe()
        template = os.getpid()
        try:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            pid = os.fork()
        except BaseException:
            os.close(go_r)
            os.close(go_w)
            raise
        if pid == 0:
            os.close(go_w)
            self._leave_in_child()
            _become_rank(request, fds, go_r, template)
        os.close(go_r)
        rank = _Rank(pid)
        rank.go = go_w
        self.ranks[pid] = rank
        try:
            pidfd = os.pidfd_open(pid)
            try:
                self.selector.register(pidfd, selectors.EVENT_READ, rank)
            except BaseException:
                os.close(pidfd)
                raise
            rank.pidfd = pidfd
        except Exception as exc:  # noqa: BLE001 - reaped by polling instead (see _timeout)
            _log(f"no pidfd for child {pid}: {exc}")
        try:
            client.conn.send(json.dumps({"pid": pid}).encode())
        except BaseException:
            self._release(rank)  # its runner never learns of it: it must not run
            raise
        # the runner has the pid: the child may become the rank
        rank.client, client.rank = client, rank
        go, rank.go = rank.go, None
        try:
            os.write(go, b"g")
        finally:
            os.close(go)

    def _on_runner_event(self, client: _Client) -> None:
        """A node runner's connection is readable while its rank runs: it closed (the runner
        died, and its rank goes with it, as a rank started by the runner would), or it sent
        something it should not have (ignored)."""
        try:
            if client.conn.recv(1):
                return
        except BlockingIOError:
            return
        except OSError:
            pass
        self._close(client, kill=True)

    def _close(self, client: _Client, *, kill: bool) -> None:
        """Close one connection (idempotent, never raises); ``kill``: its rank goes too."""
        if client.closed:
            return
        client.closed = True
        self.clients.discard(client)
        with contextlib.suppress(Exception):
            self.selector.unregister(client.conn)
        with contextlib.suppress(Exception):
            client.conn.close()
        rank, client.rank = client.rank, None
        if rank is not None:
            rank.client = None
            if kill:
                _kill(rank.pid)

    # -- children ----------------------------------------------------------------------------
    def _release(self, rank: _Rank) -> None:
        """A child whose runner will never know it: without the go it exits by itself (and
        is killed in case it got further); it stays listed until it is reaped."""
        if rank.go is not None:
            with contextlib.suppress(OSError):
                os.close(rank.go)
            rank.go = None
        _kill(rank.pid)

    def _on_exit(self, rank: _Rank) -> None:
        """A child's pidfd is readable (or it has none): reap it and tell its runner."""
        if self.ranks.get(rank.pid) is not rank:
            return  # reaped earlier in this batch
        try:
            pid, status = os.waitpid(rank.pid, os.WNOHANG)
        except ChildProcessError:  # reaped already: nothing more to learn
            pid, status = rank.pid, 255 << 8
        if pid == 0:
            return
        self._forget(rank)
        client = rank.client
        if client is not None:
            try:
                client.conn.send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
            finally:
                self._close(client, kill=False)

    def _forget(self, rank: _Rank) -> None:
        self.ranks.pop(rank.pid, None)
        if rank.pidfd is not None:
            with contextlib.suppress(Exception):
                self.selector.unregister(rank.pidfd)
            with contextlib.suppress(OSError):
                os.close(rank.pidfd)
            rank.pidfd = None
        if rank.go is not None:
            with contextlib.suppress(OSError):
                os.close(rank.go)
            rank.go = None
        if not self.ranks:
            self.idle_since = time.monotonic()

    def _leave_in_child(self) -> None:
        """In the forked child: drop every object of the template that holds a descriptor
        (the rest are closed by number in :func:`_become_rank`)."""
        with contextlib.suppress(Exception):
            self.selector.close()
        if self.listener is not None:
            self.listener.close()
        for client in self.clients:
            client.conn.close()

    # -- the end -----------------------------------------------------------------------------
    def _owns_path(self) -> bool:
        try:
            info = os.stat(self.path)
        except OSError:
            return False
        return (info.st_dev, info.st_ino) == self.identity

    def _stop_listening(self) -> None:
        """Idle: remove the socket (a new runner starts a new template), then serve whoever
        connected before that, and end once they are done."""
        if self._owns_path():
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        assert self.listener is not None
        while self._accept():  # whoever is queued already gets served
            pass
        with contextlib.suppress(Exception):
            self.selector.unregister(self.listener)
        self.listener.close()
        self.listener = None

    def _shutdown(self) -> None:
        """The owner is gone: stop every rank still running and remove the socket."""
        for pid in list(self.ranks):
            _kill(pid)
        if self.listener is not None and self._owns_path():
            with contextlib.suppress(OSError):
                os.unlink(self.path)


def _close_other_fds(keep: set[int]) -> None:
    """Close every descriptor but ``keep``: nothing of the template reaches the rank."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)


def _become_rank(request: dict[str, Any], fds: list[int], go: int, template: int) -> NoReturn:
    """In the forked child: turn into the rank described by ``request`` (never returns)."""
    code = 1
    try:
        os.setsid()  # first: the template can kill this child's group from now on
        if os.read(go, 1) != b"g":  # the runner never got our pid: do not run
            os._exit(1)
        os.close(go)
        _die_with_template(template)
        stdin, stdout, stderr, *extra = fds
        for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
            os.dup2(fd, target)
        _close_other_fds({0, 1, 2, *extra})
        for name, (soft, hard) in request.get("rlimits", {}).items():  # the runner's, as a cold rank's
            resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), (soft, hard))
        if request.get("umask") is not None:
            os.umask(request["umask"])
        env = dict(request["env"])
        if extra:
            env[envnames.REPORT_FDS] = ",".join(str(fd) for fd in extra)
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


def _die_with_template(template: int) -> None:
    """Every child dies with the template (SIGKILL), whatever module it runs: ranks arm this
    themselves too, the store host does not; exit now if the template is already gone."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != template:
        os._exit(1)


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


def main(argv: list[str]) -> int:
    """Import torch, listen on ``argv[0]``, print ``ready`` and serve until process ``argv[1]``
    exits or, with ``argv[2]``, until that many seconds pass with no rank running."""
    os.environ.update(THREAD_ENV)
    import runpy  # noqa: F401 - used by the children

    from spark_torch.rank import function_main, script_main  # noqa: F401 - the children's entry points, imported once

    try:
        import torch  # noqa: F401 - the point: ranks start with it imported
        import torch.distributed  # noqa: F401
    except ImportError:
        pass
    idle = float(argv[2]) if len(argv) > 2 and argv[2] not in ("", "none") else None
    template = _Template(argv[0], int(argv[1]), idle)
    print("ready", flush=True)
    template.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
