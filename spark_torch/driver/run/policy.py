"""The restart policy: what a run does after an attempt ended (pure logic, no Spark).

What follows each end is declared in :data:`~spark_torch.driver.attempts.END_RULES`: an attempt
that succeeded finishes the run; one that asked to grow restarts it without counting against
``max_restarts``; a failure or a stall restarts it while restarts are left, else the run raises
the attempt's error; a timeout, an interruption, a launch that failed or a misconfiguration always
raises. The policy adds the budget. The membership then decides how many nodes the next attempt gets.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from spark_torch.driver.attempts import END_RULES, AttemptEnd, AttemptReason, Follow

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
    """``max_restarts`` counted restarts (after a failure or a stall) are allowed (negative: without limit)."""

    max_restarts: int = 0

    @property
    def unlimited(self) -> bool:
        """Whether failures are restarted without limit."""
        return self.max_restarts < 0

    def decide(self, end: AttemptEnd, failures_so_far: int) -> Decision:
        """The next step after an attempt that ended with ``end`` (as its row of ``END_RULES``
        says), when ``failures_so_far`` earlier restarts of this call were counted."""
        rule = END_RULES[end]
        if rule.follows is Follow.FINISH:
            return Decision(Action.FINISH)
        if rule.follows is Follow.RESTART:
            return Decision(Action.RESTART, rule.restart)
        if rule.follows is Follow.RESTART_COUNTED and (self.unlimited or failures_so_far < self.max_restarts):
            return Decision(Action.RESTART, rule.restart, counts=True)
        return Decision(Action.RAISE)

    def budget(self) -> str:
        """``max_restarts`` for messages."""
        return "unlimited" if self.unlimited else str(self.max_restarts)
