"""The analysis: statistics over the merged records and the verdict on every target.

``summary`` (median, min, max, runs), ``med`` (median of the first matching record),
``ratio``, ``lstsq`` (the scaling fit t = a + b*N) and ``paired_ratio`` (geometric mean of
interleaved A/B pair ratios with a Student-t 95% interval) are the statistics; ``analyse`` adds a
summary to every record of the jobs' outputs and returns them with the targets (measured value,
limit, met or not) and the scaling fits that the reports and ``results.json`` show.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from typing import Any

from jobs import FLOOR, OURS, RAY, TD, TORCHRUN

#: two-sided 95% quantiles of Student's t by degrees of freedom (pairs - 1)
T975 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    11: 2.201,
    12: 2.179,
    13: 2.160,
    14: 2.145,
    15: 2.131,
    19: 2.093,
    24: 2.064,
    29: 2.045,
}


def summary(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def med(records: list[dict[str, Any]], **match: Any) -> float | None:
    for r in records:
        if all(r.get(k) == v for k, v in match.items()):
            return summary(r["values"])["median"]
    return None


def by_job(records: list[dict[str, Any]]) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """Each job's name with its records, jobs in name order."""
    for job in sorted({r["job"] for r in records}):
        yield job, [r for r in records if r["job"] == job]


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b in (None, 0) else a / b


def lstsq(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    if len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return slope, my - slope * mx


def paired_ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """Mean of the per-pair ratios a/b (geometric) with a 95% CI, pairing runs by extra["pair"]."""
    import math

    if a is None or b is None:
        return None

    def by_pair(r: dict[str, Any]) -> dict[int, float]:
        return {e["pair"]: v for v, e in zip(r["values"], r["extra"]) if "pair" in e}

    x, y = by_pair(a), by_pair(b)
    logs = [math.log(x[p] / y[p]) for p in sorted(set(x) & set(y)) if x[p] > 0 and y[p] > 0]
    if len(logs) < 2:
        return None
    mean = statistics.mean(logs)
    half = (
        T975.get(len(logs) - 1, T975[max(k for k in T975 if k <= len(logs) - 1)])
        * statistics.stdev(logs)
        / math.sqrt(len(logs))
    )
    return {"ratio": math.exp(mean), "low": math.exp(mean - half), "high": math.exp(mean + half), "pairs": len(logs)}


def alternating_pairs(pairs: int, a: Callable[[], float], b: Callable[[], float]) -> dict[str, Any]:
    """``pairs`` pairs of measurements of ``a`` and ``b``, back to back, order alternating (so
    background load hits both alike): {"a": values, "b": values, **paired_ratio(a, b)}."""
    runs: dict[str, dict[str, Any]] = {"a": {"values": [], "extra": []}, "b": {"values": [], "extra": []}}
    for pair in range(pairs):
        for name in "ab" if pair % 2 == 0 else "ba":
            runs[name]["values"].append((a if name == "a" else b)())
            runs[name]["extra"].append({"pair": pair})
    return {"a": runs["a"]["values"], "b": runs["b"]["values"], **(paired_ratio(runs["a"], runs["b"]) or {})}


def analyse(outputs: list[dict[str, Any]]) -> dict[str, Any]:
    recs = [r for o in outputs for r in o["records"]]
    for r in recs:
        r["summary"] = summary(r["values"])
    targets: list[dict[str, Any]] = []

    def target(name: str, value: float | None, op: str, limit: float, detail: str) -> None:
        met = None if value is None else (value <= limit if op == "<=" else value >= limit)
        targets.append({"target": name, "measured": value, "op": op, "limit": limit, "met": met, "detail": detail})

    launch = [r for r in recs if r["bench"] == "launch"]
    for job, rs in by_job(launch):
        for n in sorted({r["n"] for r in rs}):
            ours = med(rs, n=n, launcher=OURS)
            tdv = med(rs, n=n, launcher=TD)
            if rs[0]["mode"] == "local":
                target(
                    f"local trivial run N={n} vs bare torchrun (warm)",
                    ratio(ours, med(rs, n=n, launcher=TORCHRUN)),
                    "<=",
                    0.2 if n == 2 else 0.6,
                    f"{job}; runs after the first (the template is warm)",
                )
            elif (
                tdv is not None or med(rs, n=n, launcher=FLOOR) is not None
            ):  # a job of ours alone (launch-scale) has none
                target(
                    f"distributed N={n} ({rs[0]['master']}) vs TorchDistributor",
                    ratio(ours, tdv),
                    "<=",
                    0.12 if n == 2 and rs[0]["master"] == "local[4]" else 0.35,
                    job,
                )
                target(
                    f"distributed N={n} ({rs[0]['master']}) vs floor",
                    ratio(ours, med(rs, n=n, launcher=FLOOR)),
                    "<=",
                    1.25,
                    job,
                )
            ray_s = med(rs, n=n, launcher=RAY)
            if ray_s is not None:
                target(
                    f"{rs[0]['mode']} N={n} vs Ray Train TorchTrainer",
                    ratio(ours, ray_s),
                    "<=",
                    0.1,
                    f"{job}; warm local Ray cluster (ray's version: meta.versions)",
                )
    train = [r for r in recs if r["bench"] == "training"]
    if train:
        ab = paired_ratio(
            next((r for r in train if r["launcher"] == OURS), None),
            next((r for r in train if r["launcher"] == TORCHRUN), None),
        )
        note = "samples/s, interleaved A/B"
        if ab is not None:
            note += f": mean pair ratio, 95% CI {ab['low']:.3f}-{ab['high']:.3f} over {ab['pairs']} pairs"
        target("DDP throughput vs torchrun (N=2, local)", ab["ratio"] if ab else None, ">=", 0.98, note)
    logs = [r for r in recs if r["bench"] == "logging"]
    for mode in sorted({r["mode"] for r in logs}):
        rs = [r for r in logs if r["mode"] == mode]
        loud, silent = med(rs, launcher=OURS, metric="seconds_loud"), med(rs, launcher=OURS, metric="seconds_silent")
        slow = None if loud is None or not silent else loud / silent - 1
        target(f"logging 100k lines/rank slowdown ({mode})", slow, "<=", 0.10, "loud/silent - 1, N=2")
        wl, ws = (
            med(rs, launcher=OURS, metric="work_seconds_loud"),
            med(rs, launcher=OURS, metric="work_seconds_silent"),
        )
        if wl is not None and ws:
            target(
                f"logging 100k lines/rank from a CPU-bound loop: loop slowdown ({mode})",
                wl / ws - 1,
                "<=",
                0.10,
                "rank 0's loop time loud/silent - 1, N=2",
            )
    res = [r for r in recs if r["bench"] == "result"]
    for job, rs in by_job(res):
        mode = job.removeprefix("result-")
        inproc = med(rs, metric="seconds_roundtrip")
        big, none = med(rs, launcher=OURS, metric="seconds_256MB"), med(rs, launcher=OURS, metric="seconds_none")
        delta = None if big is None or none is None else big - none
        target(
            f"256 MB result ({mode}): extra time vs in-process pickle round trip",
            ratio(delta, inproc),
            "<=",
            3.0,
            "(run returning 256 MB - same run returning None) / pickle.loads(pickle.dumps(obj))",
        )
    scaling: dict[str, Any] = {}
    for launcher in (OURS, TORCHRUN):
        pts = [(r["n"], v) for r in recs if r["bench"] == "scaling" and r["launcher"] == launcher for v in r["values"]]
        fit = lstsq(pts)
        if pts:
            scaling[launcher] = {
                "slope_s_per_rank": fit[0] if fit else None,
                "intercept_s": fit[1] if fit else None,
                "points": len(pts),
            }
    return {"records": recs, "targets": targets, "scaling": scaling}
