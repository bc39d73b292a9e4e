"""The chart (``results.png``): one matplotlib figure of six panels.

``write_chart`` draws bars (median with min-max whiskers) per launcher for launch latency, DDP
throughput, log throughput and result transfer, the scaling points with their least-squares
lines, and a text panel of the targets with their verdicts. matplotlib is imported only here,
so a missing matplotlib costs the chart and nothing else.
"""

from __future__ import annotations

from typing import Any

from jobs import FLOOR, OURS, TD, TORCHRUN
from report_md import fmt


def write_chart(path: str, analysis: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = analysis["records"]
    colors = {
        OURS: "tab:blue",
        TD: "tab:orange",
        TORCHRUN: "tab:green",
        FLOOR: "tab:green",
        "barrier job only": "tab:gray",
        "in-process pickle": "tab:purple",
    }
    fig, axes = plt.subplots(2, 3, figsize=(17, 9.5))

    def bars(ax, groups: list[tuple[str, list[dict[str, Any]]]], ylabel: str, title: str) -> None:
        launchers = []
        for _, rs in groups:
            for r in rs:
                if r["launcher"] not in launchers:
                    launchers.append(r["launcher"])
        width = 0.8 / max(1, len(launchers))
        for i, launcher in enumerate(launchers):
            xs, ys, lo, hi = [], [], [], []
            for g, (_, rs) in enumerate(groups):
                r = next((r for r in rs if r["launcher"] == launcher and r["values"]), None)
                if r is None:
                    continue
                s = r["summary"]
                xs.append(g + (i - (len(launchers) - 1) / 2) * width)
                ys.append(s["median"])
                lo.append(s["median"] - s["min"])
                hi.append(s["max"] - s["median"])
            if xs:
                ax.bar(xs, ys, width, yerr=[lo, hi], capsize=3, label=launcher, color=colors.get(launcher))
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([g for g, _ in groups], fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        if launchers:
            ax.legend(fontsize=7)

    launch = [r for r in recs if r["bench"] == "launch"]
    groups = []
    for job in ("launch-local", "launch-dist-local4", "launch-dist-cluster"):
        for n in sorted({r["n"] for r in launch if r["job"] == job}):
            label = {"launch-local": "local", "launch-dist-local4": "local[4]", "launch-dist-cluster": "local-cluster"}[
                job
            ]
            groups.append((f"{label}\nN={n}", [r for r in launch if r["job"] == job and r["n"] == n]))
    bars(axes[0][0], groups, "seconds (median, min–max)", "1. launch latency, trivial function")
    bars(
        axes[0][1],
        [("N=2 local", [r for r in recs if r["bench"] == "training"])],
        "samples/s",
        "2. DDP MLP throughput (higher is better)",
    )
    logs = [r for r in recs if r["bench"] == "logging"]
    groups = []
    for job in ("logging-local", "logging-dist"):
        for metric in ("seconds_silent", "seconds_loud"):
            groups.append(
                (
                    f"{job.split('-')[1]}\n{metric.split('_')[1]}",
                    [r for r in logs if r["job"] == job and r["metric"] == metric],
                )
            )
    bars(axes[0][2], groups, "seconds", "3. 2 ranks x 100k lines vs silent")
    res = [r for r in recs if r["bench"] == "result"]
    groups = []
    for job in ("result-local", "result-dist"):
        for metric in ("seconds_none", "seconds_256MB", "seconds_roundtrip"):
            groups.append(
                (
                    f"{job.split('-')[1]}\n{metric.split('_')[1]}",
                    [r for r in res if r["job"] == job and r["metric"] == metric],
                )
            )
    bars(axes[1][0], groups, "seconds", "4. result: 256 MB vs None vs in-process pickle")
    ax = axes[1][1]
    for launcher, fit in analysis["scaling"].items():
        pts = [(r["n"], v) for r in recs if r["bench"] == "scaling" and r["launcher"] == launcher for v in r["values"]]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], label=launcher, color=colors.get(launcher), s=14)
        if fit["slope_s_per_rank"] is not None:
            xs = sorted({p[0] for p in pts})
            ax.plot(
                xs,
                [fit["intercept_s"] + fit["slope_s_per_rank"] * x for x in xs],
                color=colors.get(launcher),
                label=f"{launcher}: {fit['intercept_s']:.2f}s + {fit['slope_s_per_rank']:.3f}s·N",
            )
    ax.set_xlabel("ranks N")
    ax.set_ylabel("seconds")
    ax.set_title("5. local-mode launch overhead (no process group)", fontsize=10)
    if analysis["scaling"]:
        ax.legend(fontsize=7)
    ax = axes[1][2]
    ax.axis("off")
    lines = ["targets (measured under load if load avg > CPUs):"]
    for t in analysis["targets"]:
        met = "?" if t["met"] is None else ("MET" if t["met"] else "NOT met")
        lines.append(f"{met:7s} {fmt(t['measured'], 2):>6s} {t['op']} {t['limit']}  {t['target'][:48]}")
    ax.text(0, 1, "\n".join(lines), va="top", family="monospace", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
