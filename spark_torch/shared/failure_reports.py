"""Failure reports from a node to the driver, authenticated with the run's secret.

Each failed node sends its report over the run's authenticated channel (so the driver hears
every failed node, and the earliest failure leads even if another node's task failed first in
Spark's eyes), and also raises it inside its task exception (for runs without a channel).

A failed node raises a task exception whose text carries a report between markers; Spark hands
that text to the driver. Text a rank controls (its exception message, which may echo data) is
part of the same exception text, so a report counts only if its HMAC, keyed with the run's
secret (which ranks never see), verifies. Only an authenticated report may carry a pickled
exception for the driver to unpickle; without one, the driver builds its error from text.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
from dataclasses import dataclass, field, replace
from typing import Any

from spark_torch.base.states import MAX_DUMPS, ProblemKind
from spark_torch.errors import RankFailure

__all__ = [
    "FailureReport",
    "encode_report",
    "decode_report",
    "report_to_dict",
    "report_from_dict",
    "merge_reports",
    "MARKER",
    "MAX_PICKLED_EXCEPTION",
    "bounded",
]

MARKER = "SPARK_TORCH_FAILURE"
#: bound on the pickled exception a report carries (it travels inside Spark's exception text)
MAX_PICKLED_EXCEPTION = 64 * 1024
#: bounds on a failure's text as it travels (head and tail kept, the middle cut): a report of
#: a node with many ranks stays far below one channel frame and readable in Spark's UI
MAX_MESSAGE = 8 * 1024
MAX_TRACEBACK = 32 * 1024
MAX_LINE = 2 * 1024
MAX_LINES_TOTAL = 16 * 1024
_LABEL = b"spark-torch-failure-report-v2"
_PATTERN = re.compile(MARKER + r"<([A-Za-z0-9+/=]+)\.([0-9a-f]{64})>" + MARKER)


@dataclass(frozen=True)
class FailureReport:
    """What a node tells the driver about its failure: its failed ranks, or the problem that
    kept it from starting them (never both: a node problem is not dressed up as a rank's)."""

    failures: tuple[RankFailure, ...] = ()
    #: the problem that kept the node from starting its ranks: its kind (the error the user
    #: gets) and its message; None when ranks failed
    problem: tuple[ProblemKind, str] | None = None
    headline: str | None = None
    #: per rank, the base64 pickle of its exception (only trusted because the report is authenticated)
    pickled: dict[int, str] = field(default_factory=dict)

    @property
    def kind(self) -> ProblemKind | None:
        """The node problem's kind, or None (ranks failed)."""
        return self.problem[0] if self.problem is not None else None


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


def report_to_dict(report: FailureReport, share: float = 1.0, pickled: bool = True) -> dict[str, Any]:
    """A report as JSON-ready data (also what travels over the authenticated channel); every
    failure's text is :func:`bounded` to ``share`` of the bounds; ``pickled=False`` leaves the
    pickled exceptions out (the text still says what failed)."""
    return {
        "failures": [bounded(f, share).to_dict() for f in report.failures],
        "problem": [report.problem[0].value, _cut(report.problem[1], MAX_MESSAGE)]
        if report.problem is not None
        else None,
        "headline": report.headline,
        "pickled": {str(r): p for r, p in report.pickled.items() if pickled and p and len(p) <= MAX_PICKLED_EXCEPTION},
    }


def report_from_dict(data: Any) -> FailureReport:
    """Inverse of :func:`report_to_dict`; raises ValueError/TypeError/KeyError on malformed data."""
    if not isinstance(data, dict):
        raise ValueError("a failure report must be an object")
    problem = data.get("problem")
    if problem is not None and (not isinstance(problem, list) or len(problem) != 2 or not isinstance(problem[1], str)):
        raise ValueError("a node's problem must be [kind, message]")
    return FailureReport(
        failures=tuple(RankFailure.from_dict(f) for f in data.get("failures") or ()),
        problem=(ProblemKind(problem[0]), problem[1]) if problem is not None else None,
        headline=data.get("headline"),
        pickled={int(r): str(p) for r, p in (data.get("pickled") or {}).items()},
    )


def merge_reports(reports: list[FailureReport]) -> FailureReport | None:
    """One report from several nodes' (each rank once; the earliest failure leads)."""
    if not reports:
        return None
    by_rank: dict[int, RankFailure] = {}
    pickled: dict[int, str] = {}
    for report in reports:
        for failure in report.failures:
            by_rank.setdefault(failure.rank, failure)
        for rank, blob in report.pickled.items():
            pickled.setdefault(rank, blob)
    first = next((r for r in reports if r.problem is not None), reports[0])
    return FailureReport(
        failures=tuple(by_rank.values()), problem=first.problem, headline=first.headline, pickled=pickled
    )


def _mac(secret: bytes, blob: str) -> str:
    return hmac.new(secret, _LABEL + blob.encode("ascii"), hashlib.sha256).hexdigest()


def encode_report(report: FailureReport, secret: bytes) -> str:
    """One line, marker-delimited, that survives inside Spark's exception text."""
    blob = base64.b64encode(json.dumps(report_to_dict(report)).encode("utf-8")).decode("ascii")
    return f"{MARKER}<{blob}.{_mac(secret, blob)}>{MARKER}"


def decode_report(text: str, secret: bytes) -> FailureReport | None:
    """The first report in ``text`` whose MAC verifies; forged or altered ones are ignored."""
    for match in _PATTERN.finditer(text):
        blob, mac = match.group(1), match.group(2)
        if not hmac.compare_digest(mac, _mac(secret, blob)):
            continue
        try:
            return report_from_dict(json.loads(base64.b64decode(blob).decode("utf-8")))
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
    return None
