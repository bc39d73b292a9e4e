"""The Markdown report (``results.md``) and the number format shared by every report.

``write_markdown`` writes the run's header (date, command, machine, versions, load), the
targets, one table per benchmark with its derived ratios (launch vs TorchDistributor and the
floor, the phase timeline, log delivery and slowdowns, result transfer vs the pickle round trip,
the scaling fit, the profile's import times and driver cProfile) and the jobs table with their
failures; ``fmt`` formats one measured value (``—`` when missing).
"""

from __future__ import annotations

import statistics
from typing import Any

from analysis import by_job, med, ratio
from jobs import FLOOR, LOG_LINES, OURS, TD, TORCHRUN


def fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def write_markdown(path: str, meta: dict[str, Any], analysis: dict[str, Any], outputs: list[dict[str, Any]]) -> None:
    recs = analysis["records"]
    L: list[str] = []
    v = meta["versions"]
    L.append("# spark_torch benchmark results\n")
    L.append(
        f"- date: {meta['date']}; command: `{meta['command']}`; repetitions: {meta['reps']}; "
        f"wall time: {meta['wall_seconds']:.0f}s; jobs done: {meta.get('jobs_done')}"
    )
    L.append(
        f"- machine: {v['cpu_count']} CPUs, {v['platform']}; python {v['python']}, torch {v['torch']}, "
        f"pyspark {v['pyspark']}, spark_torch {v.get('spark_torch')} ({v.get('spark_torch_commit', '?')}"
        f"{', dirty' if v.get('spark_torch_dirty') else ''}), {v.get('java')}"
    )
    L.append(
        f"- load average at start / end: {meta['loadavg_start']} / {meta['loadavg_end']} "
        "(values above the CPU count mean the numbers are noisy)\n"
    )

    L.append("## Targets\n")
    L.append("| target | measured | limit | met |")
    L.append("|---|---:|---:|:--:|")
    for t in analysis["targets"]:
        met = "—" if t["met"] is None else ("yes" if t["met"] else "**no**")
        L.append(f"| {t['target']} | {fmt(t['measured'])} | {t['op']} {t['limit']} | {met} |")
    L.append("")

    def table(title: str, rows: list[dict[str, Any]], cols: list[str] | None = None) -> None:
        L.append(f"## {title}\n")
        L.append("| job | N | launcher | metric | median | min | max | runs | failed |")
        L.append("|---|---:|---|---|---:|---:|---:|---:|---:|")
        for r in rows:
            s = r["summary"]
            L.append(
                f"| {r['job']} | {fmt(r['n'])} | {r['launcher']} | {r['metric']} ({r['unit']}) | "
                f"{fmt(s['median'])} | {fmt(s['min'])} | {fmt(s['max'])} | {s['n']} | {len(r['errors'])} |"
            )
        L.append("")

    table(
        "1. Launch latency (trivial function: gloo init + all_reduce + return)",
        [r for r in recs if r["bench"] == "launch"],
    )
    launch = [r for r in recs if r["bench"] == "launch"]
    if launch:
        L.append("| job | N | ours/TorchDistributor | ours/floor |")
        L.append("|---|---:|---:|---:|")
        for job, rs in by_job(launch):
            for n in sorted({r["n"] for r in rs}):
                floor = med(rs, n=n, launcher=TORCHRUN) or med(rs, n=n, launcher=FLOOR)
                L.append(
                    f"| {job} | {n} | {fmt(ratio(med(rs, n=n, launcher=OURS), med(rs, n=n, launcher=TD)))} | "
                    f"{fmt(ratio(med(rs, n=n, launcher=OURS), floor))} |"
                )
        L.append("")
        # median phase timeline of trivial_pg runs
        L.append("Median phases of those runs (rank 0's timestamps vs the driver's clock):\n")
        L.append(
            "| job | N | launcher | start→function | import torch | init_process_group | all_reduce+destroy | "
            "function→run returns |"
        )
        L.append("|---|---:|---|---:|---:|---:|---:|---:|")
        for r in launch:
            ex = [e for e in r["extra"] if "enter" in e]
            if not ex:
                continue

            def m(f, ex=ex):
                return statistics.median(f(e) for e in ex)

            L.append(
                f"| {r['job']} | {r['n']} | {r['launcher']} | {fmt(m(lambda e: e['enter'] - e['start']))} | "
                f"{fmt(m(lambda e: e['imported'] - e['enter']))} | {fmt(m(lambda e: e['joined'] - e['imported']))} | "
                f"{fmt(m(lambda e: e['exit'] - e['joined']))} | "
                f"{fmt(m(lambda e: e['start'] + e['seconds'] - e['exit']))} |"
            )
        L.append("")

    train = [r for r in recs if r["bench"] == "training"]
    if train:
        table("2. DDP training throughput (N=2, local mode; higher is better)", train)
    logs = [r for r in recs if r["bench"] == "logging"]
    if logs:
        table("3. Log throughput (2 ranks x 100,000 lines vs the same run printing nothing)", logs)
        L.append(
            "| job | launcher | loud median (s) | silent median (s) | slowdown | extra µs per line | "
            "rank 0's own print loop (s) | extra beyond the print loop, µs per line | "
            "lines delivered (min over runs) / expected | `[rank N]`-prefixed | reported dropped (max) |"
        )
        L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for job, rs in by_job(logs):
            for launcher in [x for x in (OURS, TD, TORCHRUN) if any(r["launcher"] == x for r in rs)]:
                loud = med(rs, launcher=launcher, metric="seconds_loud")
                silent = med(rs, launcher=launcher, metric="seconds_silent")
                rl = next(r for r in rs if r["launcher"] == launcher and r["metric"] == "seconds_loud")
                delivered = rl.get("delivered") or [{}]
                total = min(d.get("total", 0) for d in delivered)
                prefixed = min(d.get("prefixed", 0) for d in delivered)
                dropped = max(d.get("reported_dropped", 0) for d in delivered)
                slow = None if loud is None or not silent else f"{100 * (loud / silent - 1):+.0f}%"
                per_line = None if loud is None or silent is None else (loud - silent) / (2 * LOG_LINES) * 1e6
                prints = [e.get("print_seconds") for e in rl.get("extra", []) if e.get("print_seconds") is not None]
                print_s = statistics.median(prints) if prints else None
                beyond = (
                    None if per_line is None or print_s is None else (loud - silent - print_s) / (2 * LOG_LINES) * 1e6
                )
                L.append(
                    f"| {job} | {launcher} | {fmt(loud)} | {fmt(silent)} | {slow or '—'} | {fmt(per_line, 1)} | "
                    f"{fmt(print_s)} | {fmt(beyond, 1)} | "
                    f"{total} / {2 * LOG_LINES} | {prefixed} | {dropped} |"
                )
        L.append("")
        L.append("Printed from inside a CPU-bound loop (`chatter_work`: rank 0's loop time, loud vs silent):")
        L.append("")
        L.append(
            "| job | launcher | loop loud (s) | loop silent (s) | loop slowdown | lines delivered (min) / expected |"
        )
        L.append("|---|---|---:|---:|---:|---:|")
        for job, rs in by_job(logs):
            for launcher in [x for x in (OURS, TD, TORCHRUN) if any(r["launcher"] == x for r in rs)]:
                loud = med(rs, launcher=launcher, metric="work_seconds_loud")
                silent = med(rs, launcher=launcher, metric="work_seconds_silent")
                if loud is None or not silent:
                    continue
                rl = next(r for r in rs if r["launcher"] == launcher and r["metric"] == "work_seconds_loud")
                total = min((d.get("total", 0) for d in rl.get("delivered") or [{}]), default=0)
                L.append(
                    f"| {job} | {launcher} | {fmt(loud)} | {fmt(silent)} | {100 * (loud / silent - 1):+.0f}% | "
                    f"{total} / {2 * LOG_LINES} |"
                )
        L.append("")
    res = [r for r in recs if r["bench"] == "result"]
    if res:
        table("4. Result transfer (rank 0 returns 256 MB of bytes, N=2)", res)
        L.append(
            "| job | launcher | 256 MB run | same run returning None | extra for 256 MB | "
            "extra / in-process pickle round trip | total / round trip |"
        )
        L.append("|---|---|---:|---:|---:|---:|---:|")
        for job, rs in by_job(res):
            inproc = med(rs, metric="seconds_roundtrip")
            for launcher in (OURS, TD):
                big, none = (
                    med(rs, launcher=launcher, metric="seconds_256MB"),
                    med(rs, launcher=launcher, metric="seconds_none"),
                )
                delta = None if big is None or none is None else big - none
                wrong = [e for r in rs if r["launcher"] == launcher for e in r["extra"] if e.get("result_ok") is False]
                if wrong:
                    launcher = f"{launcher} (**wrong result in {len(wrong)} run(s)**)"
                L.append(
                    f"| {job} | {launcher} | {fmt(big)} | {fmt(none)} | {fmt(delta)} | "
                    f"{fmt(ratio(delta, inproc), 1)} | {fmt(ratio(big, inproc), 1)} |"
                )
        L.append("")
    sc = [r for r in recs if r["bench"] == "scaling"]
    if sc:
        table("5. Scaling of local-mode launch overhead (function without a process group)", sc)
        for launcher, fit in analysis["scaling"].items():
            L.append(
                f"- {launcher}: least-squares fit t = {fmt(fit['intercept_s'])} s + "
                f"{fmt(fit['slope_s_per_rank'])} s x N ({fit['points']} runs)"
            )
        L.append("")
    prof = next((o for o in outputs if o.get("job") == "profile"), None)
    if prof and prof.get("records"):
        table(
            "6. Profile: interpreter start-up and imports (one process each)",
            [r for r in recs if r["bench"] == "profile"],
        )
        notes = prof["notes"]
        if notes.get("rank_importtime_top"):
            L.append(
                f"`python -X importtime -c 'import spark_torch.rank.function_main'`: "
                f"{notes['rank_importtime_total_us'] / 1000:.0f} ms of imports in total; top cumulative:\n"
            )
            L.append("| module | cumulative ms | self ms |")
            L.append("|---|---:|---:|")
            for row in notes["rank_importtime_top"][:10]:
                L.append(
                    f"| {'  ' * row['depth']}{row['module']} | {row['cumulative_us'] / 1000:.1f} | "
                    f"{row['self_us'] / 1000:.1f} |"
                )
            L.append("")
        for label, p in (notes.get("driver_profile") or {}).items():
            L.append(
                f"Driver-side cProfile of `Distributor(2, local_mode=True).run(trivial_pg)` ({label}, "
                f"{p['total_seconds']:.2f}s; full listing in `profile_driver_{label}.txt`):\n"
            )
            L.append("| phase | seconds |")
            L.append("|---|---:|")
            for k, val in p["timeline"].items():
                L.append(f"| {k} | {fmt(val)} |")
            L.append("")
            L.append("| function (main thread) | calls | cumulative s | own s |")
            L.append("|---|---:|---:|---:|")
            for row in p["top"][:18]:
                L.append(f"| `{row['function']}` | {row['calls']} | {row['cumtime']:.3f} | {row['tottime']:.3f} |")
            L.append("")
        if notes.get("torchrun_timeline"):
            L.append("The same phases for bare torchrun (N=2):\n")
            L.append("| phase | seconds |")
            L.append("|---|---:|")
            for k, val in notes["torchrun_timeline"].items():
                L.append(f"| {k} | {fmt(val)} |")
            L.append("")
    L.append("## Jobs\n")
    L.append("| job | exit | wall s | Spark session start s | cold first run s | load avg start → end |")
    L.append("|---|---|---:|---:|---|---|")
    for o in outputs:
        n = o.get("notes", {})
        cold = n.get("cold_first_run_seconds", {})
        cold_s = ", ".join(f"{k} {fmt(v, 2) if isinstance(v, float) else v}" for k, v in cold.items()) or "—"
        L.append(
            f"| {o['job']} | {o.get('returncode')} | {fmt(o.get('wall_seconds'), 0)} | "
            f"{fmt(n.get('session_start_seconds'), 1)} | {cold_s} | "
            f"{o.get('loadavg_start', '?')} → {o.get('loadavg_end', '?')} |"
        )
        for r in o["records"]:
            for e in r["errors"][:2]:
                L.append(
                    f"|  ↳ {r['launcher']} N={r['n']} {r['metric']} failed: {e[:200].replace('|', '/')} | | | | | |"
                )
    with open(path, "w") as fh:
        fh.write("\n".join(L) + "\n")
