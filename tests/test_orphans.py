"""Nothing a rank starts outlives its run: each rank runs under its keeper
(:mod:`spark_torch.node.keeper`), a child subreaper, so a descendant that double-forks and
execs with an empty environment (no node marker to find it by, no session or group of the
rank's) is re-parented to the keeper and stopped, warm and cold, whether the run succeeds or
fails, while the user's process stays no subreaper. A tree at any depth (shells that wait on
shells, a shell that ignores SIGTERM) is stopped whole within the grace, and a rank may send
any signal to its own process group (the keeper's too) and still finish."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
import uuid
from typing import Any

import psutil
import pytest

from spark_torch import DistributedRunError, Distributor
from spark_torch.base.grace import RANK_GRACE_SECONDS, STOP_MARGIN_SECONDS


def double_fork_a_sleep(seconds: str, fail: bool) -> dict[str, Any]:
    """A rank whose shell starts ``sleep`` in the background with an empty environment and a
    session of its own, then exits: the sleep is an orphan that carries nothing of the run."""
    subprocess.run(
        ["/bin/sh", "-c", f"sleep {seconds} >/dev/null 2>&1 </dev/null &"], env={}, start_new_session=True, check=True
    )
    # the shell has exited, but its background child may not have exec'd sleep yet (seen on a busy machine)
    deadline = time.monotonic() + 30
    while not (found := [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", seconds]]):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the shell's background 'sleep {seconds}' did not start within 30 s")
        time.sleep(0.01)
    sleeper = found[0]
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
def test_a_double_forked_orphan_with_an_empty_environment_is_stopped(
    warm: bool, fail: bool, no_leftovers: None
) -> None:
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


#: trees a rank leaves running when it returns, each ending in ``sleep SECONDS``
CHAINS = {
    # rank -> sh (wait) -> sh (wait) -> sleep: each shell dies on SIGTERM and hands its child on
    "nested-shells": "sh -c 'sleep {seconds} & wait' & wait",
    # rank -> sh (SIGTERM ignored, and so by its sleep too) -> sleep: only SIGKILL ends them
    "sigterm-ignored": "trap '' TERM; sleep {seconds} & wait",
}


def leave_a_tree_running(chain: str, seconds: str) -> dict[str, Any]:
    """Start ``chain`` through /bin/sh with an empty environment and return at once, leaving
    it running: what the sleep's ancestry was, and when the rank returned."""
    subprocess.Popen(
        ["/bin/sh", "-c", CHAINS[chain].format(seconds=seconds)],
        env={},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30.0
    while not (sleepers := _sleepers(seconds)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the chain's sleep {seconds} did not start within 30 s")
        time.sleep(0.01)
    ancestry, proc = [], sleepers[0]
    while proc.pid != os.getpid():
        proc = proc.parent()
        ancestry.append(proc.name())
    return {"ancestry": ancestry, "returned": time.time()}


@pytest.mark.parametrize("chain", sorted(CHAINS))
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_a_whole_tree_the_rank_leaves_is_stopped_within_the_grace(chain: str, warm: bool, no_leftovers: None) -> None:
    """The keeper stops every descendant at any depth, including what is re-parented to it
    while it stops the rest, and the run ends within the grace (plus the node's margin)."""
    seconds = f"{2000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**6}"
    try:
        seen = Distributor(num_processes=1, warm_start=warm).run(leave_a_tree_running, chain, seconds)
        took = time.time() - seen["returned"]
        assert seen["ancestry"][:-1] == (["sh", "sh"] if chain == "nested-shells" else ["sh"])
        assert _sleepers(seconds) == [], f"the {chain} tree's sleep outlived the run"
        assert took < RANK_GRACE_SECONDS + STOP_MARGIN_SECONDS, f"the run ended {took:.1f} s after the rank returned"
    finally:
        for proc in _sleepers(seconds):
            with contextlib.suppress(psutil.Error):
                proc.kill()


#: the signals a rank starts with at their default action (unless its driver started with them ignored)
_DEFAULTS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGALRM, signal.SIGTSTP)


def _handler(sig: signal.Signals) -> Any:
    """The signal's handler; coverage.py's own SIGTERM handler (``make coverage`` measures ranks
    with ``sigterm = true``, to save their data when stopped) stands for the default it wraps."""
    handler = signal.getsignal(sig)
    return signal.SIG_DFL if getattr(handler, "__qualname__", "") == "Coverage._on_sigterm" else handler


def signal_own_group(sigint_ignored: bool, inherited: list[str]) -> list[str]:
    """Handle SIGUSR1 and SIGHUP ("checkpoint now", "reload") and send each to this
    process's own group, as a rank tells its workers; what was handled. The rank starts with
    the handlers a rank without a keeper has (the keeper ignores what it can): Python's SIGINT
    handler, or SIGINT ignored when the driver was started with it ignored (``nohup``, a
    background job of a script), as any Python program it started would; the others at their
    default action, or ignored (``inherited``) where the driver started with them ignored
    (``nohup`` ignores SIGHUP)."""
    assert signal.getsignal(signal.SIGINT) is (signal.SIG_IGN if sigint_ignored else signal.default_int_handler)
    expected = {sig.name: signal.SIG_IGN if sig.name in inherited else signal.SIG_DFL for sig in _DEFAULTS}
    assert {sig.name: _handler(sig) for sig in _DEFAULTS} == expected
    handled: list[str] = []
    for sig in (signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: handled.append(signal.Signals(signum).name))
    for sig in (signal.SIGUSR1, signal.SIGHUP):
        os.killpg(0, sig)
        deadline = time.monotonic() + 30.0
        while sig.name not in handled:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{sig.name} sent to the group was not handled within 30 s")
            time.sleep(0.01)
    return handled


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_a_rank_may_signal_its_own_process_group(warm: bool, no_leftovers: None) -> None:
    """The keeper shares the rank's group and ignores what the rank sends it."""
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    inherited = [sig.name for sig in _DEFAULTS if signal.getsignal(sig) is signal.SIG_IGN]
    assert Distributor(num_processes=1, warm_start=warm).run(signal_own_group, ignored, inherited) == [
        "SIGUSR1",
        "SIGHUP",
    ]


def orphan_then_lose_the_keeper(seconds: str, ready: str) -> None:
    """Rank: leave a double-forked ``sleep`` (empty environment, its own session), say where the
    keeper is (``ready``: the rank's parent), then wait to be stopped."""
    subprocess.run(
        ["/bin/sh", "-c", f"sleep {seconds} >/dev/null 2>&1 </dev/null &"], env={}, start_new_session=True, check=True
    )
    with open(ready + ".tmp", "w") as fh:
        fh.write(str(os.getppid()))
    os.replace(ready + ".tmp", ready)
    time.sleep(3600)


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_a_keeper_killed_mid_run_fails_the_run_and_leaves_nothing(
    warm: bool, tmp_path: Any, no_leftovers: None
) -> None:
    """SIGKILL of a rank's keeper (the one signal it cannot ignore): the rank dies with it and the
    run fails at once with an error that says the rank was killed. Warm, the orphan the rank had
    left is re-parented to the template (a child subreaper too) and stopped with the run; cold,
    the keeper's parent is the node runner (the user's process in local mode, never a subreaper)
    and the orphan goes to init: the documented limit (docs/security.md), stopped here by the test."""
    seconds = f"{3000 + uuid.uuid4().int % 1000}.{uuid.uuid4().int % 10**6}"
    ready = str(tmp_path / "keeper")
    killed: list[float] = []

    def kill_the_keeper() -> None:
        deadline = time.monotonic() + 120.0
        while not os.path.exists(ready) and time.monotonic() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(OSError, ValueError):
            keeper = int(open(ready).read())
            assert "keeper" in " ".join(psutil.Process(keeper).cmdline()) or warm
            killed.append(time.monotonic())
            os.kill(keeper, signal.SIGKILL)

    import threading

    killer = threading.Thread(target=kill_the_keeper, daemon=True)
    killer.start()
    try:
        with pytest.raises(DistributedRunError) as info:
            Distributor(num_processes=2, warm_start=warm, timeout=300).run(orphan_then_lose_the_keeper, seconds, ready)
        ended = time.monotonic()
        killer.join(5.0)
        assert killed, "the keeper was never found"
        assert ended - killed[0] < 60.0, f"the run ended {ended - killed[0]:.0f}s after its keeper was killed"
        assert "SIGKILL" in str(info.value), str(info.value)
        if warm:  # cold: the limit (init, or whichever subreaper is above the test, adopts it)
            assert _sleepers(seconds) == [], "the rank's orphan outlived the run after its keeper was killed"
    finally:
        for proc in _sleepers(seconds):
            with contextlib.suppress(psutil.Error):
                proc.kill()
