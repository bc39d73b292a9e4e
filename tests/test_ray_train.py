"""What a Ray Train user keeps (docs/ray-train.md): init_process_group/prepare_model/
prepare_data_loader with DDP on gloo in both modes, Checkpoint.from_directory/as_directory with
report(), RunResult.from_path(run_dir)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import spark_torch
from spark_torch import Checkpoint, Distributor, RunResult

from .ray_train_programs import context_and_device, ddp_with_prepare, report_checkpoint_objects

ROOT = Path(__file__).resolve().parent.parent


def _check_ddp(out: dict[str, Any], samples: int = 16) -> None:
    assert out["backend"] == "gloo" and out["ddp"] == "DistributedDataParallel"
    assert out["device"] == out["batch_device"] == "cpu"
    assert out["sampler"] == "DistributedSampler" and out["batch_size"] == 2 and out["batches"] == samples // 2 // 2
    first, second = (set(s) for s in out["seen"])
    assert not first & second and first | second == set(range(samples))  # disjoint halves of the data
    assert out["epochs_differ"]  # shuffled again in the second epoch (set_epoch)
    assert out["grads"][0] == out["grads"][1]  # DDP averaged the gradients of different batches
    assert out["sum"] == 3.0  # all_reduce of 1 + 2


def test_prepare_ddp_on_gloo_local_mode(no_leftovers: None) -> None:
    _check_ddp(Distributor(num_processes=2, local_mode=True, log_ranks=[]).run(ddp_with_prepare))


def test_prepare_ddp_on_gloo_distributed(spark_session: Any, no_leftovers: None) -> None:
    d = Distributor(num_processes=2, local_mode=False, spark=spark_session, log_ranks=[])
    _check_ddp(d.run(ddp_with_prepare))


def test_prepare_with_one_rank_keeps_the_model_and_loader() -> None:
    """World size 1 (no process group): the model is only moved, the loader only wrapped."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    os.environ.update(WORLD_SIZE="1", LOCAL_RANK="0")
    model = torch.nn.Linear(1, 1)
    assert spark_torch.prepare_model(model) is model
    loader = DataLoader(TensorDataset(torch.arange(6.0)), batch_size=4, shuffle=False)
    prepared = spark_torch.prepare_data_loader(loader)
    assert prepared.loader is loader and len(prepared) == 2 and prepared.batch_size == 4
    assert [b[0].tolist() for b in prepared] == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0]]


def test_prepare_data_loader_refuses_a_batch_sampler() -> None:
    import torch
    import torch.distributed as dist
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

    os.environ.update(WORLD_SIZE="2", LOCAL_RANK="0")
    dataset = TensorDataset(torch.arange(4.0))
    loader = DataLoader(dataset, batch_sampler=BatchSampler(SequentialSampler(dataset), 2, False))
    with pytest.raises(ValueError, match=r"batch_sampler.*build it with batch_size="):
        spark_torch.prepare_data_loader(loader)
    assert not dist.is_initialized()


def test_checkpoint_from_directory_and_as_directory(tmp_path: Path, no_leftovers: None) -> None:
    """report(checkpoint=Checkpoint.from_directory(d)) persists d; the next run gets it back
    through get_checkpoint() -> from_directory().as_directory(); a rank that uses Checkpoint
    loads no driver module; a remote (file://) Checkpoint is downloaded for the upload."""
    d = Distributor(num_processes=2, storage_path=tmp_path, run_id="ray-style", log_ranks=[])
    first = d.run(report_checkpoint_objects)
    assert first == {"resumed": None, "ways": {}, "driver_modules": []}
    result = d.last_run
    assert result is not None and result.checkpoint is not None and result.checkpoint.step == 1
    with result.checkpoint.as_directory() as directory:
        assert directory == result.checkpoint.path  # local: the checkpoint itself, nothing copied
        assert Path(directory, "state.txt").read_text() == "written by run ray-style"
    assert os.path.isdir(result.checkpoint.path)  # and not removed on exit
    second = d.run(report_checkpoint_objects, remote=True)
    assert second["resumed"] == "written by run ray-style"
    text = "written by run ray-style"  # get_checkpoint() is a Checkpoint, and every way a path worked still works
    assert second["ways"] == {
        "open(os.path.join)": text,
        "/": text,
        "fspath": text,
        "str": text,
        "from_directory": text,
        "type": "Checkpoint",
        "step": 1,
    }
    assert second["driver_modules"] == []
    assert d.last_run is not None and d.last_run.checkpoint is not None and d.last_run.checkpoint.step == 2
    assert Path(d.last_run.checkpoint.path, "state.txt").read_text() == "written by run ray-style"


def test_as_directory_of_a_remote_checkpoint_removes_its_download(tmp_path: Path) -> None:
    source = tmp_path / "stored"
    (source / "sub").mkdir(parents=True)
    (source / "sub" / "w.txt").write_text("7")
    remote = Checkpoint(f"file://{source}", step=3)
    with remote.as_directory() as directory:
        assert directory != str(source) and Path(directory, "sub", "w.txt").read_text() == "7"
    assert not os.path.exists(directory)


def test_from_directory_refuses_what_is_not_a_local_directory(tmp_path: Path) -> None:
    for bad in (tmp_path / "missing", "s3://bucket/ckpt"):
        with pytest.raises(
            NotADirectoryError, match=r"not a local directory; write the checkpoint's files into a local directory"
        ):
            Checkpoint.from_directory(bad)
    wrapped = Checkpoint.from_directory(tmp_path)
    assert wrapped.path == str(tmp_path) == os.fspath(wrapped) and wrapped.step == 0


def test_a_rank_using_checkpoint_loads_no_driver_module() -> None:
    code = (
        "import sys, tempfile, spark_torch; spark_torch.Checkpoint.from_directory(tempfile.gettempdir()); "
        "print(sorted(m for m in sys.modules if m.startswith(('spark_torch.driver', 'spark_torch.node', 'torch'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "[]"


def test_a_checkpoint_on_remote_storage_refuses_slash(tmp_path: Path) -> None:
    local = Checkpoint(str(tmp_path), step=2, metrics={"loss": 0.5})
    assert (
        local / "a" / "b.pt" == tmp_path / "a" / "b.pt"
        and {local: 1}[Checkpoint(str(tmp_path), step=2, metrics={"loss": 0.5})] == 1
    )
    with pytest.raises(
        ValueError,
        match=r"the checkpoint is on remote storage, not a local path; use `with checkpoint.as_directory\(\) as d:`",
    ):
        Checkpoint("s3://bucket/run/checkpoint_000002", step=2) / "state.pt"


@pytest.mark.parametrize("local_mode", [True, False], ids=["local", "distributed"])
def test_get_context_and_get_device_read_the_ranks_torchrun_variables(
    local_mode: bool, spark_session: Any, no_leftovers: None
) -> None:
    d = Distributor(
        num_processes=2, local_mode=local_mode, spark=None if local_mode else spark_session, use_gpu=False, log_ranks=[]
    )
    everyone = d.run(context_and_device)
    for rank, seen in enumerate(everyone):
        assert seen["context"] == seen["env"], seen
        assert seen["context"][:2] == [rank, 2] and seen["device"] == "cpu" and seen["driver_modules"] == []
    if local_mode:  # one node with both ranks
        assert [seen["context"][2:] for seen in everyone] == [[0, 2, 0], [1, 2, 0]]
    else:  # local[2]: two nodes of one rank each
        assert [seen["context"][2:] for seen in everyone] == [[0, 1, 0], [0, 1, 1]]


def test_get_context_outside_a_rank_says_where_it_works() -> None:
    code = (
        "import os, spark_torch\n"
        "for name in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'NODE_RANK', 'GROUP_RANK'): os.environ.pop(name, None)\n"
        "try:\n    spark_torch.get_context()\nexcept RuntimeError as exc:\n    print(exc)\n"
        "print(spark_torch.get_device())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    ).stdout
    assert out.splitlines() == [
        "spark_torch.get_context() works inside ranks started by spark_torch (Distributor.run or spark-torch run), whose "
        "environment has torchrun's variables; this process lacks RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, "
        "NODE_RANK (or GROUP_RANK)",
        "cpu",
    ]


def test_get_context_reads_torchruns_group_rank_too() -> None:
    from spark_torch.rank.prepare import context_from

    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"}
    context = context_from(env)
    assert [
        context.get_world_rank(),
        context.get_world_size(),
        context.get_local_rank(),
        context.get_local_world_size(),
        context.get_node_rank(),
    ] == [5, 8, 1, 4, 1]
    with pytest.raises(RuntimeError, match=r"lacks LOCAL_WORLD_SIZE$"):
        context_from({**env, "LOCAL_WORLD_SIZE": ""})


def test_run_result_from_the_run_directory_alone(tmp_path: Path, no_leftovers: None) -> None:
    from .report_programs import report_scores

    d = Distributor(num_processes=1, storage_path=tmp_path, log_ranks=[])
    d.run(report_scores, [0.2, 0.8, 0.5])
    result = d.last_run
    assert result is not None and result.path is not None
    past = RunResult.from_path(result.path, checkpoint_score_attribute="score")
    assert past.run_id == result.run_id and past.path == result.path and past.history == result.history
    assert [c.step for c, _ in past.best_checkpoints] == [2, 3, 1] and past.checkpoint is not None
    assert RunResult.from_path(Path(result.path)).run_id == result.run_id  # a Path too
    assert RunResult.from_path(tmp_path, result.run_id).history == result.history  # the two-argument form
    with pytest.raises(
        FileNotFoundError,
        match=rf"not a run's directory.*holding the runs {result.run_id}: pass one run's directory, e.g. '{tmp_path / result.run_id}'",
    ):
        RunResult.from_path(tmp_path)  # the storage, not a run
    with pytest.raises(
        FileNotFoundError, match=r"not a run's directory.*pass the run's own directory \(STORAGE/RUN_ID"
    ):
        RunResult.from_path(tmp_path / "nothing-here")


def test_the_ray_train_page_names_what_exists() -> None:
    """docs/ray-train.md: every spark_torch name and Distributor keyword in its table exists, and
    the table covers the Ray Train names a migrating user looks for."""
    import importlib
    import inspect
    import re

    page = (ROOT / "docs" / "ray-train.md").read_text(encoding="utf-8")
    rows = [line.split(" | ") for line in page.splitlines() if line.startswith("| ") and not line.startswith("|---")]
    ray_column = " ".join(row[0] for row in rows)
    for name in (
        "TorchTrainer",
        "ScalingConfig",
        "RunConfig",
        "FailureConfig",
        "train_loop_config",
        "ray.train.report",
        "get_checkpoint",
        "Checkpoint.from_directory",
        "as_directory",
        "Result.from_path",
        "get_dataset_shard",
        "prepare_model",
        "prepare_data_loader",
    ):
        assert name in ray_column, name
    ours = " ".join(row[1] for row in rows[1:])
    for dotted in set(re.findall(r"spark_torch(?:\.\w+)+", ours)):
        parts = dotted.split(".")
        target: Any = importlib.import_module("spark_torch")
        for index, part in enumerate(parts[1:], start=1):
            target = (
                getattr(target, part)
                if hasattr(target, part)
                else importlib.import_module(".".join(parts[: index + 1]))
            )
    keywords = set(inspect.signature(Distributor.__init__).parameters) | set(
        inspect.signature(spark_torch.report).parameters
    )
    used = set(re.findall(r"(\w+)=", ours)) - {"init_method"}
    assert used <= keywords, used - keywords


def test_the_ray_train_page_opening_is_the_code() -> None:
    """docs/ray-train.md's opening: every name it says ports with a rename exists under
    spark_torch, get_checkpoint() is documented (and annotated) as a Checkpoint with
    as_directory(), and the context's getters are the ones RankContext has."""
    import inspect
    import re

    page = (ROOT / "docs" / "ray-train.md").read_text(encoding="utf-8")
    opening = " ".join(page.split("## Side by side")[0].split())
    renamed = re.search(r"become `spark_torch\.` for (.*?); `TorchTrainer", opening)
    assert renamed, opening
    names = re.findall(r"`(\w+(?:\.\w+)?)`", renamed.group(1))
    assert {"report", "get_checkpoint", "get_context", "get_device", "prepare_model", "prepare_data_loader"} <= set(
        names
    )
    for name in names:
        if name.startswith("get_") and name not in ("get_checkpoint", "get_context", "get_device"):
            assert hasattr(spark_torch.RankContext, name), name  # a getter of the context
        else:
            owner, _, attribute = name.partition(".")
            assert hasattr(getattr(spark_torch, owner), attribute or "__call__"), name
    assert "`get_checkpoint` (a `Checkpoint` with `as_directory()`)" in opening
    assert inspect.signature(spark_torch.get_checkpoint).return_annotation == "Checkpoint | None"
    assert "`Result.from_path` is `RunResult.from_path`" in opening and hasattr(RunResult, "from_path")
    (row,) = [line for line in page.splitlines() if line.startswith("| `ray.train.get_checkpoint()`")]
    assert "pathlib.Path" not in row and "`spark_torch.Checkpoint`" in row and "as_directory()" in row
