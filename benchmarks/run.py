#!/usr/bin/env python
"""spark_torch benchmarks: our Distributor vs PySpark's TorchDistributor vs the floor.

    make bench                                   # = SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/run.py
    .venv/bin/python benchmarks/run.py --quick   # smoke run: 1 repetition, N=2 only
    .venv/bin/python benchmarks/run.py --only launch --only logging --reps 5

Every Spark master configuration runs in its own subprocess of this script (``--worker JOB``,
one SparkContext per process); the worker writes its measurements as JSON, this parent merges
them into ``benchmarks/results/`` (``results.json``, ``results.md``, ``results.png``; the
``--quick`` run goes to ``benchmarks/results/quick/``). Within a job the launchers alternate
(rotating the order every repetition) so that background load hits them alike.
See benchmarks/README.md for what each benchmark measures and its floor.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import platform
import pstats
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
FLOOR_SCRIPT = os.path.join(HERE, "floor_script.py")
DEFAULT_RESULTS = os.path.join(HERE, "results")
WORKER_TIMEOUT = 15 * 60
RUN_TIMEOUT = 600.0
LOG_LINES = 100_000
WORK_ITERS = 10_000
TRAINING_PAIRS = 12
#: two-sided 95% quantiles of Student's t by degrees of freedom (pairs - 1)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
        10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 19: 2.093, 24: 2.064, 29: 2.045}  # steps of the CPU-bound loop that prints LOG_LINES lines (chatter_work)
RESULT_BYTES = 256 << 20

OURS = "spark_torch"
TD = "TorchDistributor"
TORCHRUN = "torchrun"
FLOOR = "floor"
RAY = "Ray Train"  # an optional peer: measured when ray[train] is installed

if HERE not in sys.path:
    sys.path.insert(0, HERE)


# --------------------------------------------------------------------------------------------
# jobs: one subprocess each (one Spark master configuration per process)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    name: str
    bench: str
    mode: str  # "local" | "distributed" | "-"
    master: str | None  # Spark master of the worker's session (None: no session)
    conf: tuple[tuple[str, str], ...] = ()
    quick: bool = True  # part of --quick
    env: tuple[tuple[str, str], ...] = ()  # environment of the worker process


JOBS = [
    Job("launch-local", "launch", "local", "local[2]"),
    Job("launch-dist-local4", "launch", "distributed", "local[4]"),
    Job("launch-dist-cluster", "launch", "distributed", "local-cluster[2,1,1024]"),
    Job("training", "training", "local", "local[2]"),
    Job("logging-local", "logging", "local", "local[2]"),
    Job("logging-dist", "logging", "distributed", "local[2]"),
    Job("result-local", "result", "local", "local[2]"),
    Job(
        "result-dist",
        "result",
        "distributed",
        "local[2]",
        (("spark.driver.maxResultSize", "2g"), ("spark.driver.memory", "4g")),
    ),
    # what a result from another host takes: streamed over the run's authenticated channel
    Job(
        "result-dist-channel",
        "result",
        "distributed",
        "local[2]",
        (("spark.driver.maxResultSize", "2g"), ("spark.driver.memory", "4g")),
        env=(("SPARK_TORCH_RESULT_TRANSFER", "channel"),),
    ),
    # ... and without a channel: 16 MiB Arrow rows through Spark's result channel
    Job(
        "result-dist-spark",
        "result",
        "distributed",
        "local[2]",
        (("spark.driver.maxResultSize", "2g"), ("spark.driver.memory", "4g")),
        env=(("SPARK_TORCH_RESULT_TRANSFER", "spark"),),
    ),
    Job("scaling", "scaling", "local", None),
    Job("profile", "profile", "local", None),
]
BENCHES = ["launch", "training", "logging", "result", "scaling", "profile"]


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def summary(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def versions() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
    }
    for mod in ("torch", "pyspark", "cloudpickle", "pyarrow", "spark_torch"):
        try:
            m = __import__(mod)
            info[mod] = getattr(m, "__version__", "?")
        except Exception as exc:  # noqa: BLE001
            info[mod] = f"unavailable ({exc})"
    try:
        java = subprocess.run(["java", "-version"], capture_output=True, text=True, timeout=30)
        info["java"] = (java.stderr or java.stdout).splitlines()[0]
    except Exception:  # noqa: BLE001
        info["java"] = "?"
    try:
        info["spark_torch_commit"] = subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", ROOT, "status", "--porcelain", "spark_torch"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
        info["spark_torch_dirty"] = bool(dirty)
    except Exception:  # noqa: BLE001
        pass
    return info


@contextlib.contextmanager
def redirected_fds():
    """Point this process's fd 1 and 2 at fresh files (the driver's stdout/stderr) for one run."""
    sys.stdout.flush()
    sys.stderr.flush()
    out = tempfile.NamedTemporaryFile(prefix="bench-out-", delete=False)
    err = tempfile.NamedTemporaryFile(prefix="bench-err-", delete=False)
    saved = os.dup(1), os.dup(2)
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    try:
        yield out.name, err.name
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        out.close()
        err.close()


LINE_RE = re.compile(rb"bench-line r(\d+) ")
DROPPED_RE = re.compile(rb"\[spark_torch\] (\d+) log line\(s\) dropped")
PREFIXED_RE = re.compile(rb"^\[rank (\d+)\] bench-line r\1 ", re.M)


def count_lines(paths: list[str]) -> dict[str, Any]:
    per_rank: dict[str, int] = {}
    prefixed = 0
    dropped = 0
    for path in paths:
        with open(path, "rb") as fh:
            data = fh.read()
        for m in LINE_RE.finditer(data):
            per_rank[m.group(1).decode()] = per_rank.get(m.group(1).decode(), 0) + 1
        prefixed += len(PREFIXED_RE.findall(data))
        dropped += sum(int(m.group(1)) for m in DROPPED_RE.finditer(data))
    return {"per_rank": per_rank, "total": sum(per_rank.values()), "prefixed": prefixed,
            "reported_dropped": dropped}


# --------------------------------------------------------------------------------------------
# worker side
# --------------------------------------------------------------------------------------------


class Worker:
    def __init__(self, job: Job, reps: int, quick: bool) -> None:
        self.job = job
        self.reps = reps
        self.quick = quick
        self.records: list[dict[str, Any]] = []
        self.notes: dict[str, Any] = {}
        self.spark = None
        import bodies
        import cloudpickle

        # ship the bodies by value with both cloudpickles (spark_torch's and PySpark's vendored
        # copy, which TorchDistributor uses), so ranks need not import benchmarks/bodies.py
        cloudpickle.register_pickle_by_value(bodies)
        from pyspark import cloudpickle as spark_cloudpickle

        spark_cloudpickle.register_pickle_by_value(bodies)
        self.bodies = bodies
        if job.master is not None:
            self.spark = self._session(job.master, dict(job.conf))

    # -- Spark -------------------------------------------------------------------------------
    def _session(self, master: str, conf: dict[str, str]):
        os.environ["PYSPARK_PYTHON"] = sys.executable
        from pyspark.sql import SparkSession

        builder = (
            SparkSession.builder.master(master)
            .appName(f"spark-torch-bench-{self.job.name}")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
        )
        for k, v in conf.items():
            builder = builder.config(k, v)
        t = time.perf_counter()
        spark = builder.getOrCreate()
        spark.sparkContext.setLogLevel("ERROR")
        if master.startswith("local-cluster"):
            wanted = int(master.split("[")[1].split(",")[0])
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                # executors + the driver's own block manager
                if spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() - 1 >= wanted:
                    break
                time.sleep(0.5)
        self.notes["session_start_seconds"] = time.perf_counter() - t
        return spark

    # -- launchers ---------------------------------------------------------------------------
    def ours(self, n: int, local: bool, body: Callable, *args: Any) -> Any:
        from spark_torch import Distributor

        return Distributor(num_processes=n, local_mode=local, spark=self.spark, timeout=RUN_TIMEOUT).run(body, *args)

    def td(self, n: int, local: bool, body: Callable, *args: Any) -> Any:
        from pyspark.ml.torch.distributor import TorchDistributor

        return TorchDistributor(num_processes=n, local_mode=local, use_gpu=False).run(body, *args)

    def torchrun(self, n: int, body: str, *args: Any) -> Any:
        fd, out = tempfile.mkstemp(prefix="bench-floor-", suffix=".json")
        os.close(fd)
        os.unlink(out)
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
            FLOOR_SCRIPT, body, out, *(str(a) for a in args),
        ]
        try:
            subprocess.run(cmd, check=True, stdin=subprocess.DEVNULL, timeout=RUN_TIMEOUT)
            with open(out) as fh:
                return json.load(fh)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(out)

    def ray_train(self, n: int) -> Any:
        """Ray Train's TorchTrainer on the same trivial job, on a warm local Ray cluster."""
        import ray
        from ray.train import ScalingConfig
        from ray.train.torch import TorchTrainer

        if not ray.is_initialized():
            ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        return TorchTrainer(self.bodies.ray_trivial, scaling_config=ScalingConfig(num_workers=n, use_gpu=False)).fit()

    @staticmethod
    def ray_available() -> bool:
        try:
            import ray.train.torch  # noqa: F401
        except ImportError:
            return False
        return True

    def barrier_floor(self, n: int, body: str | None) -> Any:
        """A bare barrier mapInArrow job; with ``body``, each task runs torchrun for its node.

        No Spark-side rendezvous round: the port is picked on the driver (every executor here
        is on 127.0.0.1) and torchrun's static rendezvous joins the nodes.
        """
        port = free_port()
        fd, out = tempfile.mkstemp(prefix="bench-barrier-", suffix=".json")
        os.close(fd)
        os.unlink(out)
        exe, script = sys.executable, FLOOR_SCRIPT

        def task(batches):
            import subprocess as sp

            import pyarrow as pa
            from pyspark import BarrierTaskContext

            for _ in batches:
                pass
            i = BarrierTaskContext.get().partitionId()
            rc = 0
            if body is not None:
                cmd = [
                    exe, "-m", "torch.distributed.run", f"--nnodes={n}", f"--node_rank={i}",
                    "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}",
                    script, body, out if i == 0 else "-",
                ]
                rc = sp.run(cmd, stdin=sp.DEVNULL).returncode
            if rc:
                raise RuntimeError(f"torchrun exited with {rc} on node {i}")
            yield pa.RecordBatch.from_pydict({"rc": pa.array([rc], pa.int32())})

        try:
            self.spark.range(0, n, 1, n).mapInArrow(task, "rc int", barrier=True).collect()
            if body is None:
                return None
            with open(out) as fh:
                return json.load(fh)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(out)

    # -- bookkeeping -------------------------------------------------------------------------
    def record(self, bench: str, n: int | None, launcher: str, metric: str, unit: str, **extra: Any) -> dict[str, Any]:
        for r in self.records:
            if (r["bench"], r["n"], r["launcher"], r["metric"]) == (bench, n, launcher, metric):
                return r
        r = {
            "bench": bench, "job": self.job.name, "mode": self.job.mode, "master": self.job.master, "n": n,
            "launcher": launcher, "metric": metric, "unit": unit, "values": [], "errors": [], "extra": [],
        }
        r.update(extra)
        self.records.append(r)
        return r

    def measure(self, rec: dict[str, Any], fn: Callable[[], Any], value_of: Callable[[float, Any], float] | None = None):
        start_wall = time.time()
        t = time.perf_counter()
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 - keep going, report it
            rec["errors"].append(f"{type(exc).__name__}: {str(exc)[:500]}")
            traceback.print_exc()
            return None
        seconds = time.perf_counter() - t
        rec["values"].append(value_of(seconds, value) if value_of else seconds)
        extra: dict[str, Any] = {"seconds": seconds, "start": start_wall}
        if isinstance(value, dict):
            extra.update({k: v for k, v in value.items() if isinstance(v, (int, float, str, type(None)))})
        rec["extra"].append(extra)
        return value

    @staticmethod
    def untimed(fn: Callable[..., Any], *args: Any) -> None:
        """One untimed run right before a launcher's timed pair: the other launcher's runs left
        Spark's Python workers without our imports (and vice versa), which would otherwise be
        charged to whichever timed run comes first."""
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - the timed runs report failures
            traceback.print_exc()

    def warm_up(self, local: bool) -> None:
        """One untimed run of each launcher, so the first timed run does not pay driver imports."""
        b = self.bodies
        cold = self.notes.setdefault("cold_first_run_seconds", {})
        for name, fn in ((OURS, lambda: self.ours(1, local, b.noop)), (TD, lambda: self.td(1, local, b.noop))):
            t = time.perf_counter()
            try:
                fn()
                cold[name] = time.perf_counter() - t
            except Exception as exc:  # noqa: BLE001
                cold[name] = f"failed: {exc}"

    @staticmethod
    def rotate(items: list[Any], rep: int) -> list[Any]:
        k = rep % len(items)
        return items[k:] + items[:k]

    # -- benchmarks --------------------------------------------------------------------------
    def launch(self) -> None:
        b = self.bodies
        local = self.job.mode == "local"
        if local:
            ns = [2] if self.quick else [1, 2, 4]
        elif self.job.master.startswith("local-cluster"):
            ns = [2]
        else:
            ns = [2] if self.quick else [1, 2, 4]
        self.warm_up(local)
        floor_name = TORCHRUN if local else FLOOR
        for rep in range(self.reps):
            for n in ns:
                launchers = [
                    (OURS, lambda n=n: self.ours(n, local, b.trivial_pg)),
                    (TD, lambda n=n: self.td(n, local, b.trivial_pg)),
                    (floor_name, (lambda n=n: self.torchrun(n, "trivial_pg")) if local
                     else (lambda n=n: self.barrier_floor(n, "trivial_pg"))),
                ]
                if not local:
                    launchers.append(("barrier job only", lambda n=n: self.barrier_floor(n, None)))
                if n == 2 and not self.job.master.startswith("local-cluster") and self.ray_available():
                    launchers.append((RAY, lambda n=n: self.ray_train(n)))
                for name, fn in self.rotate(launchers, rep):
                    rec = self.record("launch", n, name, "seconds", "s")
                    self.measure(rec, fn)

    def training(self) -> None:
        """Interleaved A/B of DDP throughput, ours vs bare torchrun: pair i runs both back to back
        (order alternating), so slow drifts of this VM hit both sides of a pair alike; the
        analysis reports the mean pair ratio with a 95% confidence interval."""
        b = self.bodies
        n = 2
        steps = 60 if self.quick else 300  # >= 2 s of loop per run on 2 cores
        pairs = 2 if self.quick else max(TRAINING_PAIRS, self.reps)
        self.warm_up(True)
        ours = (OURS, lambda: self.ours(n, True, b.train_ddp, steps))
        ref = (TORCHRUN, lambda: self.torchrun(n, "train_ddp", steps))
        for pair in range(pairs):
            for name, fn in (ours, ref) if pair % 2 == 0 else (ref, ours):
                rec = self.record("training", n, name, "samples_per_s", "samples/s", steps=steps)
                if self.measure(rec, fn, lambda s, v: v["samples_per_s"]) is not None:
                    rec["extra"][-1]["pair"] = pair

    def logging(self) -> None:
        b = self.bodies
        n = 2
        local = self.job.mode == "local"
        self.warm_up(local)
        launchers: list[tuple[str, Callable[[int], Any]]] = [
            (OURS, lambda lines: self.ours(n, local, b.chatter, lines)),
            (TD, lambda lines: self.td(n, local, b.chatter, lines)),
        ]
        if local:
            launchers.append((TORCHRUN, lambda lines: self.torchrun(n, "chatter", lines)))
        # the same 100k lines per rank printed from inside a CPU-bound loop (loop time measured
        # inside rank 0): what logging costs a training loop on a busy machine
        working: list[tuple[str, Callable[[int], Any]]] = [
            (OURS, lambda lines: self.ours(n, local, b.chatter_work, lines, WORK_ITERS)),
            (TD, lambda lines: self.td(n, local, b.chatter_work, lines, WORK_ITERS)),
        ]
        if local:
            working.append((TORCHRUN, lambda lines: self.torchrun(n, "chatter_work", lines, WORK_ITERS)))
        for rep in range(self.reps):
            for kind, group in (("", launchers), ("work_", working)):
                for name, fn in self.rotate(group, rep):
                    self.untimed(fn, 0)
                    for lines in (LOG_LINES, 0):
                        metric = f"{kind}seconds_loud" if lines else f"{kind}seconds_silent"
                        rec = self.record("logging", n, name, metric, "s", lines_per_rank=lines)
                        value_of = (lambda s, v: v["loop_seconds"]) if kind else None
                        with redirected_fds() as (out, err):
                            self.measure(rec, lambda fn=fn, lines=lines: fn(lines), value_of)
                        if lines:
                            counted = count_lines([out, err])
                            rec.setdefault("delivered", []).append(counted)
                        os.unlink(out)
                        os.unlink(err)

    def result(self) -> None:
        import pickle

        b = self.bodies
        n = 2
        local = self.job.mode == "local"
        self.warm_up(local)
        rec = self.record("result", None, "in-process pickle", "seconds_roundtrip", "s", nbytes=RESULT_BYTES)
        obj = os.urandom(1 << 20) * (RESULT_BYTES >> 20)  # the object big_result returns
        for _ in range(max(3, self.reps)):
            self.measure(rec, lambda: len(pickle.loads(pickle.dumps(obj))))
        del obj

        def check(v: Any, returned: bool) -> Any:
            # TorchDistributor's local mode may hand back another rank's value (None): record it,
            # keep the timing
            ok = (isinstance(v, bytes) and len(v) == RESULT_BYTES) if returned else v is None
            return {"result_ok": ok, "result_type": type(v).__name__}

        launchers = [
            (OURS, lambda ret: check(self.ours(n, local, b.big_result, RESULT_BYTES, ret), ret)),
            (TD, lambda ret: check(self.td(n, local, b.big_result, RESULT_BYTES, ret), ret)),
        ]
        for rep in range(self.reps):
            for name, fn in self.rotate(launchers, rep):
                self.untimed(fn, False)
                for returned in (True, False):
                    metric = "seconds_256MB" if returned else "seconds_none"
                    rec = self.record("result", n, name, metric, "s", nbytes=RESULT_BYTES if returned else 0)
                    self.measure(rec, lambda fn=fn, ret=returned: fn(ret))

    def scaling(self) -> None:
        b = self.bodies
        ns = [1, 2] if self.quick else [1, 2, 4, 8]
        self.warm_up_ours_only()
        for rep in range(self.reps):
            for n in self.rotate(ns, rep):
                self.measure(self.record("scaling", n, OURS, "seconds", "s"), lambda n=n: self.ours(n, True, b.noop))
                if not self.quick:
                    self.measure(
                        self.record("scaling", n, TORCHRUN, "seconds", "s"), lambda n=n: self.torchrun(n, "noop")
                    )

    def warm_up_ours_only(self) -> None:
        t = time.perf_counter()
        self.ours(1, True, self.bodies.noop)
        self.notes["cold_first_run_seconds"] = {OURS: time.perf_counter() - t}

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
            "import spark_torch.rank.function_main (our rank, before user code)": [py, "-c", "import spark_torch.rank.function_main"],
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
            [py, "-X", "importtime", "-c", "import spark_torch.rank.function_main"], capture_output=True, text=True, env=env
        )
        rows = []
        for line in proc.stderr.splitlines():
            m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
            if m:
                rows.append({"self_us": int(m.group(1)), "cumulative_us": int(m.group(2)),
                             "depth": len(m.group(3)) // 2, "module": m.group(4)})
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

    results_dir = DEFAULT_RESULTS


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
    for (file, line, name), (cc, nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        short = file.replace(ROOT + os.sep, "").replace(sys.prefix + os.sep, "")
        rows.append({"function": f"{short}:{line}({name})", "calls": nc, "tottime": tt, "cumtime": ct})
    rows.sort(key=lambda r: -r["cumtime"])
    return rows[:k]


def worker_main(args: argparse.Namespace) -> int:
    job = next(j for j in JOBS if j.name == args.worker)
    os.environ.update(dict(job.env))
    start = time.time()
    load0 = [round(x, 2) for x in os.getloadavg()]
    w = Worker(job, args.reps, args.quick)
    w.results_dir = args.results_dir
    try:
        getattr(w, job.bench)()
    finally:
        out = {
            "job": job.name, "records": w.records, "notes": w.notes, "seconds": time.time() - start,
            "loadavg_start": load0, "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        }
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1, default=str)
        if w.spark is not None:
            w.spark.stop()
    return 0


# --------------------------------------------------------------------------------------------
# parent side: run jobs, merge, report
# --------------------------------------------------------------------------------------------


def run_jobs(args: argparse.Namespace, jobs: list[Job], results_dir: str,
             after_each: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    logs = os.path.join(results_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    env["PYTHONUNBUFFERED"] = "1"
    outputs = []
    for job in jobs:
        out = os.path.join(results_dir, f"{job.name}.json.tmp")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", job.name, "--reps", str(args.reps),
               "--out", out, "--results-dir", results_dir] + (["--quick"] if args.quick else [])
        print(f"[bench] {job.name} ({job.bench}, {job.mode}, master={job.master}) ...", flush=True)
        t = time.time()
        with open(os.path.join(logs, f"{job.name}.log"), "w") as log:
            try:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=WORKER_TIMEOUT,
                                    cwd=ROOT).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        try:
            with open(out) as fh:
                data = json.load(fh)
            os.unlink(out)
        except (FileNotFoundError, ValueError):
            data = {"job": job.name, "records": [], "notes": {}}
        data["returncode"] = rc
        data["wall_seconds"] = time.time() - t
        outputs.append(data)
        errors = sum(len(r["errors"]) for r in data["records"])
        if after_each is not None:
            after_each(outputs)
        print(f"[bench]   done in {time.time() - t:.0f}s (exit {rc}, {errors} failed runs; "
              f"log: {os.path.relpath(os.path.join(logs, job.name + '.log'), ROOT)})", flush=True)
    return outputs


def med(records: list[dict[str, Any]], **match: Any) -> float | None:
    for r in records:
        if all(r.get(k) == v for k, v in match.items()):
            return summary(r["values"])["median"]
    return None


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
    half = T975.get(len(logs) - 1, T975[max(k for k in T975 if k <= len(logs) - 1)]) * statistics.stdev(logs) / math.sqrt(len(logs))
    return {"ratio": math.exp(mean), "low": math.exp(mean - half), "high": math.exp(mean + half), "pairs": len(logs)}


def analyse(outputs: list[dict[str, Any]]) -> dict[str, Any]:
    recs = [r for o in outputs for r in o["records"]]
    for r in recs:
        r["summary"] = summary(r["values"])
    targets: list[dict[str, Any]] = []

    def target(name: str, value: float | None, op: str, limit: float, detail: str) -> None:
        met = None if value is None else (value <= limit if op == "<=" else value >= limit)
        targets.append({"target": name, "measured": value, "op": op, "limit": limit, "met": met, "detail": detail})

    launch = [r for r in recs if r["bench"] == "launch"]
    for job in sorted({r["job"] for r in launch}):
        rs = [r for r in launch if r["job"] == job]
        for n in sorted({r["n"] for r in rs}):
            ours = med(rs, n=n, launcher=OURS)
            tdv = med(rs, n=n, launcher=TD)
            if rs[0]["mode"] == "local":
                target(f"local trivial run N={n} vs bare torchrun (warm)", ratio(ours, med(rs, n=n, launcher=TORCHRUN)),
                       "<=", 0.2 if n == 2 else 0.6, f"{job}; runs after the first (the template is warm)")
            else:
                target(f"distributed N={n} ({rs[0]['master']}) vs TorchDistributor", ratio(ours, tdv), "<=",
                       0.12 if n == 2 and rs[0]["master"] == "local[4]" else 0.35, job)
                target(f"distributed N={n} ({rs[0]['master']}) vs floor", ratio(ours, med(rs, n=n, launcher=FLOOR)),
                       "<=", 1.25, job)
            ray_s = med(rs, n=n, launcher=RAY)
            if ray_s is not None:
                target(f"{rs[0]['mode']} N={n} vs Ray Train TorchTrainer", ratio(ours, ray_s), "<=", 0.1,
                       f"{job}; ray {metadata.version('ray')}, warm local Ray cluster")
    train = [r for r in recs if r["bench"] == "training"]
    if train:
        ab = paired_ratio(next((r for r in train if r["launcher"] == OURS), None),
                          next((r for r in train if r["launcher"] == TORCHRUN), None))
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
        wl, ws = med(rs, launcher=OURS, metric="work_seconds_loud"), med(rs, launcher=OURS, metric="work_seconds_silent")
        if wl is not None and ws:
            target(f"logging 100k lines/rank from a CPU-bound loop: loop slowdown ({mode})", wl / ws - 1, "<=", 0.10,
                   "rank 0's loop time loud/silent - 1, N=2")
    res = [r for r in recs if r["bench"] == "result"]
    for job in sorted({r["job"] for r in res}):
        rs = [r for r in res if r["job"] == job]
        mode = job.removeprefix("result-")
        inproc = med(rs, metric="seconds_roundtrip")
        big, none = med(rs, launcher=OURS, metric="seconds_256MB"), med(rs, launcher=OURS, metric="seconds_none")
        delta = None if big is None or none is None else big - none
        target(f"256 MB result ({mode}): extra time vs in-process pickle round trip", ratio(delta, inproc), "<=", 3.0,
               "(run returning 256 MB - same run returning None) / pickle.loads(pickle.dumps(obj))")
    scaling: dict[str, Any] = {}
    for launcher in (OURS, TORCHRUN):
        pts = [(r["n"], v) for r in recs if r["bench"] == "scaling" and r["launcher"] == launcher for v in r["values"]]
        fit = lstsq(pts)
        if pts:
            scaling[launcher] = {"slope_s_per_rank": fit[0] if fit else None,
                                 "intercept_s": fit[1] if fit else None, "points": len(pts)}
    return {"records": recs, "targets": targets, "scaling": scaling}


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
    L.append(f"- date: {meta['date']}; command: `{meta['command']}`; repetitions: {meta['reps']}; "
             f"wall time: {meta['wall_seconds']:.0f}s; jobs done: {meta.get('jobs_done')}")
    L.append(f"- machine: {v['cpu_count']} CPUs, {v['platform']}; python {v['python']}, torch {v['torch']}, "
             f"pyspark {v['pyspark']}, spark_torch {v.get('spark_torch')} ({v.get('spark_torch_commit', '?')}"
             f"{', dirty' if v.get('spark_torch_dirty') else ''}), {v.get('java')}")
    L.append(f"- load average at start / end: {meta['loadavg_start']} / {meta['loadavg_end']} "
             "(values above the CPU count mean the numbers are noisy)\n")

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
            L.append(f"| {r['job']} | {fmt(r['n'])} | {r['launcher']} | {r['metric']} ({r['unit']}) | "
                     f"{fmt(s['median'])} | {fmt(s['min'])} | {fmt(s['max'])} | {s['n']} | {len(r['errors'])} |")
        L.append("")

    table("1. Launch latency (trivial function: gloo init + all_reduce + return)",
          [r for r in recs if r["bench"] == "launch"])
    launch = [r for r in recs if r["bench"] == "launch"]
    if launch:
        L.append("| job | N | ours/TorchDistributor | ours/floor |")
        L.append("|---|---:|---:|---:|")
        for job in sorted({r["job"] for r in launch}):
            rs = [r for r in launch if r["job"] == job]
            for n in sorted({r["n"] for r in rs}):
                floor = med(rs, n=n, launcher=TORCHRUN) or med(rs, n=n, launcher=FLOOR)
                L.append(f"| {job} | {n} | {fmt(ratio(med(rs, n=n, launcher=OURS), med(rs, n=n, launcher=TD)))} | "
                         f"{fmt(ratio(med(rs, n=n, launcher=OURS), floor))} |")
        L.append("")
        # median phase timeline of trivial_pg runs
        L.append("Median phases of those runs (rank 0's timestamps vs the driver's clock):\n")
        L.append("| job | N | launcher | start→function | import torch | init_process_group | all_reduce+destroy | "
                 "function→run returns |")
        L.append("|---|---:|---|---:|---:|---:|---:|---:|")
        for r in launch:
            ex = [e for e in r["extra"] if "enter" in e]
            if not ex:
                continue

            def m(f):
                return statistics.median(f(e) for e in ex)

            L.append(
                f"| {r['job']} | {r['n']} | {r['launcher']} | {fmt(m(lambda e: e['enter'] - e['start']))} | "
                f"{fmt(m(lambda e: e['imported'] - e['enter']))} | {fmt(m(lambda e: e['joined'] - e['imported']))} | "
                f"{fmt(m(lambda e: e['exit'] - e['joined']))} | "
                f"{fmt(m(lambda e: e['start'] + e['seconds'] - e['exit']))} |")
        L.append("")

    train = [r for r in recs if r["bench"] == "training"]
    if train:
        table("2. DDP training throughput (N=2, local mode; higher is better)", train)
    logs = [r for r in recs if r["bench"] == "logging"]
    if logs:
        table("3. Log throughput (2 ranks x 100,000 lines vs the same run printing nothing)", logs)
        L.append("| job | launcher | loud median (s) | silent median (s) | slowdown | extra µs per line | "
                 "rank 0's own print loop (s) | extra beyond the print loop, µs per line | "
                 "lines delivered (min over runs) / expected | `[rank N]`-prefixed | reported dropped (max) |")
        L.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for job in sorted({r["job"] for r in logs}):
            rs = [r for r in logs if r["job"] == job]
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
                beyond = (None if per_line is None or print_s is None
                          else (loud - silent - print_s) / (2 * LOG_LINES) * 1e6)
                L.append(f"| {job} | {launcher} | {fmt(loud)} | {fmt(silent)} | {slow or '—'} | {fmt(per_line, 1)} | "
                         f"{fmt(print_s)} | {fmt(beyond, 1)} | "
                         f"{total} / {2 * LOG_LINES} | {prefixed} | {dropped} |")
        L.append("")
        L.append("Printed from inside a CPU-bound loop (`chatter_work`: rank 0's loop time, loud vs silent):")
        L.append("")
        L.append("| job | launcher | loop loud (s) | loop silent (s) | loop slowdown | lines delivered (min) / expected |")
        L.append("|---|---|---:|---:|---:|---:|")
        for job in sorted({r["job"] for r in logs}):
            rs = [r for r in logs if r["job"] == job]
            for launcher in [x for x in (OURS, TD, TORCHRUN) if any(r["launcher"] == x for r in rs)]:
                loud = med(rs, launcher=launcher, metric="work_seconds_loud")
                silent = med(rs, launcher=launcher, metric="work_seconds_silent")
                if loud is None or not silent:
                    continue
                rl = next(r for r in rs if r["launcher"] == launcher and r["metric"] == "work_seconds_loud")
                total = min((d.get("total", 0) for d in rl.get("delivered") or [{}]), default=0)
                L.append(f"| {job} | {launcher} | {fmt(loud)} | {fmt(silent)} | {100 * (loud / silent - 1):+.0f}% | "
                         f"{total} / {2 * LOG_LINES} |")
        L.append("")
    res = [r for r in recs if r["bench"] == "result"]
    if res:
        table("4. Result transfer (rank 0 returns 256 MB of bytes, N=2)", res)
        L.append("| job | launcher | 256 MB run | same run returning None | extra for 256 MB | "
                 "extra / in-process pickle round trip | total / round trip |")
        L.append("|---|---|---:|---:|---:|---:|---:|")
        for job in sorted({r["job"] for r in res}):
            rs = [r for r in res if r["job"] == job]
            inproc = med(rs, metric="seconds_roundtrip")
            for launcher in (OURS, TD):
                big, none = med(rs, launcher=launcher, metric="seconds_256MB"), med(rs, launcher=launcher,
                                                                                    metric="seconds_none")
                delta = None if big is None or none is None else big - none
                wrong = [e for r in rs if r["launcher"] == launcher for e in r["extra"] if e.get("result_ok") is False]
                if wrong:
                    launcher = f"{launcher} (**wrong result in {len(wrong)} run(s)**)"
                L.append(f"| {job} | {launcher} | {fmt(big)} | {fmt(none)} | {fmt(delta)} | "
                         f"{fmt(ratio(delta, inproc), 1)} | {fmt(ratio(big, inproc), 1)} |")
        L.append("")
    sc = [r for r in recs if r["bench"] == "scaling"]
    if sc:
        table("5. Scaling of local-mode launch overhead (function without a process group)", sc)
        for launcher, fit in analysis["scaling"].items():
            L.append(f"- {launcher}: least-squares fit t = {fmt(fit['intercept_s'])} s + "
                     f"{fmt(fit['slope_s_per_rank'])} s x N ({fit['points']} runs)")
        L.append("")
    prof = next((o for o in outputs if o.get("job") == "profile"), None)
    if prof and prof.get("records"):
        table("6. Profile: interpreter start-up and imports (one process each)",
              [r for r in recs if r["bench"] == "profile"])
        notes = prof["notes"]
        if notes.get("rank_importtime_top"):
            L.append(f"`python -X importtime -c 'import spark_torch.rank.function_main'`: "
                     f"{notes['rank_importtime_total_us'] / 1000:.0f} ms of imports in total; top cumulative:\n")
            L.append("| module | cumulative ms | self ms |")
            L.append("|---|---:|---:|")
            for row in notes["rank_importtime_top"][:10]:
                L.append(f"| {'  ' * row['depth']}{row['module']} | {row['cumulative_us'] / 1000:.1f} | "
                         f"{row['self_us'] / 1000:.1f} |")
            L.append("")
        for label, p in (notes.get("driver_profile") or {}).items():
            L.append(f"Driver-side cProfile of `Distributor(2, local_mode=True).run(trivial_pg)` ({label}, "
                     f"{p['total_seconds']:.2f}s; full listing in `profile_driver_{label}.txt`):\n")
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
        L.append(f"| {o['job']} | {o.get('returncode')} | {fmt(o.get('wall_seconds'), 0)} | "
                 f"{fmt(n.get('session_start_seconds'), 1)} | {cold_s} | "
                 f"{o.get('loadavg_start', '?')} → {o.get('loadavg_end', '?')} |")
        for r in o["records"]:
            for e in r["errors"][:2]:
                L.append(f"|  ↳ {r['launcher']} N={r['n']} {r['metric']} failed: {e[:200].replace('|', '/')} | | | | | |")
    with open(path, "w") as fh:
        fh.write("\n".join(L) + "\n")


def write_chart(path: str, analysis: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = analysis["records"]
    colors = {OURS: "tab:blue", TD: "tab:orange", TORCHRUN: "tab:green", FLOOR: "tab:green",
              "barrier job only": "tab:gray", "in-process pickle": "tab:purple"}
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
            label = {"launch-local": "local", "launch-dist-local4": "local[4]",
                     "launch-dist-cluster": "local-cluster"}[job]
            groups.append((f"{label}\nN={n}", [r for r in launch if r["job"] == job and r["n"] == n]))
    bars(axes[0][0], groups, "seconds (median, min–max)", "1. launch latency, trivial function")
    bars(axes[0][1], [("N=2 local", [r for r in recs if r["bench"] == "training"])], "samples/s",
         "2. DDP MLP throughput (higher is better)")
    logs = [r for r in recs if r["bench"] == "logging"]
    groups = []
    for job in ("logging-local", "logging-dist"):
        for metric in ("seconds_silent", "seconds_loud"):
            groups.append((f"{job.split('-')[1]}\n{metric.split('_')[1]}",
                           [r for r in logs if r["job"] == job and r["metric"] == metric]))
    bars(axes[0][2], groups, "seconds", "3. 2 ranks x 100k lines vs silent")
    res = [r for r in recs if r["bench"] == "result"]
    groups = []
    for job in ("result-local", "result-dist"):
        for metric in ("seconds_none", "seconds_256MB", "seconds_roundtrip"):
            groups.append((f"{job.split('-')[1]}\n{metric.split('_')[1]}",
                           [r for r in res if r["job"] == job and r["metric"] == metric]))
    bars(axes[1][0], groups, "seconds", "4. result: 256 MB vs None vs in-process pickle")
    ax = axes[1][1]
    for launcher, fit in analysis["scaling"].items():
        pts = [(r["n"], v) for r in recs if r["bench"] == "scaling" and r["launcher"] == launcher for v in r["values"]]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], label=launcher, color=colors.get(launcher), s=14)
        if fit["slope_s_per_rank"] is not None:
            xs = sorted({p[0] for p in pts})
            ax.plot(xs, [fit["intercept_s"] + fit["slope_s_per_rank"] * x for x in xs], color=colors.get(launcher),
                    label=f"{launcher}: {fit['intercept_s']:.2f}s + {fit['slope_s_per_rank']:.3f}s·N")
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


def parent_main(args: argparse.Namespace) -> int:
    results_dir = args.results_dir or (os.path.join(DEFAULT_RESULTS, "quick") if args.quick else DEFAULT_RESULTS)
    os.makedirs(results_dir, exist_ok=True)
    wanted = set(args.only or [])
    unknown = wanted - set(BENCHES) - {j.name for j in JOBS}
    if unknown:
        print(f"unknown benchmark(s) {sorted(unknown)}; choose from {BENCHES} or jobs {[j.name for j in JOBS]}")
        return 2
    jobs = [j for j in JOBS if not wanted or j.bench in wanted or j.name in wanted]
    start = time.time()
    load0 = os.getloadavg()
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "command": " ".join([os.path.relpath(sys.executable, ROOT)] + [os.path.relpath(sys.argv[0], ROOT)]
                            + sys.argv[1:]),
        "reps": args.reps,
        "quick": args.quick,
        "versions": versions(),
        "loadavg_start": [round(x, 2) for x in load0],
    }
    print(f"[bench] {len(jobs)} jobs, {args.reps} repetition(s) -> {os.path.relpath(results_dir, ROOT)}/; "
          f"load average {load0[0]:.1f} on {os.cpu_count()} CPUs", flush=True)

    def report(outputs: list[dict[str, Any]]) -> dict[str, Any]:
        """(Re)write results.json/.md/.png; called after every job so a cut-short run still reports."""
        meta["wall_seconds"] = time.time() - start
        meta["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        meta["jobs_done"] = f"{len(outputs)} of {len(jobs)}"
        analysis = analyse(outputs)
        with open(os.path.join(results_dir, "results.json"), "w") as fh:
            json.dump({"meta": meta, "targets": analysis["targets"], "scaling": analysis["scaling"],
                       "jobs": outputs}, fh, indent=1, default=str)
        write_markdown(os.path.join(results_dir, "results.md"), meta, analysis, outputs)
        try:
            write_chart(os.path.join(results_dir, "results.png"), analysis)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        return analysis

    outputs = run_jobs(args, jobs, results_dir, after_each=report)
    analysis = report(outputs)
    print(f"[bench] finished in {meta['wall_seconds']:.0f}s; see {os.path.relpath(results_dir, ROOT)}/results.md",
          flush=True)
    for t in analysis["targets"]:
        met = "?" if t["met"] is None else ("met" if t["met"] else "NOT met")
        print(f"[bench]   {met:8s} {fmt(t['measured'])} {t['op']} {t['limit']}  {t['target']}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 1 repetition, N=2 only")
    p.add_argument("--only", action="append", metavar="NAME",
                   help=f"benchmark ({', '.join(BENCHES)}) or job name; repeatable")
    p.add_argument("--reps", type=int, default=None, help="repetitions per configuration (default 3; --quick 1)")
    p.add_argument("--results-dir", default=None, help="default benchmarks/results (quick: benchmarks/results/quick)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.reps is None:
        args.reps = 1 if args.quick else 3
    if args.worker:
        return worker_main(args)
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
