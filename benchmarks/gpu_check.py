#!/usr/bin/env python3
"""A device check: spark_torch's local mode on a real CUDA GPU, without pyspark, in one command.

    python3 benchmarks/gpu_check.py --out DIR

Needs python 3.10+, torch (with CUDA for the GPU steps), cloudpickle, psutil and fsspec; not
pyspark, Java, cryptography or a network (local mode needs none of them), and not an installed
spark_torch: it imports the one of this working tree. Each step runs in its own process under
its own deadline (a step that hangs is killed and reported as failed; the others still run) and
prints one line, ``step NAME: pass|fail|skipped: ...``; ``DIR/gpu_check.json`` has every
step's measurements and ``DIR/gpu_check.log`` the steps' own output. On a machine without
CUDA every GPU step says ``skipped: no CUDA``. Exit status: 1 if a step failed, else 0.

Steps (docs/gpu-nccl.md, "Checking on a real GPU"):
  env          versions; spark_torch comes from this tree; pyspark and cryptography are not needed
  local_cpu    a 2-rank gloo run in local mode with no Spark, warm-started from a template
  a_rank_gpu   use_gpu=True and None: CUDA_VISIBLE_DEVICES, LOCAL_RANK, NCCL all_reduce, prepare_model
  b_warm_cuda  cold run, then three runs forked from the template initialise CUDA; the template never does
  c_oom        a rank out of GPU memory: the error names the rank and the OOM; the memory comes back
  d_sampler    stall detection at its fastest: a quarter of the GPU deleted by the rank is freed at once
  e_nccl_fr    the Flight Recorder's variables in the rank; its NCCL dump on a stall and on a NCCL timeout;
               a healthy loop sleeping between NCCL all_reduces is never stopped as stalled
  f_ddp        DDP throughput (1 rank, 300 steps, bf16): spark_torch local mode vs bare torchrun, interleaved
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)  # this tree's spark_torch, ahead of any installed one

import gpu_steps  # noqa: E402
from gpu_steps import StepFailed, probe  # noqa: E402

#: (name, needs CUDA, deadline in seconds)
STEPS: list[tuple[str, bool, float]] = [
    ("env", False, 60),
    ("local_cpu", False, 120),
    ("a_rank_gpu", True, 90),
    ("b_warm_cuda", True, 120),
    ("c_oom", True, 90),
    ("d_sampler", True, 90),
    ("e_nccl_fr", True, 180),
    ("f_ddp", True, 180),
]

#: comma-separated step names that block until killed (tests/test_gpu_check.py forces an overrun with it)
HANG_VARIABLE = "GPU_CHECK_HANG_STEPS"

# --- running the steps -----------------------------------------------------------------------


def run_step(name: str, work: str, result_path: str) -> None:
    """Child side: run one step, write {"status", "detail", "data"}."""
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if name in os.environ.get(HANG_VARIABLE, "").split(","):
        # the tests' way to make a step overrun its deadline whatever the machine's speed
        signal.pause()
    step = getattr(gpu_steps, f"step_{name}")
    try:
        data, status, detail = step(work), "pass", ""
    except StepFailed as exc:
        data, status, detail = exc.data, "fail", str(exc)
    except Exception as exc:  # noqa: BLE001 - any other error is this step's failure, reported whole
        data, status, detail = {}, "fail", f"{type(exc).__name__}: {str(exc)[:1500]}"
    with open(result_path, "w", encoding="utf-8") as fh:
        json.dump({"status": status, "detail": detail, "data": data}, fh, default=str)


#: how long a finished step's processes (its warm-start template, which follows its owner) may take to end
LINGER_SECONDS = 15.0


def _step_processes(marker: str) -> list[Any]:
    """Processes started for one step: they carry its marker in their environment (ranks forked
    from a template show the template's), with their descendants."""
    import psutil

    found: dict[int, Any] = {}
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.pid != os.getpid() and proc.environ().get("GPU_CHECK_STEP") == marker:
                found[proc.pid] = proc
                found.update((c.pid, c) for c in proc.children(recursive=True))
        except psutil.Error:
            continue
    return list(found.values())


def _left_behind(marker: str) -> list[str]:
    """Wait for the step's processes to end by themselves; kill those still there after
    LINGER_SECONDS (so that none holds the GPU in the next step) and name them."""
    import psutil

    deadline = time.monotonic() + LINGER_SECONDS
    while (procs := _step_processes(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    named = []
    for proc in procs:
        try:
            named.append(f"{proc.pid} {' '.join(proc.cmdline())[:160]}")
            proc.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(procs, timeout=10)
    return named


def spawn_step(name: str, deadline: float, work: str, log: Any) -> dict[str, Any]:
    """Parent side: the step in its own process group, killed whole at its deadline; whatever
    it started and left running is killed too before the next step."""
    result_path = os.path.join(work, f"{name}.json")
    step_work = os.path.join(work, name)
    os.makedirs(step_work)
    log.write(f"\n===== step {name} =====\n")
    log.flush()
    marker = f"{name}-{os.getpid()}"
    argv = [sys.executable, os.path.abspath(__file__), "--step", name, "--work", step_work, "--result", result_path]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GPU_CHECK_STEP": marker}
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        proc.wait(timeout=deadline)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        result = {
            "status": "fail",
            "detail": f"timed out after {deadline:.0f}s (killed; see gpu_check.log)",
            "data": {},
        }
    else:
        try:
            with open(result_path, encoding="utf-8") as fh:
                result = dict(json.load(fh))
        except (OSError, ValueError):
            detail = f"the step's process exited {proc.returncode} without a result (see gpu_check.log)"
            result = {"status": "fail", "detail": detail, "data": {}}
    left = _left_behind(marker)
    if left:
        result["left_behind"] = left
        log.write(f"step {name} left {len(left)} process(es) running after {LINGER_SECONDS:g}s, killed: {left}\n")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", help="folder for gpu_check.json and gpu_check.log")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for all steps together (default 540)")
    parser.add_argument("--only", default="", help="comma-separated step names (default: all)")
    parser.add_argument("--step-deadline", type=float, help="seconds each step may take (default: each step's own)")
    parser.add_argument("--step", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.step:
        run_step(args.step, args.work, args.result)
        return 0
    if not args.out:
        parser.error("--out DIR is required")
    os.makedirs(args.out, exist_ok=True)
    chosen = [s for s in args.only.split(",") if s]
    unknown = set(chosen) - {name for name, _, _ in STEPS}
    if unknown:
        parser.error(f"unknown step(s) {sorted(unknown)}; the steps are {[name for name, _, _ in STEPS]}")
    try:
        found = probe()
    except (StepFailed, subprocess.TimeoutExpired) as exc:  # not "no CUDA": the GPU steps then fail, saying why
        found = {"cuda": None, "probe_failed": str(exc)}
        print(f"gpu_check: could not ask torch whether there is CUDA: {exc}", flush=True)
    os.environ["GPU_CHECK_PROBE"] = json.dumps(found)
    cuda = bool(found.get("cuda"))
    end = time.monotonic() + args.budget
    summary: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cuda": found.get("cuda"),
        "probe": found,
        "steps": [],
    }
    with (
        tempfile.TemporaryDirectory(prefix="gpu_check-") as work,
        open(os.path.join(args.out, "gpu_check.log"), "w", encoding="utf-8") as log,
    ):
        for name, needs_cuda, deadline in STEPS:
            if chosen and name not in chosen:
                continue
            start = time.monotonic()
            result: dict[str, Any]
            if needs_cuda and found["cuda"] is None:
                result = {"status": "fail", "detail": f"not run: {found['probe_failed']}", "data": {}}
            elif needs_cuda and not cuda:
                result = {"status": "skipped", "detail": "no CUDA", "data": {}}
            elif end - start < 10:
                result = {"status": "fail", "detail": f"not run: the {args.budget:.0f}s budget is spent", "data": {}}
            else:
                result = spawn_step(name, min(args.step_deadline or deadline, end - start), work, log)
            result.update(name=name, seconds=round(time.monotonic() - start, 2))
            summary["steps"].append(result)
            status = result["status"]
            line = (
                f"skipped: {result['detail']}"
                if status == "skipped"
                else f"{status} ({result['seconds']:.1f}s)" + (f": {result['detail']}" if result["detail"] else "")
            )
            if result.get("left_behind"):
                line += f" (left {len(result['left_behind'])} process(es) running, killed: see gpu_check.log)"
            print(f"step {name}: {line}", flush=True)
    summary["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    summary["passed"] = not any(s["status"] == "fail" for s in summary["steps"])
    with open(os.path.join(args.out, "gpu_check.json"), "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=1, default=str)
    print(
        f"gpu_check: {'passed' if summary['passed'] else 'FAILED'}; {os.path.join(args.out, 'gpu_check.json')}",
        flush=True,
    )
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
