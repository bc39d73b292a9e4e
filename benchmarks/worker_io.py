"""The output benchmarks: log throughput and result transfer.

``IOBenchmarks`` adds ``logging`` (2 ranks printing 100,000 lines each vs the same run printing
nothing, also from inside a CPU-bound loop; the worker points its own fd 1/2 at files for each
run and counts the delivered, ``[rank N]``-prefixed and reported-dropped lines) and ``result``
(rank 0 returning 256 MB vs returning None, against an in-process pickle round trip) to the
worker's harness, with the fd redirection and line counting they use.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from jobs import LOG_LINES, OURS, RESULT_BYTES, TD, TORCHRUN, WORK_ITERS
from worker_base import WorkerBase


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
    return {"per_rank": per_rank, "total": sum(per_rank.values()), "prefixed": prefixed, "reported_dropped": dropped}


class IOBenchmarks(WorkerBase):
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
            self.measure(rec, lambda obj=obj: len(pickle.loads(pickle.dumps(obj))))
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
