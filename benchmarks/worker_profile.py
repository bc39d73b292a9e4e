"""The profile benchmark: where the time of one local-mode launch goes.

``ProfileBenchmark`` adds ``profile`` to the worker's harness: interpreter start-up and import
times (one process each), ``-X importtime`` of our rank's own imports, a cProfile of the driver
side of one local-mode ``run()`` (cold, then warm; full listings go to
``profile_driver_{cold,warm}.txt``) and the phase timeline of a trivial run from rank 0's
timestamps, for ours and for bare torchrun (``timeline``, ``top_functions``).
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import re
import subprocess
import sys
import time
from typing import Any

from jobs import ROOT
from worker_base import WorkerBase


class ProfileBenchmark(WorkerBase):
    def profile(self) -> None:
        """Where the time of one local-mode launch goes (rank imports; driver cProfile; timeline)."""
        reps = 2 if self.quick else 5
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
        py = sys.executable
        commands = {
            "python -c pass": [py, "-c", "pass"],
            "python -S -c pass (reaper's interpreter)": [py, "-S", "-c", "pass"],
            "import cloudpickle": [py, "-c", "import cloudpickle"],
            "import spark_torch.rank.function_main (our rank, before user code)": [
                py,
                "-c",
                "import spark_torch.rank.function_main",
            ],
            "import torch": [py, "-c", "import torch"],
            "import torch.distributed": [py, "-c", "import torch.distributed"],
            "import torch.distributed.run (torchrun agent)": [py, "-c", "import torch.distributed.run"],
            "import pyspark.sql (driver, local mode w/o session)": [py, "-c", "import pyspark.sql"],
        }
        for label, cmd in commands.items():
            rec = self.record("profile", None, label, "seconds", "s")
            for _ in range(reps):
                self.measure(rec, lambda cmd=cmd: subprocess.run(cmd, check=True, env=env))
        # -X importtime of our rank's own imports: top cumulative
        proc = subprocess.run(
            [py, "-X", "importtime", "-c", "import spark_torch.rank.function_main"],
            capture_output=True,
            text=True,
            env=env,
        )
        rows = []
        for line in proc.stderr.splitlines():
            m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
            if m:
                rows.append(
                    {
                        "self_us": int(m.group(1)),
                        "cumulative_us": int(m.group(2)),
                        "depth": len(m.group(3)) // 2,
                        "module": m.group(4),
                    }
                )
        self.notes["rank_importtime_top"] = sorted(rows, key=lambda r: -r["cumulative_us"])[:15]
        self.notes["rank_importtime_total_us"] = sum(r["self_us"] for r in rows)

        # driver side: cProfile of run() (cold: first call in this process; then warm)
        from spark_torch import Distributor

        b = self.bodies
        profiles = {}
        for label in ("cold", "warm"):
            prof = cProfile.Profile()
            t0 = time.time()
            prof.enable()
            value = Distributor(num_processes=2, local_mode=True).run(b.trivial_pg)
            prof.disable()
            t1 = time.time()
            stream = io.StringIO()
            stats = pstats.Stats(prof, stream=stream)
            stats.sort_stats("cumulative").print_stats(35)
            text = stream.getvalue()
            with open(os.path.join(self.results_dir, f"profile_driver_{label}.txt"), "w") as fh:
                fh.write(text)
            profiles[label] = {
                "total_seconds": t1 - t0,
                "timeline": timeline(t0, t1, value),
                "top": top_functions(stats, 25),
            }
        self.notes["driver_profile"] = profiles
        # the same timeline for the floor
        t0 = time.time()
        value = self.torchrun(2, "trivial_pg")
        self.notes["torchrun_timeline"] = timeline(t0, time.time(), value)


def timeline(t0: float, t1: float, v: dict[str, float]) -> dict[str, float]:
    """Phases of one trivial_pg launch, from the driver's clock and rank 0's timestamps."""
    return {
        "start -> rank 0 enters the function": v["enter"] - t0,
        "import torch (in the function)": v["imported"] - v["enter"],
        "init_process_group": v["joined"] - v["imported"],
        "all_reduce + destroy": v["exit"] - v["joined"],
        "function returns -> run() returns": t1 - v["exit"],
        "total": t1 - t0,
    }


def top_functions(stats: pstats.Stats, k: int) -> list[dict[str, Any]]:
    rows = []
    for (file, line, name), (_cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        short = file.replace(ROOT + os.sep, "").replace(sys.prefix + os.sep, "")
        rows.append({"function": f"{short}:{line}({name})", "calls": nc, "tottime": tt, "cumtime": ct})
    rows.sort(key=lambda r: -r["cumtime"])
    return rows[:k]
