"""Stall detection on the driver: the run is stalled when no rank made progress for
``stall_timeout`` seconds.

The nodes send snapshots of their ranks (:class:`~spark_torch.shared.stacks.RankStack`: where each is,
how long it made no progress, whether its sampler still answers); :class:`StallWatch` keeps the
latest per rank, and a thread checks them. Ranks no node has reported yet are in set-up
(staging, the rendezvous, downloading a resume checkpoint): that phase is never a stall (its
deadlines are ``rendezvous_timeout`` and the run's ``timeout``). On a stall it logs one WARNING
with every rank's stack, grouped; while the stall lasts, one short line per ``stall_timeout``
(the stacks again only when one changed); one line when the run moves again (never when it is
stopped: a timeout, an interruption, ``stall_action="fail"``), and the stall on the status line.
With ``stall_action="fail"`` it stops the attempt (``stop``) and :meth:`StallWatch.verdict` is the
:class:`~spark_torch.driver.run.outcome.DriverStop` the attempt ends with (the controller makes
it a :class:`~spark_torch.RunStalledError`). Timeouts and interruptions take
their stacks from here too (:meth:`StallWatch.stacks`), shown once, in their exception.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from spark_torch.base.states import StopReason
from spark_torch.driver.run.flight_recorder import FlightRecorder, TraceDir
from spark_torch.driver.run.outcome import DriverStop, Stacks
from spark_torch.reporting.api import NOT_EVERY_RANK
from spark_torch.shared.stacks import RankStack, StackState, format_stacks, innermost_call, rank_ranges, report_deadlock

__all__ = ["StallWatch", "note_stacks"]

logger = logging.getLogger(__name__)

#: with stall_action="fail", how long the ranks' Flight Recorder traces may take to arrive
#: before the attempt is stopped
TRACE_WAIT_SECONDS = 3.0


#: with stall_action="fail", how long the true stacks of the ranks that do not answer (a native
#: call holding the GIL) may take to arrive once the attempt is to be stopped
NATIVE_STACK_WAIT_SECONDS = 3.0


#: ranks in report() while every other rank waits this long in a collective: a deadlock of report()
#: under ``if rank == 0:`` (a collective of other ranks that just takes long is a few seconds at most)
REPORT_DEADLOCK_SECONDS = 5.0


class StallWatch:
    """The stall detector of one attempt of ``world_size`` ranks (see the module docstring)."""

    def __init__(
        self,
        world_size: int,
        timeout: float,
        action: str = "warn",
        *,
        stop: Callable[[StopReason], None] | None = None,
        on_status: Callable[[float | None], None] | None = None,
        trace_dir: TraceDir | None = None,
        request_traces: Callable[[bool], None] | None = None,
    ) -> None:
        self.world_size = world_size
        #: the ranks' Flight Recorder traces, asked for when a stall is found
        self.recorder = FlightRecorder(world_size, trace_dir)
        #: asks the nodes for those traces (True: the ranks are about to be stopped, and those that
        #: do not answer may be signalled for their true stacks)
        self.request_traces = request_traces
        self.timeout = timeout
        self.action = action
        self._stop = stop
        self._on_status = on_status
        self._lock = threading.Lock()
        self._latest: dict[int, tuple[RankStack, float]] = {}
        self._frozen = False
        #: monotonic time the current stall was first seen (None: not stalled)
        self._stalled_since: float | None = None
        self._warned_at = 0.0
        #: the stacks the last full warning showed ({rank: (text, state)})
        self._shown: dict[int, tuple[str, StackState]] = {}
        #: set once ``stall_action="fail"`` stopped the attempt
        self.failed = threading.Event()
        self._verdict: DriverStop | None = None
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        if timeout > 0:
            self._thread = threading.Thread(target=self._loop, name="spark-torch-stall-watch", daemon=True)
            self._thread.start()

    def update(self, node: int, snapshot: Any) -> None:
        """A node's snapshot: a list of :class:`RankStack` dicts (malformed entries are skipped)."""
        now = time.monotonic()
        if not isinstance(snapshot, list):
            return
        with self._lock:
            if self._frozen:
                return
            for item in snapshot:
                try:
                    stack = RankStack.from_dict(item)
                except (KeyError, TypeError, ValueError):
                    continue
                if 0 <= stack.rank < self.world_size:
                    self._latest[stack.rank] = (stack, now)

    def trace(self, rank: Any, data: bytes) -> None:
        """A rank's Flight Recorder trace, as a node sent it (queued, never raises:
        :class:`~spark_torch.driver.run.flight_recorder.FlightRecorder`)."""
        self.recorder.receive(rank, data)

    def _ask_for_traces(self, wait: float = 0.0) -> None:
        """Ask the nodes for the ranks' traces; wait up to ``wait`` seconds for every running rank's."""
        running = {s.rank for s in self.current() if s.state is not StackState.EXITED}
        request = self.request_traces
        self.recorder.ask(None if request is None else lambda: request(False), running, wait)

    def _traces_note(self) -> str:
        return self.recorder.note() if self.request_traces is not None else ""

    def freeze(self) -> None:
        """Keep the stacks as they are now: the ranks are about to be stopped (timeout, stall,
        interruption), and what they show while stopping is not where they were."""
        with self._lock:
            self._frozen = True

    def current(self) -> list[RankStack]:
        """Every rank's latest stack, its idle time and age brought up to now."""
        now = time.monotonic()
        stacks = []
        with self._lock:
            for rank in range(self.world_size):
                known = self._latest.get(rank)
                if known is None:  # its node is still setting up: never idle
                    stacks.append(RankStack(rank, "", 0.0, StackState.STARTING))
                else:
                    stack, received = known
                    late = now - received
                    stacks.append(
                        RankStack(rank, stack.text, stack.idle + late, stack.state, stack.age + late, stack.output)
                    )
        return stacks

    def stacks(self) -> Stacks:
        """Where each rank was, from the latest snapshots; empty when stall detection is off or
        no node sent one."""
        with self._lock:
            known = bool(self._latest)
        if not known:
            return Stacks()
        current = self.current()
        return Stacks({s.rank: s.text for s in current}, format_stacks(current))

    def _message(self, idle: float, stacks: list[RankStack]) -> str:
        return (
            f"spark_torch: no rank made progress for {idle:.0f}s (stall_timeout={self.timeout:g}s); "
            f"where each rank is, innermost call last:\n{format_stacks(stacks)}"
        )

    def check(self) -> None:
        """One look at the ranks (the watch thread calls it about once a second)."""
        stacks = self.current()
        if not stacks:
            return
        if all(s.state is StackState.EXITED for s in stacks):
            with self._lock:
                frozen = self._frozen
            if not frozen:
                self._moved_again()  # the ranks ended by themselves
            return
        deadlock = report_deadlock(stacks, REPORT_DEADLOCK_SECONDS)
        if deadlock is not None and not self.failed.is_set():
            self._fail_in_report(*deadlock, stacks)
            return
        idle = min(s.idle for s in stacks)
        if idle < self.timeout:
            self._moved_again()
            return
        first = self._stalled_since is None
        if first:
            self._stalled_since = time.monotonic() - (idle - self.timeout)
        if self._on_status is not None:
            self._on_status(idle)
        if first:
            self._ask_for_traces(wait=TRACE_WAIT_SECONDS if self.action == "fail" else 0.0)
        if self.action == "fail":
            if not self.failed.is_set():
                self._fail()
            return
        self._warn(idle, stacks, first)

    def _fail(self) -> None:
        stacks = self.current()  # after the wait for the traces: the idle time it really is
        idle = min(s.idle for s in stacks)
        if idle < self.timeout:  # a rank moved meanwhile
            self._moved_again()
            return
        stacks = self._native_stacks(stacks)
        # one line: the stacks and the traces are said once, by the error this verdict becomes (or,
        # with restarts left, by the controller's "restarting" warning)
        logger.warning(
            "spark_torch: no rank made progress for %.0fs (stall_timeout=%gs); stall_action='fail': stopping the run",
            idle,
            self.timeout,
        )
        self._verdict = DriverStop(
            StopReason.STALLED,
            headline=f"the run stalled: no rank made progress for {idle:.0f}s (stall_timeout={self.timeout:g}s), "
            "so it was stopped (stall_action='fail'). Look at where each rank was, below: ranks waiting in "
            "different collectives, or one rank elsewhere while the others wait, is the usual cause "
            "(docs/troubleshooting.md, 'A run that hangs')",
            stacks=Stacks({s.rank: s.text for s in stacks}, format_stacks(stacks) + self._traces_note()),
        )
        self.failed.set()
        self.freeze()
        if self._stop is not None:
            self._stop(StopReason.STALLED)

    def _native_stacks(self, stacks: list[RankStack]) -> list[RankStack]:
        """The attempt is stopped now: the ranks that do not answer may be signalled for their
        true stacks (faulthandler; the signal would cut a sleeping system call short, which no
        longer matters). ``stacks`` again once every such rank's changed, or after a few seconds."""
        silent = {s.rank: s.text for s in stacks if s.state is StackState.NOT_ANSWERING}
        if not silent or self.request_traces is None:
            return stacks
        try:
            self.request_traces(True)
        except Exception:  # noqa: BLE001 - extra: the stop must go on
            logger.debug("spark_torch: could not ask for the native stacks", exc_info=True)
            return stacks
        deadline = time.monotonic() + NATIVE_STACK_WAIT_SECONDS
        while time.monotonic() < deadline and not self._closed.wait(0.1):
            now = {s.rank: s for s in self.current()}
            if all(now[rank].text != text for rank, text in silent.items()):
                break
        idle = {s.rank: s.idle for s in stacks}  # the verdict's idle times: the decision was made above
        return [RankStack(s.rank, s.text, idle[s.rank], s.state, s.age, s.output) for s in self.current()]

    def _fail_in_report(self, in_report: list[int], elsewhere: list[RankStack], stacks: list[RankStack]) -> None:
        """Some ranks wait in report() while the others wait in a collective: neither can go on,
        whatever ``stall_action`` says; the attempt ends as the error of that misuse."""
        where = innermost_call(elsewhere[0].text)
        headline = (
            f"{NOT_EVERY_RANK}, the same number of times: rank(s) {rank_ranges(in_report)} wait in report() while "
            f"rank(s) {rank_ranges(s.rank for s in elsewhere)} did not call it and wait in {where} for "
            f"{min(s.idle for s in elsewhere):.0f}s; neither can go on. Call report() on every rank (pass checkpoint= "
            "only on the ranks that have files to save), not under `if rank == 0:`"
        )
        logger.warning("spark_torch: %s; stopping the run", headline)
        self._verdict = DriverStop(
            StopReason.REPORT_DEADLOCK,
            headline=headline,
            stacks=Stacks({s.rank: s.text for s in stacks}, format_stacks(stacks)),
        )
        self.failed.set()
        self.freeze()
        if self._stop is not None:
            self._stop(StopReason.REPORT_DEADLOCK)

    def _warn(self, idle: float, stacks: list[RankStack], first: bool) -> None:
        """The stacks once per stall (again when one changed), else a short line per stall_timeout."""
        now = time.monotonic()
        if not first and now - self._warned_at < self.timeout:
            return
        self._warned_at = now
        shown = {s.rank: (s.text, s.state) for s in stacks}
        if not first and shown == self._shown:
            logger.warning("spark_torch: still stalled after %.0fs; ranks unchanged", idle)
            return
        self._shown = shown
        logger.warning(
            "%s%s\nThe run goes on (stall_action='warn'); stall_action='fail' stops such a run, "
            "stall_timeout changes when this is said (docs/troubleshooting.md, 'A run that hangs')",
            self._message(idle, stacks),
            self._traces_note() if first else "",
        )

    def verdict(self) -> DriverStop:
        """Why this watch stopped the attempt (after :attr:`failed` is set)."""
        assert self._verdict is not None, "verdict() before the watch stopped the attempt"
        return self._verdict

    def _loop(self) -> None:
        while not self._closed.wait(min(1.0, max(0.1, self.timeout / 10))):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - a detector must never break the run it watches
                logger.debug("spark_torch: stall check failed", exc_info=True)

    def close(self) -> None:
        """Stop watching. A stall that ended with the ranks ending by themselves gets its "moves
        again" line; one the attempt was stopped in (timeout, interruption, fail) does not."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(2.0)
        self.recorder.close()
        with self._lock:
            stopped = self._frozen
        if stopped:
            self._stalled_since = None
            if self._on_status is not None:
                self._on_status(None)
        else:
            self._moved_again()

    def _moved_again(self) -> None:
        """The one line that ends a stall (if there is one), and the status line without it."""
        if self._stalled_since is None:
            return
        logger.warning(
            "spark_torch: the run moves again after %.0fs without progress", time.monotonic() - self._stalled_since
        )
        self._stalled_since = None
        if self._on_status is not None:
            self._on_status(None)


def note_stacks(interrupt: BaseException, stall: StallWatch) -> None:
    """Where the ranks were when the run was interrupted (Ctrl-C, the notebook's stop button):
    on the exception (``stacks``, and a note under its traceback), not again in the log."""
    stall.freeze()
    stacks = stall.stacks()
    if stacks.text:  # in the exception only: its traceback shows it once
        interrupt.stacks = stacks.by_rank  # type: ignore[attr-defined]
        interrupt.add_note(f"spark_torch: where each rank was when the run was interrupted:\n{stacks.text}")
