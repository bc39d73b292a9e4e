"""The steps of ``gpu_check.py`` (each ``step_NAME(work) -> measurements``, raising
:class:`StepFailed` when a check does not hold) and what they measure from outside the ranks:
the GPU's free memory as a fresh process sees it, the /dev/nvidia* files a process has open,
the warm-start templates, the PIDs nvidia-smi lists. This process never initialises CUDA.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

MEMORY_TOLERANCE = 256 << 20
TEMPLATE_MODULE = "spark_torch.node.template.server"


class StepFailed(Exception):
    """A check did not hold; the message says which and what was seen (``data``: what was measured)."""

    def __init__(self, message: str, data: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.data = data or {}


def check(ok: bool, what: str, data: dict[str, Any] | None = None) -> None:
    """Fail the step with ``what`` (and the measurements ``data``) unless ``ok``."""
    if not ok:
        raise StepFailed(what, data)


# --- things measured from outside the ranks --------------------------------------------------

_PROBE = r"""
import json, sys, time
import torch
out = {"torch": torch.__version__, "cuda": torch.cuda.is_available(), "python": sys.version.split()[0]}
if out["cuda"]:
    want, deadline = float(sys.argv[1]), time.monotonic() + float(sys.argv[2])
    free, total = torch.cuda.mem_get_info(0)
    while free < want and time.monotonic() < deadline:
        time.sleep(0.2)
        free, total = torch.cuda.mem_get_info(0)
    out.update(free=free, total=total, name=torch.cuda.get_device_name(0), count=torch.cuda.device_count(),
               cuda_version=torch.version.cuda)
    try:  # an int in old torch, a tuple in newer ones
        out["nccl"] = str(torch.cuda.nccl.version())
    except Exception as exc:  # the version is information only
        out["nccl"] = f"unknown ({exc})"
print(json.dumps(out))
"""


def probe(want_free: float = 0, wait_s: float = 0) -> dict[str, Any]:
    """torch and the GPU as a fresh process sees them (this process never initialises CUDA);
    with ``want_free``, polls ``mem_get_info`` until that much is free or ``wait_s`` passed."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(want_free), str(wait_s)], capture_output=True, text=True, timeout=60 + wait_s
    )
    if done.returncode != 0:
        raise StepFailed(f"the torch probe failed (exit {done.returncode}): {done.stderr.strip()[-400:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def probe_result() -> dict[str, Any]:
    """The parent's probe (``GPU_CHECK_PROBE``), else a new one."""
    given = os.environ.get("GPU_CHECK_PROBE")
    return dict(json.loads(given)) if given else probe()


def nvidia_fds(pid: int) -> list[str]:
    """The /dev/nvidia* files process ``pid`` has open (a process that initialised CUDA has)."""
    found = []
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("/dev/nvidia"):
                found.append(target)
    except OSError:
        pass
    return sorted(set(found))


def templates() -> list[Any]:
    """This process's warm-start templates (children running the template module)."""
    import psutil

    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if TEMPLATE_MODULE in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            continue
    return found


def gpu_pids() -> list[int] | None:
    """PIDs nvidia-smi says hold GPU memory (None: nvidia-smi absent or silent)."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return [int(line) for line in done.stdout.split() if line.strip().isdigit()]


def distributor(**options: Any) -> Any:
    from spark_torch import Distributor

    options.setdefault("progress", False)
    return Distributor(num_processes=options.pop("num_processes", 1), local_mode=True, **options)


def ship_bodies() -> Any:
    """The rank bodies, pickled by value (the ranks import nothing from benchmarks/)."""
    import cloudpickle
    import gpu_ranks

    cloudpickle.register_pickle_by_value(gpu_ranks)
    return gpu_ranks


def expected_visible() -> str:
    """The GPU a 1-rank local run gets: the first of CUDA_VISIBLE_DEVICES, else GPU 0."""
    visible = [e.strip() for e in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if e.strip()]
    return visible[0] if visible else "0"


# --- the steps -------------------------------------------------------------------------------


def step_env(work: str) -> dict[str, Any]:
    import spark_torch

    found = probe_result()
    check(
        os.path.dirname(os.path.abspath(spark_torch.__file__)) == os.path.join(ROOT, "spark_torch"),
        f"spark_torch came from {spark_torch.__file__}, not this tree",
    )
    optional = {}
    for name in ("pyspark", "cryptography", "tqdm", "pyarrow", "pandas"):
        try:
            optional[name] = importlib.util.find_spec(name) is not None
        except ImportError:
            optional[name] = False
    return {**found, "platform": platform.platform(), "spark_torch": spark_torch.__file__, "importable": optional}


def step_local_cpu(work: str) -> dict[str, Any]:
    ranks = ship_bodies()
    runs = [distributor(num_processes=2, use_gpu=False).run(ranks.gloo_rank) for _ in range(2)]
    check(
        all(r["sum"] == [3.0, 3.0] for r in runs),
        f"gloo all_reduce over 2 ranks gave {[r['sum'] for r in runs]}, not [3.0, 3.0]",
    )
    check(all(r["visible"] == "" for r in runs), f"use_gpu=False: CUDA_VISIBLE_DEVICES={runs[0]['visible']!r}, not ''")
    check(
        TEMPLATE_MODULE in runs[1]["parent"],
        f"the second run's rank was not forked from the template (parent: {runs[1]['parent']})",
    )
    held = {t.pid: nvidia_fds(t.pid) for t in templates()}
    check(bool(held), "no warm-start template found among this process's children")
    check(not any(held.values()), f"a template has GPU files open: {held}")
    check("pyspark" not in sys.modules, "local mode imported pyspark")
    return {"runs": runs, "templates": list(held), "driver_nvidia_fds": nvidia_fds(os.getpid())}


def step_a_rank_gpu(work: str) -> dict[str, Any]:
    ranks = ship_bodies()
    out = {}
    for use_gpu in (True, None):
        got = distributor(use_gpu=use_gpu).run(ranks.rank_on_gpu)
        label = f"use_gpu={use_gpu}"
        env = got["env"]
        check(
            env["CUDA_VISIBLE_DEVICES"] == expected_visible(),
            f"{label}: CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r}, expected {expected_visible()!r}",
        )
        check(env["LOCAL_RANK"] == "0" and env["RANK"] == "0" and env["WORLD_SIZE"] == "1", f"{label}: rank env {env}")
        check(got["device_count"] == 1, f"{label}: the rank sees {got['device_count']} GPUs, expected 1")
        check(
            got["backend"] == "nccl" and got["all_reduce"] == [1.0] * 4,
            f"{label}: {got['backend']} all_reduce gave {got['all_reduce']}",
        )
        check(
            got["model_device"] == got["expected_device"],
            f"{label}: prepare_model put the model on {got['model_device']}, not {got['expected_device']}",
        )
        out[label] = got
    fds = nvidia_fds(os.getpid())
    check(not fds, f"the driver process initialised CUDA (it has {fds} open)")
    return out


def step_b_warm_cuda(work: str) -> dict[str, Any]:
    ranks = ship_bodies()
    runs = []
    for label, warm in (("cold", False), ("first (template starts)", True), ("warm 2", True), ("warm 3", True)):
        start = time.time()
        got = distributor(use_gpu=True, warm_start=warm).run(ranks.cuda_in_warm_rank)
        got.update(
            label=label, launch_s=got["enter"] - start, cuda_ready_s=got["ready"] - start, run_s=time.time() - start
        )
        check(got["initialized"] and got["finite"], f"{label}: CUDA did not work in the rank: {got}")
        runs.append(got)
        if label.startswith("warm"):
            check(
                TEMPLATE_MODULE in got["parent"],
                f"{label}: the rank was not forked from the template (parent: {got['parent']})",
            )
            held = {t.pid: nvidia_fds(t.pid) for t in templates()}
            check(bool(held), f"{label}: no warm-start template found")
            check(not any(held.values()), f"{label}: the template initialised CUDA: {held}")
    pids = gpu_pids()
    template_pids = [t.pid for t in templates()]
    check(
        not pids or not set(pids) & set(template_pids), f"nvidia-smi lists the template as holding GPU memory: {pids}"
    )
    return {
        "runs": runs,
        "cold_launch_s": runs[0]["launch_s"],
        "warm_launch_s": [r["launch_s"] for r in runs[2:]],
        "cold_cuda_ready_s": runs[0]["cuda_ready_s"],
        "warm_cuda_ready_s": [r["cuda_ready_s"] for r in runs[2:]],
        "nvidia_smi_pids": pids,
    }


def step_c_oom(work: str) -> dict[str, Any]:
    import psutil

    from spark_torch import DistributedRunError

    ranks = ship_bodies()
    before = probe()
    start = time.monotonic()
    try:
        distributor(use_gpu=True).run(ranks.out_of_memory, 1 << 30)
    except DistributedRunError as exc:
        message = str(exc)
    else:
        raise StepFailed("a rank asked for twice the GPU's memory and the run succeeded")
    data: dict[str, Any] = {
        "message": message[:2000],
        "seconds": time.monotonic() - start,
        "free_before": before["free"],
    }
    head = message.splitlines()[0] if message else ""
    check("rank 0" in head, f"the error does not lead with the rank: {head[:300]}", data)
    check(
        "OutOfMemoryError" in message or "out of memory" in message,
        f"the error does not name the OOM: {message[:600]}",
        data,
    )
    after = probe(want_free=before["free"] - MEMORY_TOLERANCE, wait_s=20)
    data["free_after"] = after["free"]
    check(
        after["free"] >= before["free"] - MEMORY_TOLERANCE,
        f"GPU memory not back within 20s: {before['free'] >> 20} MiB free before, {after['free'] >> 20} MiB after",
        data,
    )
    ours = {p.pid for p in psutil.Process().children(recursive=True)}
    data["nvidia_smi_pids"] = holding = gpu_pids()
    check(
        not holding or not ours & set(holding),
        f"processes of ours still hold GPU memory: {sorted(ours & set(holding or []))}",
        data,
    )
    return data


def step_d_sampler(work: str) -> dict[str, Any]:
    ranks = ship_bodies()
    got = distributor(use_gpu=True, stall_timeout=2).run(ranks.sampler_holds_no_tensor)
    check(got["interval"] == "0.2", f"the sampler ran every {got['interval']}s, not at its fastest (0.2s)", got)
    for i, r in enumerate(got["rounds"]):
        check(r["held"] - got["base"] >= got["bytes"], f"round {i}: the quarter tensor was not counted ({r})", got)
        check(
            r["after_del"] == got["base"],
            f"round {i}: after del, memory_allocated is {r['after_del']} not {got['base']}: something still holds the tensor ({r})",
            got,
        )
        check(
            r["after_return"] == got["base"],
            f"round {i}: after its frame returned, memory_allocated is {r['after_return']} not {got['base']} ({r})",
            got,
        )
        check(
            r["free_after_empty_cache"] >= got["free_before"] - MEMORY_TOLERANCE,
            f"round {i}: empty_cache() did not give the memory back ({r})",
            got,
        )
    return dict(got)


def _fr_stall(ranks: Any, work: str) -> dict[str, Any]:
    from spark_torch import RunStalledError

    log_dir = os.path.join(work, "stall-logs")
    try:
        distributor(use_gpu=True, stall_timeout=5, stall_action="fail", log_dir=log_dir, timeout=100).run(
            ranks.stall_in_nccl
        )
    except RunStalledError as exc:
        message = str(exc)
    else:
        raise StepFailed("a rank waiting on a queued NCCL all_reduce was not found stalled")
    # (stall_timeout=5: each set-up phase of the rank, CUDA and NCCL initialisation, takes less)
    trace_dir = os.path.join(log_dir, "flight-recorder", "attempt-0")
    trace = os.path.join(trace_dir, "rank_0.json")
    with open(os.path.join(log_dir, "rank-0.log"), encoding="utf-8", errors="replace") as fh:
        env_line = next((line for line in fh if "FR_ENV" in line), "")
    check(
        "'TORCH_FR_BUFFER_SIZE': '2000'" in env_line,
        f"TORCH_FR_BUFFER_SIZE not set in the rank: {env_line.strip()[:300]}",
    )
    check(os.path.isfile(trace), f"no Flight Recorder dump at {trace} (log_dir has {sorted(os.listdir(log_dir))})")
    with open(trace, encoding="utf-8") as fh:
        entries = json.load(fh).get("entries") or []
    check(trace_dir in message, f"the stall message does not name {trace_dir}: {message[-800:]}")
    check("nccl:all_reduce" in message, f"the stall message shows no NCCL all_reduce in flight: {message[-800:]}")
    return {"message_tail": message[-1500:], "entries": len(entries), "env": env_line.strip()[:400]}


def _fr_nccl_timeout(ranks: Any, work: str) -> dict[str, Any]:
    from spark_torch import DistributedRunError

    log_dir = os.path.join(work, "timeout-logs")
    prefix = os.path.join(log_dir, "nccl_trace_rank_")
    # torch (ProcessGroupNCCL.hpp): a dump on a watchdog timeout needs TORCH_NCCL_DUMP_ON_TIMEOUT=1 with
    # TORCH_NCCL_ENABLE_MONITORING=1 and a Flight Recorder buffer > 0 (spark_torch sets TORCH_FR_BUFFER_SIZE);
    # it is written to TORCH_NCCL_DEBUG_INFO_TEMP_FILE + the rank (newer name: TORCH_FR_DUMP_TEMP_FILE)
    env = {
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
    }
    os.makedirs(log_dir, exist_ok=True)
    started = time.monotonic()
    # torch 2.11 on an H200 (2026-11-27): the watchdog dumped, then the rank hung (its GPU still busy
    # with the spin kernel) instead of aborting; the run's timeout ends it, and the dump must be named
    try:
        distributor(use_gpu=True, log_dir=log_dir, env=env, timeout=40).run(ranks.nccl_watchdog_timeout, 5.0)
    except DistributedRunError as exc:
        message, ended_by = str(exc), type(exc).__name__
    else:
        raise StepFailed("an all_reduce past its NCCL timeout did not fail the run")
    dump = prefix + "0"
    check("rank 0" in message.splitlines()[0], f"the error does not lead with the rank: {message[:300]}")
    check(os.path.isfile(dump), f"torch's watchdog dump is not in log_dir ({sorted(os.listdir(log_dir))})")
    check(dump in message, f"the error does not name the dump {dump}: {message[-800:]}")
    return {
        "ended_by": ended_by,
        "headline": message.splitlines()[0][:300],
        "seconds": round(time.monotonic() - started, 1),
        "message_tail": message[-1500:],
        "dump_bytes": os.path.getsize(dump),
    }


def _healthy_sleepy_nccl(ranks: Any, work: str) -> dict[str, Any]:
    """A loop that sleeps 0.3 s and waits on an NCCL all_reduce each step, for 4 x stall_timeout
    with stall_action="fail": NCCL's per-group sequence numbers are its progress (issue 38), so it
    must finish."""
    steps, sleep_s = 40, 0.3
    started = time.monotonic()
    got = distributor(use_gpu=True, stall_timeout=3, stall_action="fail", timeout=100).run(
        ranks.sleepy_nccl_steps, steps, sleep_s
    )
    check(got == steps, f"the healthy NCCL loop returned {got!r}, not {steps}")
    return {"steps": steps, "sleep_s": sleep_s, "stall_timeout": 3, "seconds": round(time.monotonic() - started, 1)}


def step_e_nccl_fr(work: str) -> dict[str, Any]:
    ranks = ship_bodies()
    out: dict[str, Any] = {}
    failures = []
    for name, part in (
        ("stall", _fr_stall),
        ("nccl_timeout", _fr_nccl_timeout),
        ("healthy_sleepy", _healthy_sleepy_nccl),
    ):
        try:
            out[name] = part(ranks, work)
        except Exception as exc:  # noqa: BLE001 - one part failing must not hide the other
            text = str(exc) if isinstance(exc, StepFailed) else f"{type(exc).__name__}: {str(exc)[:1200]}"
            failures.append(f"{name}: {text}")
            out[name] = {"failed": text}
    if failures:
        raise StepFailed("; ".join(failures), out)
    return out


def step_f_ddp(work: str) -> dict[str, Any]:
    from analysis import alternating_pairs

    ranks = ship_bodies()
    # 3 pairs of 300 steps; GPU_CHECK_PAIRS / GPU_CHECK_STEPS only to rehearse the plumbing on a CPU
    pairs, steps = int(os.environ.get("GPU_CHECK_PAIRS", "3")), int(os.environ.get("GPU_CHECK_STEPS", "300"))
    width = int(os.environ.get("GPU_CHECK_WIDTH", "2048"))
    use_gpu = bool(probe_result().get("cuda"))

    def ours() -> float:
        return float(distributor(use_gpu=use_gpu, log_ranks=[]).run(ranks.ddp_steps, steps, width=width)["steps_per_s"])

    def torchrun() -> float:
        out = os.path.join(work, "torchrun.json")
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=1",
            os.path.join(HERE, "gpu_ranks.py"),
            out,
            str(steps),
            str(width),
        ]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=150)
        if done.returncode != 0:
            raise StepFailed(f"bare torchrun failed (exit {done.returncode}): {done.stderr.strip()[-600:]}")
        with open(out, encoding="utf-8") as fh:
            return float(json.load(fh)["steps_per_s"])

    result = alternating_pairs(pairs, ours, torchrun)
    result["spark_torch_steps_per_s"], result["torchrun_steps_per_s"] = result.pop("a"), result.pop("b")
    check("ratio" in result, f"too few pairs for a ratio: {result}")
    return result
