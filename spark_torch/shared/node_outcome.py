"""How one node's part of an attempt ended: :class:`NodeOutcome`, the one value a node gives the
driver, in both modes, and its wire form.

The shape of torch elastic's ``RunResult(state, return_values, failures)``: the rank group's
state, each rank's, the stop reason the node acted on, the problem that kept it from starting its
ranks (:class:`~spark_torch.base.states.Problem`), the failed ranks (:class:`~spark_torch.errors.RankFailure`,
with their pickled exceptions), the dumps torch wrote about stopped ranks and where its DataFrame
rows came from. Local mode returns it in process; a barrier task seals it
(:mod:`spark_torch.shared.sealed`) and sends it over the channel, in its rows or in its exception.
Parsed by :meth:`NodeOutcome.from_wire` alone; a failure's text is :func:`bounded` as it travels.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from spark_torch.base.states import GroupState, Problem, RankState, ShardSource, ShardUse, StopReason
from spark_torch.errors import RankFailure

__all__ = ["NodeOutcome", "bounded", "failures_of", "MAX_DUMPS", "MAX_PICKLED_EXCEPTION"]

#: bounds on the dump paths a node's end carries per rank (a path longer than this is cut)
MAX_DUMPS, MAX_DUMP_PATH = 8, 4096
#: bound on one rank's pickled exception as it travels
MAX_PICKLED_EXCEPTION = 64 * 1024
#: bounds on a failure's text as it travels (head and tail kept, the middle cut): a node with
#: many ranks stays far below one channel frame and readable in Spark's UI
MAX_MESSAGE = 8 * 1024
MAX_TRACEBACK = 32 * 1024
MAX_LINE = 2 * 1024
MAX_LINES_TOTAL = 16 * 1024


def _cut(text: str | None, limit: int) -> str | None:
    """``text`` within ``limit`` characters: its head and tail, and how much was cut between."""
    if text is None or len(text) <= limit:
        return text
    keep = limit // 2
    return f"{text[:keep]}\n... [{len(text) - 2 * keep} characters cut] ...\n{text[-keep:]}"


def bounded(failure: RankFailure, share: float = 1.0) -> RankFailure:
    """``failure`` with its text within ``share`` of the bounds above (the newest output lines
    kept; of a long message or traceback its head and tail, so its final line survives)."""
    line_limit = max(64, int(MAX_LINE * share))
    lines_total = int(MAX_LINES_TOTAL * share)
    lines: list[str] = []
    total = 0
    for line in reversed(failure.last_lines):
        line = _cut(line, line_limit) or ""
        if total + len(line) > lines_total:
            lines.append(f"... [{len(failure.last_lines) - len(lines)} earlier line(s) cut] ...")
            break
        lines.append(line)
        total += len(line)
    return replace(
        failure,
        exc_type=_cut(failure.exc_type, MAX_LINE),
        exc_message=_cut(failure.exc_message, max(256, int(MAX_MESSAGE * share))),
        traceback=_cut(failure.traceback, max(512, int(MAX_TRACEBACK * share))),
        last_lines=tuple(reversed(lines)),
        dumps=tuple(_cut(dump, MAX_LINE) or "" for dump in failure.dumps[:MAX_DUMPS]),
    )


def _paths(value: object) -> dict[int, tuple[str, ...]]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(paths, list) and all(isinstance(p, str) for p in paths) for paths in value.values()
    ):
        raise ValueError("a node's dumps need an object of lists of paths by rank")
    return {int(rank): tuple(p[:MAX_DUMP_PATH] for p in paths[:MAX_DUMPS]) for rank, paths in value.items()}


def _shard(value: object) -> ShardUse | None:
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != 3 or not all(type(n) is int and n >= 0 for n in value[:2]):
        raise ValueError("a node's shard must be [shard, rows, source]")
    return ShardUse(value[0], value[1], ShardSource(value[2]))


def _failures(value: object) -> tuple[RankFailure, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(f, dict) for f in value):
        raise ValueError("a node's failures must be a list of objects")
    return tuple(RankFailure.from_dict(f) for f in value)


def _pickled(value: object) -> dict[int, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(p, str) for p in value.values()):
        raise ValueError("a node's pickled exceptions must be an object of strings by rank")
    return {int(rank): blob for rank, blob in value.items() if len(blob) <= MAX_PICKLED_EXCEPTION}


@dataclass(frozen=True)
class NodeOutcome:
    """How one node's part of an attempt ended (see the module docstring).

    ``state`` is the rank group's (None: no rank started, because the node was stopped before or
    had a ``problem``), ``ranks`` each rank's last state, ``stop`` the stop reason the node acted
    on (None: not stopped, or a reason this version does not know), ``dumps`` per rank the files
    torch wrote about a stopped rank on the node (the NCCL watchdog's), ``problem`` what kept the
    node from starting its ranks, ``failures`` its failed ranks (never a made-up one for a
    problem), ``pickled`` per failed rank its exception as a base64 pickle (unpickled on the
    driver only because the outcome came sealed with the run's secret, or in process)."""

    state: GroupState | None = None
    ranks: Mapping[int, RankState] = field(default_factory=dict)
    stop: StopReason | None = None
    dumps: Mapping[int, tuple[str, ...]] = field(default_factory=dict)
    problem: Problem | None = None
    #: ``run_on_dataframe``: where the node's rows came from
    shard: ShardUse | None = None
    failures: tuple[RankFailure, ...] = ()
    pickled: Mapping[int, str] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        """Whether every rank of the node finished."""
        return self.state is GroupState.SUCCEEDED

    @property
    def failed(self) -> bool:
        """Whether ranks of the node failed."""
        return self.state is GroupState.FAILED or bool(self.failures)

    def after(self, earlier: NodeOutcome) -> NodeOutcome:
        """This outcome completing an ``earlier`` one of the same node (a rank's failure sent at
        once, then the node's end): this one's fields, and the earlier failures it lacks."""
        known = {failure.rank for failure in self.failures}
        return replace(
            self,
            failures=self.failures + tuple(f for f in earlier.failures if f.rank not in known),
            pickled={**earlier.pickled, **self.pickled},
        )

    def to_wire(self, share: float = 1.0, pickled: bool = True) -> dict[str, Any]:
        """The JSON-able form; every failure's text :func:`bounded` to ``share`` of the bounds,
        ``pickled=False`` leaves the pickled exceptions out (the text still says what failed)."""
        return {
            "state": None if self.state is None else self.state.value,
            "ranks": {str(rank): state.value for rank, state in self.ranks.items()},
            "stop": None if self.stop is None else self.stop.value,
            "dumps": {str(rank): list(paths) for rank, paths in self.dumps.items()},
            "problem": None if self.problem is None else self.problem.to_wire(),
            "shard": None if self.shard is None else [self.shard.shard, self.shard.rows, self.shard.source.value],
            "failures": [bounded(f, share).to_dict() for f in self.failures],
            "pickled": {
                str(r): p for r, p in self.pickled.items() if pickled and p and len(p) <= MAX_PICKLED_EXCEPTION
            },
        }

    @classmethod
    def from_wire(cls, value: object) -> NodeOutcome:
        """Parse what :meth:`to_wire` makes; raises ``ValueError`` (or ``TypeError``/``KeyError``
        from a failure's fields) for anything else (a stop reason this version does not know
        reads as None)."""
        if not isinstance(value, dict) or not isinstance(value.get("ranks"), dict):
            raise ValueError("a node's outcome needs an object with its ranks' states")
        state, stop, problem = value.get("state"), value.get("stop"), value.get("problem")
        return cls(
            state=None if state is None else GroupState(state),
            ranks={int(rank): RankState(rank_state) for rank, rank_state in value["ranks"].items()},
            stop=None if stop is None else StopReason.parse(stop),
            dumps=_paths(value.get("dumps")),
            problem=None if problem is None else Problem.from_wire(problem),
            shard=_shard(value.get("shard")),
            failures=_failures(value.get("failures")),
            pickled=_pickled(value.get("pickled")),
        )


def failures_of(outcomes: Iterable[NodeOutcome]) -> tuple[tuple[RankFailure, ...], dict[int, str]]:
    """Every node's failed ranks as one list (each rank once) and their pickled exceptions."""
    by_rank: dict[int, RankFailure] = {}
    pickled: dict[int, str] = {}
    for outcome in outcomes:
        for failure in outcome.failures:
            by_rank.setdefault(failure.rank, failure)
        for rank, blob in outcome.pickled.items():
            pickled.setdefault(rank, blob)
    return tuple(by_rank.values()), pickled
