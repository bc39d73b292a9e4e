"""The warm-start template: a process that has imported torch and forks ranks on request.

``python -m spark_torch.node.template.server SOCKET OWNER_PID [IDLE_SECONDS]`` imports torch (and
spark_torch's rank entry points) once, with every thread pool at one thread so that it has no
thread but its main one, listens on a Unix socket in a private (0700) directory, and answers
requests from node runners (its peer must be the same user: ``SO_PEERCRED``). It lives as long
as its owner (the driver in local mode; the executor JVM in distributed mode, so every Python
worker of an executor shares it), watched through a pidfd: no polling; and it stops taking
ranks once idle: no rank running, ``IDLE_SECONDS`` after it started and each request's ``idle``
after that request's rank ended (several runs may share a template: each keeps it its own idle
time after its own last rank, so the longest wins, a shorter one never cuts another run's, and
each one expires; every idle time is clamped to 24 h). If a node runner goes away while its rank
runs (its connection closes), the template kills that rank's process group.

A request carries the rank's argv, environment, working directory, umask and resource limits
(the node runner's, as a cold rank would inherit them) and, as passed file descriptors, its
stdin, stdout, stderr and report pipes. The template forks; the child becomes the rank: a new
session, those descriptors as 0/1/2 and every other descriptor closed, the limits and umask, the
rank's environment, directory and ``sys.argv``, its node's marker written where
/proc/PID/environ shows it (a fork shows the template's block otherwise; the template runs with
room for it), fresh random seeds, torch's thread count from the rank's ``OMP_NUM_THREADS``, then
``python -m spark_torch.rank.function_main`` (or ``script_main``) runs in it exactly as in a cold start (the rank
arms its own parent-death signal). The child waits for the template's go before any of that: it comes only once the
pid reached the node runner, so a rank whose runner left mid-request never runs.

Settings Python, the dynamic loader, malloc and torch read when the interpreter starts cannot
change after the fork: the node runner keys templates by them and starts each template with
them (:mod:`spark_torch.node.template.client`).

Failures stay with their connection, by construction: every event (a connection, a request, a
rank's exit, a runner leaving) is handled under one guard whose failure (a runner that left
before its answer, ``fork()`` refused by a pids limit, a request that does not parse, ...) closes
that connection only, releases its rank and logs one line to the template's stderr. A failure of
the loop itself (a bug) logs one line, removes the socket (the next rank starts a new template)
and serves the ranks running until they end; a second one ends the template, its ranks and its
socket. The template itself never runs user code, never initializes CUDA and never starts a
thread, so every run's ranks are forks of the same pristine process: nothing leaks from run to run.

Elsewhere: the protocol, its checks and keying rules (:mod:`~spark_torch.node.template.protocol`),
the child's side (``child``), what it keeps per child and connection (``state``), what a keeper
SIGKILLed before it stopped its rank's tree hands on to the template, a child subreaper
(``adopted``). Here: the event loop (connections, requests, forks, exits, idle end), read whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import socket
import struct
import sys
import time
from typing import Any

from spark_torch.base.envnames import MARK_SLOT
from spark_torch.base.prctl import become_subreaper
from spark_torch.node.template.adopted import Adopted
from spark_torch.node.template.child import become_rank, environ_slot, with_mark_slot
from spark_torch.node.template.protocol import MAX_FDS, MAX_REQUEST, THREAD_ENV, check_request, clamp_idle
from spark_torch.node.template.state import Client, Rank, kill_group, log

__all__ = ["main"]

#: a connection that sent no request within this long is closed (a runner sends it at once)
REQUEST_SECONDS = 30.0
#: accept() failing for lack of descriptors: listen again after this long instead of spinning
ACCEPT_PAUSE_SECONDS = 0.5

_LISTENER = "listener"
_OWNER = "owner"


class _Template:
    def __init__(self, path: str, owner: int, idle: float | None, slot: int | None = None) -> None:
        self.path = path
        #: where each child writes its node's marker (:func:`main` finds it); None: no child is started
        self.slot = slot
        #: stop listening at this time (monotonic) once no rank runs; None: only with the owner
        self.idle_until: float | None = None
        self._keep_idle(idle)
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
        self.clients: set[Client] = set()
        self.ranks: dict[int, Rank] = {}
        self.accept_paused_until: float | None = None
        self.owner_gone = False
        self.adopted = Adopted()  # what a SIGKILLed keeper left (the template is a child subreaper)

    # -- the loop ----------------------------------------------------------------------------
    def serve(self) -> None:
        """Serve until the owner exits, or until idle with the socket gone and nothing left.
        Whatever way it ends, the socket is removed and no rank is left running."""
        try:
            while not self.owner_gone:
                if self.listener is None and not self.clients and not self.ranks:
                    return  # idle: the socket was removed and every connection served
                try:
                    self._turn()
                except Exception as exc:
                    if self.listener is None:
                        raise  # failed again: give up
                    log(
                        f"stopped taking ranks after a failure of its loop ({type(exc).__name__}: {exc}); "
                        "the next rank starts a new template"
                    )
                    self._stop_listening()
        finally:
            self._shutdown()

    def _turn(self) -> None:
        """One wait for events, their handling, and the deadlines."""
        for key, _ in self.selector.select(self._timeout()):
            self._handle(key.data)
            if self.owner_gone:
                return
        self._expire()

    def _handle(self, what: Any) -> None:
        """One event, under the guard: its failure ends that connection only."""
        try:
            if what == _OWNER:
                self.owner_gone = True
            elif what == _LISTENER:
                if self.listener is not None:
                    self._accept()
            elif isinstance(what, Client):
                if not what.closed:  # its rank's exit, earlier in this batch, may have closed it
                    self._on_client(what)
            elif isinstance(what, Rank):
                self._on_exit(what)
        except Exception as exc:  # noqa: BLE001 - the guard: one connection, never the template
            self._failed(what, exc)

    def _failed(self, what: Any, exc: Exception) -> None:
        if isinstance(what, Client):
            log(f"closed a node runner's connection: {type(exc).__name__}: {exc}")
        elif isinstance(what, Rank):
            log(f"lost track of child {what.pid}: {type(exc).__name__}: {exc}")
        else:
            log(f"{what}: {type(exc).__name__}: {exc}")
        if isinstance(what, Client):
            if what.rank is None:  # still waiting for its answer: tell it why (it starts the rank cold)
                with contextlib.suppress(Exception):
                    what.conn.send(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode())
            self._close(what, kill=True)
        elif isinstance(what, Rank):
            self._forget(what)
            if what.client is not None:
                self._close(what.client, kill=False)
        elif what == _LISTENER:
            self._pause_accepting()

    def _timeout(self) -> float | None:
        """Until the next deadline: a request due, the idle timeout, accepting again."""
        deadlines = [c.since + REQUEST_SECONDS for c in self.clients if c.rank is None]
        if self.idle_until is not None and self.listener is not None and not self.ranks and not self.clients:
            deadlines.append(self.idle_until)
        if self.accept_paused_until is not None:
            deadlines.append(self.accept_paused_until)
        if self.adopted.pending or any(r.pidfd is None for r in self.ranks.values()):
            deadlines.append(time.monotonic() + 0.5)  # no pidfd to wake us: look again soon
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _expire(self) -> None:
        now = time.monotonic()
        for client in [c for c in self.clients if c.rank is None and now - c.since > REQUEST_SECONDS]:
            self._failed(client, TimeoutError(f"no request within {REQUEST_SECONDS:g}s"))
        for rank in [r for r in self.ranks.values() if r.pidfd is None]:
            self._handle(rank)
        if self.adopted.pending:
            self.adopted.sweep(self.ranks)
        if self.accept_paused_until is not None and now >= self.accept_paused_until and self.listener is not None:
            self.accept_paused_until = None
            with contextlib.suppress(Exception):
                self.selector.register(self.listener, selectors.EVENT_READ, _LISTENER)
        if (
            self.idle_until is not None
            and self.listener is not None
            and not self.ranks
            and not self.clients
            and now >= self.idle_until
        ):
            self._stop_listening()

    def _keep_idle(self, idle: float | None) -> None:
        """Keep listening ``idle`` seconds from now at least (a rank ended, or the template started)."""
        if idle is not None:
            until = time.monotonic() + clamp_idle(idle)
            self.idle_until = until if self.idle_until is None else max(self.idle_until, until)

    # -- connections and requests ------------------------------------------------------------
    def _accept(self) -> bool:
        """Take one connection from the queue; False when none is waiting."""
        assert self.listener is not None
        try:
            conn, _ = self.listener.accept()
        except BlockingIOError:
            return False
        except OSError as exc:  # EMFILE, ENFILE, ENOBUFS: the queue waits
            log(f"cannot accept a connection now: {exc}")
            self._pause_accepting()
            return False
        client = Client(conn)
        try:
            conn.setblocking(False)
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            if struct.unpack("3i", creds)[1] != os.getuid():
                conn.close()
                return True
            self.clients.add(client)
            self.selector.register(conn, selectors.EVENT_READ, client)
        except Exception as exc:  # noqa: BLE001 - this connection only
            log(f"closed a new connection: {type(exc).__name__}: {exc}")
            self._close(client, kill=False)
        return True

    def _pause_accepting(self) -> None:
        """accept() fails (no descriptors left): stop listening for a moment instead of
        spinning on a listener that stays readable; connections wait in the queue."""
        if self.listener is not None and self.accept_paused_until is None:
            with contextlib.suppress(Exception):
                self.selector.unregister(self.listener)
            self.accept_paused_until = time.monotonic() + ACCEPT_PAUSE_SECONDS

    def _on_client(self, client: Client) -> None:
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
            request = check_request(json.loads(message.decode("utf-8")), fds)
            self._start_rank(client, request, fds)
        finally:
            for fd in fds:  # the child has its own copies; a refused request's are closed here
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _start_rank(self, client: Client, request: dict[str, Any], fds: list[int]) -> None:
        if self.slot is None:  # its children could not be found by their node's marker: the rank starts cold
            raise RuntimeError(f"no room for the node's marker ({MARK_SLOT}) in the template's environment")
        slot = self.slot
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
            become_rank(request, fds, go_r, template, slot)
        os.close(go_r)
        rank = Rank(pid)
        rank.go, rank.idle = go_w, request.get("idle")
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
            log(f"no pidfd for child {pid}: {exc}")
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

    def _on_runner_event(self, client: Client) -> None:
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

    def _close(self, client: Client, *, kill: bool) -> None:
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
                kill_group(rank.pid)

    # -- children ----------------------------------------------------------------------------
    def _release(self, rank: Rank) -> None:
        """A child whose runner will never know it: without the go it exits by itself (and
        is killed in case it got further); it stays listed until it is reaped."""
        if rank.go is not None:
            with contextlib.suppress(OSError):
                os.close(rank.go)
            rank.go = None
        kill_group(rank.pid)

    def _on_exit(self, rank: Rank) -> None:
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
        if os.WIFSIGNALED(status):  # a keeper killed before it stopped what its rank left
            self.adopted.sweep(self.ranks)
        client = rank.client
        if client is not None:
            try:
                client.conn.send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
            finally:
                self._close(client, kill=False)

    def _forget(self, rank: Rank) -> None:
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
        self._keep_idle(rank.idle)

    def _leave_in_child(self) -> None:
        """In the forked child: drop every object of the template that holds a descriptor
        (the rest are closed by number in :func:`~spark_torch.node.template.child.become_rank`)."""
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
            kill_group(pid)
        self.adopted.sweep(self.ranks)
        if self.listener is not None and self._owns_path():
            with contextlib.suppress(OSError):
                os.unlink(self.path)


def main(argv: list[str]) -> int:
    """Import torch, listen on ``argv[0]``, print ``ready`` and serve until process ``argv[1]``
    exits or, with ``argv[2]``, until that many seconds pass with no rank running."""
    with_mark_slot()
    os.environ.update(THREAD_ENV)
    import runpy  # noqa: F401 - used by the children

    from spark_torch.rank import function_main, script_main  # noqa: F401 - the children's entry points, imported once

    try:
        import torch  # noqa: F401 - the point: ranks start with it imported
        import torch.distributed  # noqa: F401
    except ImportError:
        pass
    idle = float(argv[2]) if len(argv) > 2 and argv[2] not in ("", "none") else None
    # a template that cannot mark its children does not start (the ranks start cold)
    template = _Template(argv[0], int(argv[1]), idle, environ_slot())
    become_subreaper()  # after the import: what torch's import may start is no orphan of a rank
    print("ready", flush=True)
    try:
        template.serve()
    except Exception as exc:  # noqa: BLE001 - its socket is removed: the next rank starts a new template
        log(f"ended after a second failure of its loop ({type(exc).__name__}: {exc})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
