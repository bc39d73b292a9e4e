"""Node-runner side of warm rank starts (:mod:`spark_torch.node.template.server`): one template per
interpreter, torch installation, owner, interpreter-start settings and hard resource limits,
started on first use and reused by later runs. The owner is the driver process in local mode and
the executor JVM in a Spark task, so all Python workers of an executor share one template (Spark
starts new Python workers as it likes; each would otherwise start its own). Templates listen in
a private directory, ``$TMPDIR/spark_torch_templates-<uid>`` (``/tmp/...`` when a socket's path
there would pass ``AF_UNIX``'s 107 bytes; if that is another user's or others may use it: a
private folder of this process, with one WARNING); the first process to need one
starts it under a file lock, the others connect to it (a burst of connections queues, with a
deadline). A template ends with its owner, or after the run's ``warm_start_idle`` seconds
with no rank running; this process reaps the templates it started.

What a rank would read when its interpreter starts (:data:`~spark_torch.node.template.protocol.STARTUP_PREFIXES`)
cannot change
after a fork, so the template is keyed by those settings of the rank's environment and started
with them; the node runner's resource limits and umask go with each request and are applied in
the child. A setting no template can honour makes that rank start cold.

The ``warm_start`` setting (:mod:`spark_torch.settings`) turns warm starts off; so does any
failure to start or reach the template (with one warning): ranks then start cold, as separate
interpreters.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import select
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from importlib import metadata

import psutil

from spark_torch.base.envnames import SCRUBBED
from spark_torch.node.template.protocol import (
    cold_reason,
    runner_affinity,
    runner_ignored_signals,
    runner_limits,
    runner_priority,
    runner_umask,
    startup_env,
)
from spark_torch.shared.owned_files import private_folder

__all__ = [
    "WarmProcess",
    "warm_spawn",
    "template_socket",
    "TEMPLATE_MODULE",
]

logger = logging.getLogger(__name__)

#: importing torch in the template on a cold page cache (or with many workers starting at once)
#: can take several seconds
READY_SECONDS = 60.0
#: how long a connection may wait in a busy template's listen queue
CONNECT_SECONDS = 30.0
#: how long a request may wait for its answer (the template forks one rank at a time)
ANSWER_SECONDS = 30.0
TEMPLATE_MODULE = "spark_torch.node.template.server"
#: the folder of template sockets (``NAME-UID``, :func:`~spark_torch.shared.owned_files.private_folder`)
SOCKET_FOLDER = "spark_torch_templates"
#: where that folder goes when the temporary directory's path is too long for a socket in it
SHORT_TEMP = "/tmp"
#: the longest path of a Unix socket (``sun_path``: 108 bytes with its NUL)
MAX_SOCKET_PATH = 107
#: a socket's name in the folder: 20 hex digits of its key and ``.sock``
SOCKET_NAME_CHARS = 25


class WarmProcess:
    """A rank forked by the template, seen like a ``subprocess.Popen`` (pid, poll, wait)."""

    def __init__(self, conn: socket.socket, pid: int, args: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._conn = conn
        self._done = threading.Event()
        threading.Thread(target=self._await_exit, name=f"spark-torch-warm-{pid}", daemon=True).start()

    def _await_exit(self) -> None:
        try:
            data = self._conn.recv(4096)
            message = json.loads(data.decode()) if data else {}
            code = message.get("exit")
            self.returncode = code if isinstance(code, int) else _lost(self.pid)
        except (OSError, ValueError):
            self.returncode = _lost(self.pid)
        finally:
            self._conn.close()
            self._done.set()

    def poll(self) -> int | None:
        """The exit code if the rank exited, else None."""
        return self.returncode if self._done.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the rank to exit; raises ``subprocess.TimeoutExpired`` after ``timeout``."""
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode


def _lost(pid: int) -> int:
    """The template went away before reporting: the rank is gone with it (SIGKILL)."""
    return -9


def _owner() -> psutil.Process:
    """Whose lifetime a template shares: inside a Spark task, the executor JVM (every Python
    worker of the executor then shares one template, and Spark's reuse or replacement of its
    Python workers does not matter); elsewhere (the driver in local mode) this process."""
    me = psutil.Process()
    task_context = sys.modules.get("pyspark.taskcontext")
    if task_context is not None and task_context.TaskContext.get() is not None:
        try:
            for parent in me.parents():
                if parent.name() == "java" or os.path.basename(parent.exe()) == "java":
                    return parent
        except (psutil.Error, OSError):
            pass
    return me


def _fits(folder: str) -> bool:
    """Whether a template's socket in ``folder`` fits ``AF_UNIX``'s path limit."""
    return len(os.fsencode(os.path.join(folder, "x" * SOCKET_NAME_CHARS))) <= MAX_SOCKET_PATH


def _socket_dir() -> str:
    """This user's private directory of template sockets (created 0700; another user's, or one
    others may use, is refused for a private folder of this process: a WARNING names it): in the
    temporary directory, or in :data:`SHORT_TEMP` when a socket's path there would not fit (a
    YARN container's temporary directory is 100-130 characters long)."""
    default = os.path.join(tempfile.gettempdir(), f"{SOCKET_FOLDER}-{os.getuid()}")
    if not _fits(default):
        return private_folder(SOCKET_FOLDER, base=SHORT_TEMP)
    folder = private_folder(SOCKET_FOLDER)
    return folder if _fits(folder) else private_folder(SOCKET_FOLDER, base=SHORT_TEMP)  # a longer fallback


def template_socket(python: str, env: Mapping[str, str], owner: psutil.Process) -> str:
    """Where the template for a rank of ``python`` with environment ``env`` listens: one per
    interpreter, torch installation, owner (its pid and start time: a reused pid is another
    owner), interpreter-start settings of ``env``, hard resource limits (a child can lower
    them, never raise them), nice value, ``oom_score_adj``, scheduling policy and I/O class
    (likewise: :func:`~spark_torch.node.template.protocol.runner_priority`) and the signals it
    ignores (:func:`~spark_torch.node.template.protocol.runner_ignored_signals`)."""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = ""
    hard = {name: limits[1] for name, limits in runner_limits().items()}
    identity = "\0".join(
        (
            python,
            torch_version,
            str(owner.pid),
            repr(owner.create_time()),
            json.dumps(sorted(startup_env(env).items())),
            json.dumps(sorted(hard.items())),
            json.dumps(sorted(runner_priority().items())),
            json.dumps(runner_ignored_signals()),
        )
    )
    return os.path.join(_socket_dir(), hashlib.sha256(identity.encode()).hexdigest()[: SOCKET_NAME_CHARS - 5] + ".sock")


def _connect(path: str) -> socket.socket | None:
    """A connection to the template listening at ``path``, or None when none listens there.
    The template must run as this user (``SO_PEERCRED``), as it checks of us."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        # Blocking, with a send timeout: while a busy template's listen queue is full the kernel
        # lets connect() wait (woken as the template accepts) up to SO_SNDTIMEO. Python's own
        # timeout would make the socket non-blocking, and a non-blocking AF_UNIX connect fails
        # at once with EAGAIN.
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(CONNECT_SECONDS), 0))
        conn.connect(path)
    except (FileNotFoundError, ConnectionRefusedError):
        conn.close()
        return None
    except BlockingIOError:
        conn.close()
        raise OSError(
            f"the warm-start template at {path} did not take a connection within {CONNECT_SECONDS:g}s"
        ) from None
    except BaseException:
        conn.close()
        raise
    uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
    if uid != os.getuid():
        conn.close()
        raise OSError(f"the warm-start template at {path} runs as user {uid}, not as this user")
    return conn


@contextmanager
def _creation_lock(directory: str) -> Iterator[None]:
    """Only one process at a time starts a template (the others wait, with a deadline): a lock
    on the socket directory itself, so no lock file is left behind."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        seconds = READY_SECONDS + 5.0
        deadline = time.monotonic() + seconds
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"another process held {directory} for {seconds:g}s while starting a template "
                        "(a template that cannot import torch in time? warm_start=false starts ranks cold)"
                    ) from None
                time.sleep(0.02)
        yield
    finally:
        os.close(fd)  # releases the lock


def _start_template(
    python: str, env: dict[str, str], path: str, owner: int, idle: float | None
) -> subprocess.Popen[bytes]:
    """Start a template listening at ``path`` for ``owner``'s lifetime; wait until it is ready."""
    process = subprocess.Popen(
        [python, "-m", TEMPLATE_MODULE, path, str(owner), "none" if idle is None else repr(float(idle))],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=None,  # its rare one-line reports go where this process's do (the executor's log)
        start_new_session=True,  # neither Ctrl-C on the driver's terminal nor a killed worker's group takes it down
        close_fds=True,
        cwd="/",
    )
    assert process.stdout is not None
    try:
        ready, _, _ = select.select([process.stdout], [], [], READY_SECONDS)
        line = process.stdout.readline() if ready else b""
    finally:
        process.stdout.close()
    if line.strip() != b"ready":
        process.kill()
        process.wait(5.0)
        raise RuntimeError(
            f"the warm-start template did not start within {READY_SECONDS:g}s (exit status {process.returncode}; "
            "warm_start=false starts ranks cold)"
        )
    # reap it when it ends (idle, or its owner gone): no zombie for the life of this process
    threading.Thread(target=_reap, args=(process,), name=f"spark-torch-template-{process.pid}", daemon=True).start()
    return process


def _reap(process: subprocess.Popen[bytes]) -> None:
    process.wait()


def _spawn(
    conn: socket.socket,
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str | None,
    fds: Sequence[int],
    idle: float | None,
) -> WarmProcess:
    try:
        request = {
            "argv": list(argv),
            "env": dict(env),
            "cwd": cwd or os.getcwd(),
            "umask": runner_umask(),
            "rlimits": runner_limits(),
            "affinity": runner_affinity(),
            "idle": idle,
        }
        conn.settimeout(ANSWER_SECONDS)
        socket.send_fds(conn, [json.dumps(request).encode()], list(fds))
        data = conn.recv(4096)
        answer = json.loads(data.decode()) if data else {"error": "the template closed the connection"}
        if "pid" not in answer:
            raise OSError(f"the template started no rank: {answer.get('error', answer)}")
        pid = int(answer["pid"])
    except BaseException:
        conn.close()
        raise
    conn.settimeout(None)
    return WarmProcess(conn, pid, argv)


#: templates this process does not try (socket path -> until when, monotonic): one that failed
#: to start, for good; one that did not take a connection or answer in time, for a while
_avoid: dict[str, float] = {}
#: how long a template that did not answer in time is left alone
AVOID_SECONDS = 60.0


def _template_env(env: Mapping[str, str]) -> dict[str, str]:
    """The template's own environment: this process's, none of Spark's secrets, and the rank's
    interpreter-start settings (nothing else rank-specific: each rank gets its own environment
    after the fork)."""
    keep = {k: v for k, v in os.environ.items() if k not in SCRUBBED and k not in startup_env(os.environ)}
    keep.update(startup_env(env))
    return keep


def _template_connection(python: str, env: Mapping[str, str], idle: float | None) -> tuple[str, socket.socket]:
    """The socket path of the owner's template for ``env`` and a connection to it (the
    template started first if none listens)."""
    owner = _owner()
    path = template_socket(python, env, owner)
    if _avoid.get(path, 0.0) > time.monotonic():
        raise RuntimeError("its template failed to start or answer earlier")
    try:
        conn = _connect(path)
    except OSError:
        _avoid[path] = time.monotonic() + AVOID_SECONDS
        raise
    if conn is not None:
        return path, conn
    with _creation_lock(os.path.dirname(path)):
        conn = _connect(path)  # another process may have started it meanwhile
        if conn is None:
            try:
                _start_template(python, _template_env(env), path, owner.pid, idle)  # reaped by its own thread
            except BaseException:
                _avoid[path] = float("inf")
                raise
            conn = _connect(path)
    if conn is None:
        raise RuntimeError(f"the warm-start template started but does not listen at {path}")
    return path, conn


def warm_spawn(
    python: str,
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str | None,
    fds: Sequence[int],
    *,
    idle: float | None = None,
) -> WarmProcess | None:
    """Fork a rank from the template of this process's owner (the driver, or the executor) for
    ``env``'s interpreter-start settings, starting it on first use (to end after ``idle``
    seconds with no rank running; None: with its owner only); None when no template can be
    used (the caller starts the rank cold)."""
    if not sys.platform.startswith("linux"):
        return None
    module_argv = list(argv[2:]) if list(argv[1:2]) == ["-m"] else None
    if module_argv is None:
        return None
    reason = cold_reason(env)
    if reason is not None:
        logger.info("spark_torch: starting this rank cold: %s", reason)
        return None
    try:
        path, conn = _template_connection(python, env, idle)
    except (OSError, RuntimeError, psutil.Error) as exc:
        logger.warning("spark_torch: warm rank starts are off for this rank (%s); starting it cold", exc)
        return None
    try:
        return _spawn(conn, module_argv, env, cwd, fds, idle)
    except TimeoutError as exc:
        _avoid[path] = time.monotonic() + AVOID_SECONDS
        logger.warning("spark_torch: the warm-start template did not answer (%s); starting this rank cold", exc)
    except (OSError, ValueError, KeyError) as exc:
        logger.warning("spark_torch: the warm-start template failed (%s); starting this rank cold", exc)
    return None
