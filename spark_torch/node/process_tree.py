"""Stop a rank's whole process tree, bounded in time, without ever signalling a stranger.

A rank runs in its own process group (session). Its children usually stay in that group, but a
data-loader worker or a script's daemon may start a session of its own, and once the rank has
exited its orphans are no longer its descendants. So what belongs to a node is found three ways:
each rank (checked by its creation time, so a recycled pid is never signalled), its live
descendants, and every process that carries the node's marker in its environment (the run id,
node rank and this attempt's random token, which every rank's children inherit: another run
given the same run id, or the next attempt, has another token). Process groups are signalled only while their
leader is the rank itself. Used by the node runner and by the reaper (no torch, no pyspark).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable, Mapping

import psutil

__all__ = ["GroupRef", "create_time", "find_marked", "snapshot", "terminate_trees"]

#: a rank to stop: (pid = its process group id, its creation time as psutil reports it)
GroupRef = tuple[int, float]


def create_time(pid: int) -> float:
    """The creation time psutil reports for ``pid`` (0.0 if it is gone)."""
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return 0.0


def _same_process(ref: GroupRef) -> psutil.Process | None:
    pid, created = ref
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - created) < 0.01:
            return proc
    except psutil.Error:
        pass
    return None


def find_marked(marker: Mapping[str, str]) -> list[psutil.Process]:
    """Processes (of this user) whose environment holds every ``marker`` item."""
    if not marker:
        return []
    found = []
    me = os.getpid()
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            env = proc.environ()
        except psutil.Error:
            continue
        if all(env.get(key) == value for key, value in marker.items()):
            found.append(proc)
    return found


def snapshot(
    refs: Iterable[GroupRef], marker: Mapping[str, str] | None = None
) -> tuple[list[psutil.Process], list[int]]:
    """The processes of a node right now, and the process groups still safe to ``killpg``
    (their leader is the very rank that was started)."""
    found: dict[int, psutil.Process] = {}
    groups = []
    for ref in refs:
        leader = _same_process(ref)
        if leader is None:
            continue
        groups.append(ref[0])
        found[leader.pid] = leader
        try:
            for child in leader.children(recursive=True):
                found[child.pid] = child
        except psutil.Error:
            pass
    for proc in find_marked(marker or {}):
        found.setdefault(proc.pid, proc)
    me = os.getpid()
    return [p for pid, p in found.items() if pid != me], groups


def _signal(procs: Iterable[psutil.Process], sig: int) -> None:
    for proc in procs:
        try:
            proc.send_signal(sig)  # psutil refuses a pid that is no longer this process
        except psutil.Error:
            pass


def _stopped(proc: psutil.Process) -> bool:
    """The process is stopped (SIGSTOP, a debugger: state T)."""
    try:
        return proc.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False


def _live(proc: psutil.Process) -> bool:
    """Running and not a zombie (one waits for its parent, which is being stopped or reaps it)."""
    try:
        return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def terminate_trees(
    refs: Iterable[GroupRef], grace: float, kill_wait: float = 5.0, marker: Mapping[str, str] | None = None
) -> list[psutil.Process]:
    """SIGTERM everything of the node (processes and safe groups), wait up to ``grace``
    seconds, look again (a dying rank may have started something), SIGKILL what is below the
    ranks (each a keeper: a child subreaper) again and again until nothing is left there, then
    the ranks and their groups; all within ``kill_wait``. A keeper killed first would hand what
    its tree forks meanwhile to init. Returns what is still alive then (e.g. stuck in the kernel)."""
    refs = list(refs)
    procs, groups = snapshot(refs, marker)
    if not procs and not groups:  # the usual end of a run: everything already exited
        return []
    for pgid in groups:
        _killpg(pgid, signal.SIGTERM)
    _signal(procs, signal.SIGTERM)
    _signal([p for p in procs if _stopped(p)], signal.SIGKILL)  # it cannot act on SIGTERM: no grace to wait out
    _, alive = psutil.wait_procs(procs, timeout=max(0.0, grace))
    leaders = {ref[0] for ref in refs}
    deadline = time.monotonic() + kill_wait
    while True:  # SIGKILL below the ranks (their keepers) until nothing is left there, then them
        later, groups = snapshot(refs, marker)
        below = [p for p in later if p.pid not in leaders and _live(p)]
        if not below or time.monotonic() >= deadline:
            break
        _signal(below, signal.SIGKILL)
        psutil.wait_procs(below, timeout=0.05)
    known = {p.pid for p in alive}
    alive += [p for p in later if p.pid not in known and p.is_running()]
    for pgid in groups:
        _killpg(pgid, signal.SIGKILL)
    _signal(alive, signal.SIGKILL)
    _, still = psutil.wait_procs(alive, timeout=max(1.0, deadline - time.monotonic()))
    return list(still)
