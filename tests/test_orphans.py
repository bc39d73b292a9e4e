"""Nothing a rank starts outlives its run: each rank runs under its keeper
(:mod:`spark_torch.node.keeper`), a child subreaper, so a descendant that double-forks and
execs with an empty environment (no node marker to find it by, no session or group of the
rank's) is re-parented to the keeper and stopped, warm and cold, whether the run succeeds or
fails, while the user's process stays no subreaper."""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import uuid
from typing import Any

import psutil
import pytest

from spark_torch import DistributedRunError, Distributor


def double_fork_a_sleep(seconds: str, fail: bool) -> dict[str, Any]:
    """A rank whose shell starts ``sleep`` in the background with an empty environment and a
    session of its own, then exits: the sleep is an orphan that carries nothing of the run."""
    subprocess.run(["/bin/sh", "-c", f"sleep {seconds} >/dev/null 2>&1 </dev/null &"], env={}, start_new_session=True, check=True)
    sleeper = next(p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", seconds])
    seen = {"parent": " ".join(psutil.Process(sleeper.ppid()).cmdline()), "environ": sleeper.environ()}
    if fail:
        raise RuntimeError(f"the rank failed after its orphan was adopted by {seen['parent']}")
    return seen


def _sleepers(seconds: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if proc.info["cmdline"] == ["sleep", seconds] and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


@pytest.mark.parametrize("fail", [False, True], ids=["success", "failure"])
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_a_double_forked_orphan_with_an_empty_environment_is_stopped(warm: bool, fail: bool, no_leftovers: None) -> None:
    seconds = f"{1000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**6}"
    try:
        distributor = Distributor(num_processes=1, warm_start=warm)
        if fail:
            with pytest.raises(DistributedRunError, match="the rank failed after its orphan was adopted by"):
                distributor.run(double_fork_a_sleep, seconds, True)
        else:
            seen = distributor.run(double_fork_a_sleep, seconds, False)
            assert "SPARK_TORCH_RUN_ID" not in seen["environ"]  # nothing to find it by but its ancestry
            assert ("spark_torch.node.template.server" in seen["parent"]) is warm  # its keeper: a fork of the template
            assert warm or "spark_torch.node.keeper" in seen["parent"]
        assert _sleepers(seconds) == [], "the rank's double-forked orphan outlived the run"
    finally:
        for proc in _sleepers(seconds):
            with contextlib.suppress(psutil.Error):
                proc.kill()


def test_the_users_process_is_no_subreaper(no_leftovers: None) -> None:
    """Local mode runs the node runner in the user's process: it must not inherit orphans."""
    Distributor(num_processes=1).run(print, "ok")
    Distributor(num_processes=1, warm_start=False).run(print, "ok")
    libc = ctypes.CDLL(None, use_errno=True)
    flag = ctypes.c_int(-1)
    assert libc.prctl(37, ctypes.byref(flag), 0, 0, 0) == 0  # PR_GET_CHILD_SUBREAPER
    assert flag.value == 0
    assert os.getpid() == psutil.Process().pid
