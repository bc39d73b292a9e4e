"""Every example in examples/ runs for real (local mode, 2 ranks) and computes the right thing.

Each example is imported as a module from its file (examples/ is not a package), so its
function is shipped to the ranks by value, exactly as when a user runs it from a repo.
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from spark_torch import Distributor

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def example(request: Any) -> Iterator[ModuleType]:
    name = request.param
    try:
        yield load_example(name)
    finally:
        sys.modules.pop(name, None)


def run2(fn: Any, **kwargs: Any) -> Any:
    return Distributor(num_processes=2, local_mode=True, timeout=240).run(fn, **kwargs)


@pytest.mark.parametrize("example", ["tutorial_p2p"], indirect=True)
def test_p2p(example: ModuleType, capsys: Any) -> None:
    result = run2(example.p2p)
    assert result == {"world_size": 2, "blocking_replies": [2.0], "ring_received": [1.0, 0.0]}
    out = capsys.readouterr().out
    assert "[rank 1] received 1.0 from rank 0" in out
    assert "[rank 0] ring: received 1.0 from rank 1" in out


@pytest.mark.parametrize("example", ["tutorial_collectives"], indirect=True)
def test_collectives(example: ModuleType) -> None:
    result = run2(example.collectives)
    assert result == example.expected(2)
    assert result["all_reduce_sum"] == [3.0, 3.0]
    assert result["all_to_all"] == [[0.0, 2.0], [1.0, 3.0]]


@pytest.mark.parametrize("example", ["ring_allreduce"], indirect=True)
def test_ring_allreduce(example: ModuleType) -> None:
    result = run2(example.demo, size=11)  # not a multiple of the world size: uneven chunks
    assert len(result["ring"]) == 11
    for ring, builtin, expected in zip(result["ring"], result["builtin"], result["expected"]):
        assert math.isclose(ring, expected, rel_tol=1e-12, abs_tol=1e-12)
        assert math.isclose(ring, builtin, rel_tol=1e-12, abs_tol=1e-12)
    assert result["max_abs_diff"] < 1e-9


@pytest.mark.parametrize("example", ["sync_sgd"], indirect=True)
def test_sync_sgd(example: ModuleType) -> None:
    result = run2(example.train, epochs=3)
    assert result["in_sync"] is True
    assert result["partition_sizes"] == [898, 898]  # 1797 digits, half each (int() floors)
    assert result["losses"][-1] < result["losses"][0]
    assert result["accuracy"] > 0.8


def test_data_partitioner_is_seeded_and_disjoint() -> None:
    sync_sgd = load_example("sync_sgd")
    try:
        data = list(range(100))
        parts = [sync_sgd.DataPartitioner(data, [0.25] * 4, seed=7).use(i) for i in range(4)]
        again = [sync_sgd.DataPartitioner(data, [0.25] * 4, seed=7).use(i) for i in range(4)]
        flat = [x for p in parts for x in (p[i] for i in range(len(p)))]
        assert sorted(flat) == data
        assert [p.index for p in parts] == [p.index for p in again]
    finally:
        sys.modules.pop("sync_sgd", None)


@pytest.mark.parametrize("example", ["fsdp_transformer"], indirect=True)
def test_fsdp_transformer(example: ModuleType, capsys: Any) -> None:
    result = run2(example.train, steps=30)
    model = example.make_model()
    expected_params = sum(p.numel() for p in model.parameters())
    assert result["num_params"] == expected_params  # the FULL state dict, gathered on rank 0
    assert sum(result["shard_numel"]) == expected_params  # each rank stores only its shard
    assert all(n < expected_params for n in result["shard_numel"])
    assert set(result["state_dict_keys"]) == set(model.state_dict())
    assert math.isfinite(result["final_loss"])
    assert result["final_loss"] < result["first_loss"]
    assert "[rank 0] full state dict on rank 0" in capsys.readouterr().out


@pytest.mark.parametrize("example", ["pipeline_parallel"], indirect=True)
def test_pipeline_parallel(example: ModuleType) -> None:
    result = run2(example.train, steps=12, batch_size=16, microbatches=4)
    assert result["output_shape"] == [16, 1]
    assert result["num_microbatches"] == 4
    assert len(result["losses"]) == 12
    assert all(math.isfinite(v) for v in result["losses"])
    assert result["losses"][-1] < result["losses"][0]
    assert all(n > 0 for n in result["stage_params"])


def test_train_script_by_path(tmp_path: Path, capsys: Any) -> None:
    import torch

    checkpoint = tmp_path / "out" / "model.pt"
    result = Distributor(num_processes=2, local_mode=True, timeout=240).run(
        str(EXAMPLES / "train_script.py"), "--lr", 0.1, "--epochs", 2, "--checkpoint", checkpoint
    )
    assert result is None  # scripts return nothing; failure would raise
    out = capsys.readouterr().out
    assert "[rank 0] rank 0/2" in out and "[rank 1] rank 1/2" in out
    assert f"[rank 0] saved checkpoint to {checkpoint}" in out

    ckpt = torch.load(checkpoint, weights_only=False)
    assert ckpt["world_size"] == 2
    assert ckpt["args"]["epochs"] == 2 and ckpt["args"]["lr"] == 0.1
    assert len(ckpt["losses"]) == 2 and ckpt["losses"][1] < ckpt["losses"][0]

    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = importlib.util.spec_from_file_location("train_script", EXAMPLES / "train_script.py")
        assert spec is not None and spec.loader is not None
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
    finally:
        sys.path.remove(str(EXAMPLES))
    model = script.build_model()
    model.load_state_dict(ckpt["model_state"])
    x, y, _, idx_test = script.load_data(ckpt["args"]["seed"])
    assert idx_test == ckpt["test_indices"]
    with torch.no_grad():
        accuracy = (model(x[idx_test]).argmax(1) == y[idx_test]).float().mean().item()
    assert accuracy > 0.85


def test_train_script_has_no_spark_torch_import() -> None:
    text = (EXAMPLES / "train_script.py").read_text()
    code = [line for line in text.splitlines() if line.startswith(("import", "from"))]
    assert not any("spark_torch" in line or "pyspark" in line for line in code)


@pytest.mark.parametrize(
    "name",
    ["tutorial_p2p", "tutorial_collectives", "ring_allreduce", "sync_sgd", "fsdp_transformer", "pipeline_parallel"],
)
def test_examples_have_a_cli(name: str) -> None:
    """``python examples/X.py --help`` works (argparse; nothing runs)."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "--num-processes" in done.stdout and "--local-mode" in done.stdout


def test_one_example_end_to_end_from_the_command_line() -> None:
    """The command line itself, in local mode (the other examples share the same main())."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "ring_allreduce.py"), "--local-mode", "--num-processes", "3"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[rank 2] ring all-reduce done" in done.stdout
    assert "max |ring - dist.all_reduce|" in done.stdout


def test_report_script_reports_and_resumes(tmp_path: Path) -> None:
    script = str(EXAMPLES / "report_script.py")
    d = Distributor(num_processes=2, storage_path=tmp_path, run_id="digits", timeout=240)
    d.run(script, "--epochs", "2")
    assert d.last_run is not None and [r["epoch"] for r in d.last_run.rows] == [0, 1]
    assert d.last_run.rows[-1]["accuracy"] > 0.5 and d.last_run.rows[-1]["loss"] < d.last_run.rows[0]["loss"]
    d.run(script, "--epochs", "3")  # the same run_id: resumes after epoch 1
    assert [(r["step"], r["epoch"]) for r in d.last_run.rows] == [(3, 2)]
