"""benchmarks/gpu_check.py, the device check, on this machine: without CUDA, pyspark,
cryptography or an installed spark_torch (as on the GPU image, which lacks the last three) every
GPU step says "skipped: no CUDA", the steps that need no GPU pass, the JSON summary is written and the exit status is 0; a
step past its deadline is killed whole and reported as failed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
GPU_STEPS = ("a_rank_gpu", "b_warm_cuda", "c_oom", "d_sampler", "e_nccl_fr", "f_ddp")
#: what the GPU image lacks: importing either fails in the check and in everything it starts
BLOCKER = """
import sys

class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pyspark", "cryptography"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: the GPU image has none)", name=name)
        return None

sys.meta_path.insert(0, _Blocked())

# nor is spark_torch installed there: drop this venv's editable install, so that the check, the
# template, the reaper and the ranks find it only as the check puts it on the path
def _editable(finder):
    return "__editable__" in (getattr(finder, "__module__", "") or "") or "__editable__" in type(finder).__module__

sys.meta_path[:] = [f for f in sys.meta_path if not _editable(f)]
sys.path_hooks[:] = [h for h in sys.path_hooks if "__editable__" not in (getattr(h, "__module__", "") or "")]
sys.path_importer_cache.clear()
"""


def _run(
    tmp_path: Path, *args: str, timeout: float = 300, extra_env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], float]:
    """The check as the GPU machine runs it, from outside the tree, with pyspark and cryptography
    unimportable and spark_torch not installed (a sitecustomize on PYTHONPATH), no CUDA visible."""
    shim = tmp_path / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": str(shim), "CUDA_VISIBLE_DEVICES": "", **(extra_env or {})}
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )
    return done, time.monotonic() - start


def _summary(out: Path) -> dict[str, Any]:
    with open(out / "gpu_check.json", encoding="utf-8") as fh:
        return dict(json.load(fh))


def test_without_cuda_or_pyspark_every_gpu_step_is_skipped_and_the_rest_passes(
    tmp_path: Path, no_leftovers: None
) -> None:
    out = tmp_path / "out"
    done, _ = _run(tmp_path, "--out", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if line.startswith("step "))
    for name in GPU_STEPS:
        assert lines[f"step {name}"] == "skipped: no CUDA", done.stdout
    assert lines["step env"].startswith("pass") and lines["step local_cpu"].startswith("pass"), (
        done.stdout + (out / "gpu_check.log").read_text()
    )
    summary = _summary(out)
    assert summary["cuda"] is False and summary["passed"] is True
    assert [s["name"] for s in summary["steps"]] == ["env", "local_cpu", *GPU_STEPS]
    assert {s["name"]: s["status"] for s in summary["steps"]} == {
        "env": "pass",
        "local_cpu": "pass",
        **dict.fromkeys(GPU_STEPS, "skipped"),
    }
    assert not [s for s in summary["steps"] if s.get("left_behind")], "a step left processes running"
    env = summary["steps"][0]["data"]
    # the no-pyspark claim: neither was importable, and local mode ran (2 ranks, gloo, warm) all the same
    assert env["importable"]["pyspark"] is False and env["importable"]["cryptography"] is False, env
    assert env["spark_torch"] == str(ROOT / "spark_torch" / "__init__.py"), env
    local = summary["steps"][1]["data"]
    assert [r["sum"] for r in local["runs"]] == [[3.0, 3.0], [3.0, 3.0]] and local["templates"], local
    assert not list(Path(os.environ["TMPDIR"]).glob("gpu_check-*")), "the check left its work folder behind"


def test_a_step_past_its_deadline_is_killed_and_reported_failed(tmp_path: Path, no_leftovers: None) -> None:
    out = tmp_path / "out"
    # the step blocks until it is killed (GPU_CHECK_HANG_STEPS): the overrun does not depend on the machine's speed
    done, _ = _run(
        tmp_path,
        "--out",
        str(out),
        "--only",
        "local_cpu",
        "--step-deadline",
        "2",
        extra_env={"GPU_CHECK_HANG_STEPS": "local_cpu"},
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert (
        "step local_cpu: fail (" in done.stdout and "timed out after 2s (killed; see gpu_check.log)" in done.stdout
    ), done.stdout
    summary = _summary(out)
    assert summary["passed"] is False and [s["status"] for s in summary["steps"]] == ["fail"], summary
    # killed at its 2 s deadline, not at the step's own 120 s (the whole check's time also counts the
    # torch import of its CUDA probe, which depends on the machine's load)
    seconds = summary["steps"][0]["seconds"]
    assert seconds < 20, f"the step ended {seconds:.0f}s after it started, with a 2s deadline"


def test_an_unknown_step_is_refused_naming_the_steps(tmp_path: Path) -> None:
    done, took = _run(tmp_path, "--out", str(tmp_path / "out"), "--only", "nosuch", timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "unknown step(s) ['nosuch']; the steps are ['env', 'local_cpu', 'a_rank_gpu'" in done.stderr, done.stderr
    assert not (tmp_path / "out" / "gpu_check.json").exists()


def test_out_is_required(tmp_path: Path) -> None:
    done, _ = _run(tmp_path, timeout=120)
    assert done.returncode == 2 and "--out DIR is required" in done.stderr, done.stderr
