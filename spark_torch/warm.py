"""Node-runner side of warm rank starts: one template per (interpreter, path, torch) and node
runner process, started on first use and reused by later runs (:mod:`spark_torch.template`).

``SPARK_TORCH_WARM_START=0`` turns warm starts off; so does any failure to start or reach the
template (with one warning): ranks then start cold, as separate interpreters.
"""

from __future__ import annotations

import json
import logging
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from importlib import metadata

from .env import SCRUBBED_ENV

__all__ = ["WarmProcess", "warm_spawn", "enabled", "WARM_ENV", "shutdown_templates"]

logger = logging.getLogger(__name__)

WARM_ENV = "SPARK_TORCH_WARM_START"
#: importing torch in the template on a cold page cache can take several seconds
READY_SECONDS = 60.0
TEMPLATE_MODULE = "spark_torch.template"


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether warm starts are on (``SPARK_TORCH_WARM_START``, default on)."""
    value = (environ if environ is not None else os.environ).get(WARM_ENV, "1").strip().lower()
    return value not in ("0", "false", "no", "off")


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


class _Template:
    """One running template process and its socket."""

    def __init__(self, python: str, env: dict[str, str]) -> None:
        self.directory = tempfile.mkdtemp(prefix="spark_torch_template-")  # 0700
        self.path = os.path.join(self.directory, "socket")
        self.process = subprocess.Popen(
            [python, "-m", TEMPLATE_MODULE, self.path, str(os.getpid())],  # it lives as long as this process
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C on the driver's terminal must not take it down
            close_fds=True,
            cwd=self.directory,
        )
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], READY_SECONDS)
        line = self.process.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            self.close()
            raise RuntimeError(f"the warm-start template did not start within {READY_SECONDS:g}s")

    def alive(self) -> bool:
        return self.process.poll() is None

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], cwd: str | None, fds: Sequence[int]) -> WarmProcess:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            conn.settimeout(10.0)
            conn.connect(self.path)
            request = {"argv": list(argv), "env": dict(env), "cwd": cwd or os.getcwd()}
            socket.send_fds(conn, [json.dumps(request).encode()], list(fds))
            answer = json.loads(conn.recv(4096).decode())
            pid = int(answer["pid"])
        except BaseException:
            conn.close()
            raise
        conn.settimeout(None)
        return WarmProcess(conn, pid, argv)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        try:
            self.process.wait(5.0)
        except subprocess.TimeoutExpired:
            pass
        if self.process.stdout is not None:
            self.process.stdout.close()
        shutil.rmtree(self.directory, ignore_errors=True)


_templates: dict[tuple[str, ...], _Template] = {}
_lock = threading.Lock()
#: a template failed to start in this process: do not try again
_broken = False


def _key(python: str, env: Mapping[str, str]) -> tuple[str, ...]:
    """A template serves ranks of the same interpreter, import path and torch installation."""
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = ""
    return (python, env.get("PYTHONPATH", ""), torch_version, str(os.getpid()))


def _template_env(env: Mapping[str, str]) -> dict[str, str]:
    """The template's own environment: the rank's import path, none of Spark's secrets, and
    nothing rank-specific (each rank gets its own environment after the fork)."""
    keep = {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}
    keep["PYTHONPATH"] = env.get("PYTHONPATH", "")
    return keep


def warm_spawn(
    python: str, argv: Sequence[str], env: Mapping[str, str], cwd: str | None, fds: Sequence[int]
) -> WarmProcess | None:
    """Fork a rank from this process's template (starting it on first use); None when warm
    starts are off or the template cannot be used (the caller starts the rank cold)."""
    global _broken
    if _broken or not enabled() or not sys.platform.startswith("linux"):
        return None
    module_argv = list(argv[2:]) if list(argv[1:2]) == ["-m"] else None
    if module_argv is None:
        return None
    key = _key(python, env)
    with _lock:
        template = _templates.get(key)
        if template is not None and not template.alive():
            template.close()  # killed between runs: start a new one
            template = None
        if template is None:
            try:
                template = _templates[key] = _Template(python, _template_env(env))
            except (OSError, RuntimeError) as exc:
                _broken = True
                logger.warning("spark_torch: warm rank starts are off for this process (%s)", exc)
                return None
    try:
        return template.spawn(module_argv, env, cwd, fds)
    except (OSError, ValueError, KeyError) as exc:
        logger.warning("spark_torch: the warm-start template failed (%s); starting ranks cold", exc)
        with _lock:
            if _templates.get(key) is template:
                del _templates[key]
        template.close()
        return None


def shutdown_templates() -> None:
    """Stop every template of this process (tests; the templates also die with their parent)."""
    with _lock:
        templates = list(_templates.values())
        _templates.clear()
    for template in templates:
        template.close()

