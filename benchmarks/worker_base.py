"""The worker's harness: the Spark session, the launchers, and the bookkeeping of measurements.

``WorkerBase`` holds what every benchmark family shares: one Spark session per worker process
(from the job's master and conf), the launchers (our ``Distributor``, PySpark's
``TorchDistributor``, bare torchrun, a bare barrier job with torchrun per task, Ray Train's
``TorchTrainer``), ``record``/``measure`` (one record per bench, N, launcher and metric; every run
appends its value, its extras or its error) and the warm-up, untimed-run and rotation helpers.
The benchmark bodies subclass it (``worker_launch.py``, ``worker_io.py``, ``worker_profile.py``)
and ``worker.py`` combines them into the ``Worker``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from jobs import DEFAULT_RESULTS, FLOOR_SCRIPT, OURS, RUN_TIMEOUT, TD, Job


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerBase:
    results_dir = DEFAULT_RESULTS  # worker_main sets --results-dir (the profile writes its listings there)

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
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={n}",
            FLOOR_SCRIPT,
            body,
            out,
            *(str(a) for a in args),
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
                    exe,
                    "-m",
                    "torch.distributed.run",
                    f"--nnodes={n}",
                    f"--node_rank={i}",
                    "--nproc_per_node=1",
                    "--master_addr=127.0.0.1",
                    f"--master_port={port}",
                    script,
                    body,
                    out if i == 0 else "-",
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
            "bench": bench,
            "job": self.job.name,
            "mode": self.job.mode,
            "master": self.job.master,
            "n": n,
            "launcher": launcher,
            "metric": metric,
            "unit": unit,
            "values": [],
            "errors": [],
            "extra": [],
        }
        r.update(extra)
        self.records.append(r)
        return r

    def measure(
        self, rec: dict[str, Any], fn: Callable[[], Any], value_of: Callable[[float, Any], float] | None = None
    ):
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
