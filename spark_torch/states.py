"""The states an attempt's parts pass through, as types: a rank's state, why a node's ranks were
stopped, and what kind of problem kept a node from starting them.

A leaf module (no imports from the rest of the package): the node runner, the channel and the
driver all speak these. Each is a ``str`` enum whose value is what travels (over the channel, in
a failure report) and what the console prints, so a value read from the wire is checked by
constructing the enum (``RankState("failed")``; an unknown value raises ``ValueError``).
"""

from __future__ import annotations

import enum

__all__ = ["ValueEnum", "RankState", "StopReason", "ProblemKind"]


class ValueEnum(str, enum.Enum):
    """A ``str`` enum whose ``str()`` is its value: the word that travels and is printed."""

    def __str__(self) -> str:
        return str(self.value)


class RankState(ValueEnum):
    """Where one rank process is (the live status counts them; a node's result records the last)."""

    #: the process was started
    STARTED = "started"
    #: it exited with code 0
    FINISHED = "finished"
    #: it exited with another code or a signal, by itself
    FAILED = "failed"
    #: spark_torch stopped it (a timeout, a stall, a cancel, another rank's failure, growing)
    STOPPED = "stopped"



class StopReason(ValueEnum):
    """Why the driver stopped an attempt's ranks before they ended by themselves."""

    #: the run's ``timeout`` passed
    TIMEOUT = "timeout"
    #: no rank made progress for ``stall_timeout`` and ``stall_action="fail"``
    STALLED = "stalled"
    #: report() was called on some ranks while the others waited in a collective
    REPORT_DEADLOCK = "report deadlock"
    #: the user interrupted the run (Ctrl-C, a notebook's stop button)
    CANCELLED = "cancelled"
    #: a rank of another node failed: this node's ranks cannot go on
    PEER_FAILED = "peer failed"
    #: elastic_grow: more slots are free, the gang restarts larger after a checkpoint
    GROW = "grow"


    @classmethod
    def parse(cls, value: object) -> StopReason | None:
        """The reason a stop message names, or None for one this version does not know."""
        try:
            return cls(value)
        except ValueError:
            return None


class ProblemKind(ValueEnum):
    """What kind of problem kept a node from starting its ranks: the error the user gets."""

    #: the ranks could not be started (a missing script, another interpreter, no rendezvous)
    LAUNCH = "LaunchError"
    #: the run's input or settings make it impossible (shards, a storage not visible, GPUs)
    CONFIGURATION = "ConfigurationError"

