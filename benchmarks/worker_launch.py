"""The launch-overhead and throughput benchmarks: launch latency, DDP training, scaling.

``LaunchBenchmarks`` adds four benchmark bodies to the worker's harness: ``launch`` (a
trivial process-group function under every launcher, alternating and rotating per repetition),
``training`` (interleaved A/B pairs of DDP throughput, ours vs bare torchrun), ``scaling``
(our local-mode launch of a no-op for N=1..8, bare torchrun for reference) and ``launch_scale``
(our distributed-mode launch of the trivial all-reduce with N=2..32 nodes on one executor, as
total seconds and seconds per node, recorded under the ``launch`` tables).
"""

from __future__ import annotations

import os
import time

from jobs import FLOOR, OURS, RAY, SCALE_NODES, TD, TORCHRUN, TRAINING_PAIRS
from worker_base import WorkerBase


class LaunchBenchmarks(WorkerBase):
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
                    (
                        floor_name,
                        (lambda n=n: self.torchrun(n, "trivial_pg"))
                        if local
                        else (lambda n=n: self.barrier_floor(n, "trivial_pg")),
                    ),
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

    def launch_scale(self) -> None:
        """Per-node launch cost from N=2 to N=32 nodes of one rank each, all on one executor
        (``local[32]``): every node's Python worker forks its rank from the executor's one
        warm-start template at about the same moment. Flat seconds per node = no node fell back
        to a cold start and nothing queues behind the template. Records go to the ``launch``
        tables (the phase timeline shows where the time went); the job log's count of
        "warm rank starts are off" warnings is kept in the notes."""
        b = self.bodies
        ns = [2, 8] if self.quick else SCALE_NODES
        t = time.perf_counter()
        # untimed: Spark forks a Python worker per slot and the template is started once
        self.untimed(self.ours, max(ns), False, b.trivial_pg)
        self.notes["cold_first_run_seconds"] = {OURS: time.perf_counter() - t}
        for rep in range(self.reps):
            for n in self.rotate(ns, rep):
                total = self.record("launch", n, OURS, "seconds", "s")
                if self.measure(total, lambda n=n: self.ours(n, False, b.trivial_pg)) is not None:
                    per_node = self.record("launch", n, OURS, "seconds_per_node", "s")
                    per_node["values"].append(total["values"][-1] / n)
        self.notes["warm_start_off_warnings"] = self.count_in_log("warm rank starts are off")

    def count_in_log(self, text: str) -> int | None:
        """How often ``text`` appears in this job's log (run.py points the worker's output,
        and so its executors' Python workers', at ``logs/JOB.log``)."""
        path = os.path.join(self.results_dir, "logs", f"{self.job.name}.log")
        try:
            with open(path, errors="replace") as fh:
                return fh.read().count(text)
        except OSError:
            return None

    def warm_up_ours_only(self) -> None:
        t = time.perf_counter()
        self.ours(1, True, self.bodies.noop)
        self.notes["cold_first_run_seconds"] = {OURS: time.perf_counter() - t}
