"""What one attempt of a run needs besides the plan: identity, restarts, limits, log sink."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

__all__ = ["Attempt"]


@dataclass(frozen=True)
class Attempt:
    """One (re)start of the whole gang. ``run_id`` is stable across restarts."""

    run_id: str
    restart_count: int = 0
    max_restarts: int = 0
    timeout: float | None = None  # what is left of the run's time for this attempt
    run_timeout: float | None = None  # the user's ``timeout``, for messages
    extra_env: Mapping[str, str] = field(default_factory=dict)
    on_lines: Callable[[int, str, str], None] = field(default=lambda rank, stream, text: None, repr=False)
    #: the last lines the driver received from a rank (for errors about ranks that did not report)
    tail: Callable[[int], tuple[str, ...]] = field(default=lambda rank: (), repr=False)

    @property
    def tag(self) -> str:
        """Spark job tag of this attempt (unique per run and restart)."""
        return f"spark-torch-{self.run_id}-{self.restart_count}"
