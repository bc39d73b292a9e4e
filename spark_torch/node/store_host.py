"""Node 0's side of the hosted rendezvous store (:mod:`spark_torch.node.store_host_main`).

With warm starts the store host is a fork of the template (torch already imported, about
20 ms); when the template cannot be used it is started cold (an interpreter that imports torch,
waited for before the ranks start). Either way it listens on the node's own address only, never
on every interface (torch's own server, in rank 0, would). With warm starts off, or when it
cannot be hosted (it did not say "ready" in time), rank 0 hosts the store itself before the
user's code, on the node's address too (:mod:`spark_torch.rank.store`, told by
``SPARK_TORCH_HOST_STORE``); the ranks of other nodes are clients either way, so only node 0's
ranks are told (``TORCHELASTIC_USE_AGENT_STORE``).
"""

from __future__ import annotations

import logging
import os
import select
import subprocess
import sys
from collections.abc import Mapping

from spark_torch.base.envnames import PARENT_PID, SCRUBBED
from spark_torch.base.grace import STORE_HOST_GRACE_SECONDS
from spark_torch.node.process_tree import create_time, terminate_trees
from spark_torch.node.processes import with_package_on_path
from spark_torch.node.template.client import WarmProcess, warm_spawn
from spark_torch.shared.spec import RunSpec

__all__ = ["StoreHost", "host_store", "start_store_host"]

logger = logging.getLogger(__name__)

STORE_MODULE = "spark_torch.node.store_host_main"
#: a fork of the template is listening within milliseconds; this only bounds a broken one
READY_SECONDS = 10.0
#: a cold store host imports torch first
COLD_READY_SECONDS = 60.0


class StoreHost:
    """A running store host; :meth:`close` stops it (idempotent)."""

    def __init__(self, process: WarmProcess | subprocess.Popen[bytes]) -> None:
        self.process = process
        self.created = create_time(process.pid)  # its identity: a reused pid is never signalled

    @property
    def pid(self) -> int:
        """The store host's process id (its own process group)."""
        return self.process.pid

    def close(self) -> None:
        """Stop the store like a rank (SIGTERM, a short grace, SIGKILL) and reap it, bounded.
        Also when its template went away first (it reports the store as lost, the store may
        still run): the process is found by pid and creation time, never a reused pid."""
        terminate_trees([(self.process.pid, self.created)], grace=STORE_HOST_GRACE_SECONDS)
        if self.process.poll() is not None:
            return
        try:
            self.process.wait(STORE_HOST_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            logger.warning("spark_torch: the rendezvous store host %d did not exit after SIGKILL", self.process.pid)


def host_store(
    python: str,
    port: int,
    world_size: int,
    env: Mapping[str, str],
    cwd: str | None,
    idle: float | None = None,
    *,
    host: str = "127.0.0.1",
    warm: bool = True,
) -> StoreHost | None:
    """Start the store for ``world_size`` ranks on ``host:port``, forked from the template when
    ``warm`` and it can be, else cold; None when it cannot be hosted here (the ranks then fall
    back to rank 0 hosting it). ``idle``: see :func:`warm_spawn`."""
    out_r, out_w = os.pipe()
    null = os.open(os.devnull, os.O_RDWR)
    clean_env = {k: v for k, v in env.items() if k not in SCRUBBED}
    argv = [python, "-m", STORE_MODULE, str(port), str(world_size), host]
    process: WarmProcess | subprocess.Popen[bytes] | None = None
    try:
        if warm:
            process = warm_spawn(python, argv, clean_env, cwd, [null, out_w, null], idle=idle)
        seconds = READY_SECONDS
        if process is None:
            seconds = COLD_READY_SECONDS
            process = subprocess.Popen(
                argv,
                env={**clean_env, PARENT_PID: str(os.getpid())},
                cwd=cwd,
                stdin=null,
                stdout=out_w,
                stderr=null,
                start_new_session=True,
                close_fds=True,
            )
    except BaseException:
        os.close(out_r)
        raise
    finally:
        os.close(out_w)
        os.close(null)
    store = StoreHost(process)
    try:
        ready, _, _ = select.select([out_r], [], [], seconds)
        line = os.read(out_r, 64) if ready else b""
    finally:
        os.close(out_r)
    if line.strip() != b"ready":
        store.close()
        logger.warning(
            "spark_torch: the rendezvous store host did not start on %s:%d in time; rank 0 hosts the store itself",
            host,
            port,
        )
        return None
    return store


def hosts_store(run: RunSpec) -> bool:
    """Whether node 0 hosts the run's store before the ranks start (on the node's own address; a
    rank that calls ``init_process_group`` then opens no store of its own): with warm starts,
    whatever the world size (a fork, about 20 ms). Cold, a store host would import torch before
    any rank could start (measured 4-5 s on a busy 2-core host, against 0.4-0.6 s for a whole
    cold run of a function that does not import torch), so rank 0 hosts it before the user's
    code, on the node's address (:mod:`spark_torch.rank.store`)."""
    return run.world_size >= 1 and run.settings.warm_start


def start_store_host(
    run: RunSpec, port: int, cwd: str | None, python: str = sys.executable, host: str = "127.0.0.1"
) -> StoreHost | None:
    """Node 0: host the run's rendezvous store on ``host:port`` before any rank starts (None:
    not hosted; rank 0 hosts it as usual). Its environment has the ranks' import path, so it is
    forked from the same warm-start template (started cold when that template cannot be used)."""
    if not hosts_store(run):
        return None
    # the interpreter-start settings the ranks get (rank_env: PYTHONUNBUFFERED=1 unless the
    # user's env says otherwise), so that the store host forks from the ranks' template
    env = with_package_on_path({**os.environ, "PYTHONUNBUFFERED": "1", **run.extra_env})
    return host_store(
        python, port, run.world_size, env, cwd, run.settings.warm_start_idle, host=host, warm=run.settings.warm_start
    )
