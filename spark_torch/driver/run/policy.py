"""The restart policy: what a run does after an attempt ended (pure logic, no Spark).

An attempt that succeeded finishes the run; one that asked to grow restarts it without counting
against ``max_restarts``; a failure or a stall restarts it while restarts are left, else the run
raises the attempt's error; a timeout, an interruption, a launch that failed or a
misconfiguration always raises (the run's time is up, the user asked to stop, or a restart would
meet the same cluster and settings). The membership then decides how many nodes the next attempt gets.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from spark_torch.driver.result import AttemptEnd, AttemptReason

__all__ = ["Action", "Decision", "RestartPolicy"]


class Action(enum.Enum):
    """What the controller does next."""

    FINISH = "finish"
    RESTART = "restart"
    RAISE = "raise"


@dataclass(frozen=True)
class Decision:
    """The policy's answer: the action, and for a restart why it happens."""

    action: Action
    reason: AttemptReason | None = None
    #: whether this restart uses up one of ``max_restarts``
    counts: bool = False


@dataclass(frozen=True)
class RestartPolicy:
    """``max_restarts`` failed or stalled attempts may be restarted (negative: without limit)."""

    max_restarts: int = 0

    @property
    def unlimited(self) -> bool:
        """Whether failures are restarted without limit."""
        return self.max_restarts < 0

    def decide(self, end: AttemptEnd, failures_so_far: int) -> Decision:
        """The next step after an attempt that ended with ``end``, when ``failures_so_far``
        earlier attempts of this call already failed or stalled."""
        if end is AttemptEnd.SUCCEEDED:
            return Decision(Action.FINISH)
        if end is AttemptEnd.GROW_REQUESTED:
            return Decision(Action.RESTART, AttemptReason.GROW)
        if end in (AttemptEnd.FAILED, AttemptEnd.STALLED):
            if self.unlimited or failures_so_far < self.max_restarts:
                reason = (
                    AttemptReason.RESTART_AFTER_STALL
                    if end is AttemptEnd.STALLED
                    else AttemptReason.RESTART_AFTER_FAILURE
                )
                return Decision(Action.RESTART, reason, counts=True)
            return Decision(Action.RAISE)
        return Decision(Action.RAISE)  # timed out, interrupted, launch failed, misconfigured

    def budget(self) -> str:
        """``max_restarts`` for messages."""
        return "unlimited" if self.unlimited else str(self.max_restarts)
