"""Node-runner side of warm rank starts (:mod:`spark_torch.node.template_main`): one template per
interpreter, import path, torch installation and owner, started on first use and reused by
later runs. The owner is the driver process in local mode and the executor JVM in a Spark task,
so all Python workers of an executor share one template (Spark starts new Python workers as it
likes; each would otherwise start its own). Templates listen in a private directory,
``$TMPDIR/spark_torch_templates-<uid>``; the first process to need one starts it under a file
lock, the others connect to it.

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
import stat
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

from spark_torch.envnames import SCRUBBED

__all__ = ["WarmProcess", "warm_spawn", "shutdown_templates", "TEMPLATE_MODULE"]

logger = logging.getLogger(__name__)

#: importing torch in the template on a cold page cache can take several seconds
READY_SECONDS = 60.0
TEMPLATE_MODULE = "spark_torch.node.template_main"


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


def _socket_dir() -> str:
    """This user's private directory of template sockets (created 0700; refused if another
    user owns it or others may write to it)."""
    path = os.path.join(tempfile.gettempdir(), f"spark_torch_templates-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise OSError(f"{path} is not a private directory of this user (owner {info.st_uid}, mode {oct(info.st_mode)})")
    return path


def _socket_path(python: str, env: Mapping[str, str], owner: psutil.Process) -> str:
    """One template per interpreter, import path, torch installation and owner (its pid and
    start time: a reused pid is another owner)."""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = ""
    identity = "\0".join((python, env.get("PYTHONPATH", ""), torch_version, str(owner.pid), repr(owner.create_time())))
    return os.path.join(_socket_dir(), hashlib.sha256(identity.encode()).hexdigest()[:20] + ".sock")


def _connect(path: str) -> socket.socket | None:
    """A connection to the template listening at ``path``, or None when none listens there.
    The template must run as this user (``SO_PEERCRED``), as it checks of us."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.settimeout(10.0)
        conn.connect(path)
    except (FileNotFoundError, ConnectionRefusedError):
        conn.close()
        return None
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
        deadline = time.monotonic() + READY_SECONDS + 5.0
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"another process held {directory} for {READY_SECONDS + 5.0:g}s while starting a template") from None
                time.sleep(0.02)
        yield
    finally:
        os.close(fd)  # releases the lock


def _start_template(python: str, env: dict[str, str], path: str, owner: int) -> subprocess.Popen[bytes]:
    """Start a template listening at ``path`` for ``owner``'s lifetime; wait until it is ready."""
    process = subprocess.Popen(
        [python, "-m", TEMPLATE_MODULE, path, str(owner)],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # neither Ctrl-C on the driver's terminal nor a killed worker's group takes it down
        close_fds=True,
        cwd="/",
    )
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], READY_SECONDS)
    line = process.stdout.readline() if ready else b""
    process.stdout.close()
    if line.strip() != b"ready":
        process.kill()
        process.wait(5.0)
        raise RuntimeError(f"the warm-start template did not start within {READY_SECONDS:g}s")
    return process


def _spawn(conn: socket.socket, argv: Sequence[str], env: Mapping[str, str], cwd: str | None, fds: Sequence[int]) -> WarmProcess:
    try:
        request = {"argv": list(argv), "env": dict(env), "cwd": cwd or os.getcwd()}
        socket.send_fds(conn, [json.dumps(request).encode()], list(fds))
        answer = json.loads(conn.recv(4096).decode())
        pid = int(answer["pid"])
    except BaseException:
        conn.close()
        raise
    conn.settimeout(None)
    return WarmProcess(conn, pid, argv)


#: templates this process started (it is their parent and reaps them)
_started: list[subprocess.Popen[bytes]] = []
_lock = threading.Lock()
#: a template failed to start in this process: do not try again
_broken = False


def _template_env(env: Mapping[str, str]) -> dict[str, str]:
    """The template's own environment: the rank's import path, none of Spark's secrets, and
    nothing rank-specific (each rank gets its own environment after the fork)."""
    keep = {k: v for k, v in os.environ.items() if k not in SCRUBBED}
    keep["PYTHONPATH"] = env.get("PYTHONPATH", "")
    return keep


def _template_connection(python: str, env: Mapping[str, str]) -> socket.socket:
    """A connection to the owner's template, started first if none listens."""
    owner = _owner()
    path = _socket_path(python, env, owner)
    conn = _connect(path)
    if conn is not None:
        return conn
    with _lock, _creation_lock(os.path.dirname(path)):
        conn = _connect(path)  # another process may have started it meanwhile
        if conn is None:
            _started.append(_start_template(python, _template_env(env), path, owner.pid))
            conn = _connect(path)
    if conn is None:
        raise RuntimeError(f"the warm-start template started but does not listen at {path}")
    return conn


def warm_spawn(
    python: str, argv: Sequence[str], env: Mapping[str, str], cwd: str | None, fds: Sequence[int]
) -> WarmProcess | None:
    """Fork a rank from the template of this process's owner (the driver, or the executor),
    starting it on first use; None when the template cannot be used (the caller starts the
    rank cold)."""
    global _broken
    if _broken or not sys.platform.startswith("linux"):
        return None
    module_argv = list(argv[2:]) if list(argv[1:2]) == ["-m"] else None
    if module_argv is None:
        return None
    try:
        conn = _template_connection(python, env)
    except (OSError, RuntimeError, psutil.Error) as exc:
        _broken = True
        logger.warning("spark_torch: warm rank starts are off for this process (%s)", exc)
        return None
    try:
        return _spawn(conn, module_argv, env, cwd, fds)
    except (OSError, ValueError, KeyError) as exc:
        logger.warning("spark_torch: the warm-start template failed (%s); starting this rank cold", exc)
        return None


def shutdown_templates() -> None:
    """Stop the templates this process started (tests; templates also end with their owner)."""
    with _lock:
        started = list(_started)
        _started.clear()
    for process in started:
        if process.poll() is None:
            process.kill()
        try:
            process.wait(5.0)
        except subprocess.TimeoutExpired:
            pass

