"""``from spark_torch import TorchDistributor``: PySpark's class, literally; TorchDistributor-style
code runs unchanged (constructor, attributes, run, exception types)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spark_torch import TorchDistributor

from .conftest import SCRIPTS


def train(learning_rate: float, use_gpu: bool = False) -> dict[str, Any]:
    """What a TorchDistributor user writes: env:// process group, DDP-style all_reduce."""
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl" if use_gpu else "gloo")
    t = torch.tensor([float(os.environ["RANK"]) + 1])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return {"sum": t.item(), "lr": learning_rate}


def test_local_mode_like_pyspark(no_leftovers: None) -> None:
    distributor = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False)
    assert (distributor.num_processes, distributor.local_mode, distributor.use_gpu, distributor.num_tasks) == (
        2,
        True,
        False,
        2,
    )
    assert distributor.ssl_conf == "pytorch.spark.distributor.ignoreSsl"
    assert distributor.run(train, 1e-3, use_gpu=False) == {"sum": 3.0, "lr": 1e-3}


def test_distributed_mode_like_pyspark(spark_session: Any, no_leftovers: None) -> None:
    distributor = TorchDistributor(num_processes=np.int64(2), local_mode=False, use_gpu=False)
    assert distributor.spark is spark_session and distributor.num_tasks == 2 and type(distributor.num_processes) is int
    assert distributor.run(train, 0.1) == {"sum": 3.0, "lr": 0.1}


def test_script_like_pyspark(spark_session: Any, tmp_path: Path, no_leftovers: None) -> None:
    assert (
        TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(
            str(SCRIPTS / "env_dump.py"), str(tmp_path), "--lr=1"
        )
        is None
    )
    infos = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [i["argv"] for i in infos] == [["--lr=1"], ["--lr=1"]]


def test_input_params_are_set_by_the_constructor() -> None:
    """As PySpark 4.3 does: the public settings, before any run(); a DeepSpeed distributor's
    config among them."""
    from spark_torch import DeepspeedTorchDistributor

    distributor = TorchDistributor(num_processes=2, local_mode=True, use_gpu=False)
    assert distributor.input_params == {"num_processes": 2, "local_mode": True, "use_gpu": False, "num_tasks": 2}
    deepspeed = DeepspeedTorchDistributor(
        numGpus=2, localMode=True, useGpu=False, deepspeedConfig={"train_batch_size": 4}
    )
    assert deepspeed.input_params == {
        "num_processes": 2,
        "local_mode": True,
        "use_gpu": False,
        "num_tasks": 2,
        "deepspeed_config": {"train_batch_size": 4},
    }


def test_input_params_are_pysparks(spark_session: Any) -> None:
    """The same dict as PySpark's own class gives, in both modes."""
    from pyspark.ml.torch.distributor import TorchDistributor as PySparkTorchDistributor

    for local in (True, False):
        theirs = PySparkTorchDistributor(num_processes=2, local_mode=local, use_gpu=False).input_params
        assert TorchDistributor(num_processes=2, local_mode=local, use_gpu=False).input_params == theirs


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_bad_num_processes_is_a_value_error(bad: Any) -> None:
    with pytest.raises(ValueError, match="num_processes has to be a positive integer"):
        TorchDistributor(num_processes=bad)


def test_gpu_settings_are_runtime_errors(spark_session: Any) -> None:
    """use_gpu=True (PySpark's default) without GPUs: RuntimeError, as PySpark raises."""
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    os.environ["PATH"] = "/usr/bin:/bin"  # no nvidia-smi
    with pytest.raises(RuntimeError, match="use_gpu=True but"):
        TorchDistributor(num_processes=2, local_mode=False)
    with pytest.raises(RuntimeError, match="use_gpu=True but"):
        TorchDistributor(num_processes=2, local_mode=True)


@pytest.mark.slow
def test_local_mode_more_processes_than_gpus_is_reset(gpu_local_spark: Any, caplog: pytest.LogCaptureFixture) -> None:
    """PySpark warns and uses as many processes as the driver has GPUs."""
    distributor = TorchDistributor(num_processes=3, local_mode=True, use_gpu=True)
    assert distributor.num_processes == 2 and distributor.num_tasks == 2
    assert "reset to 2" in caplog.text


@pytest.mark.slow
def test_encryption_is_a_runtime_error(tmp_path: Path) -> None:
    """A cluster that requires encryption: RuntimeError naming the key, as PySpark raises."""
    import subprocess
    import sys

    code = (
        "from pyspark.sql import SparkSession\n"
        "spark = (SparkSession.builder.master('local[1]').config('spark.driver.host', '127.0.0.1')"
        ".config('spark.ui.enabled', 'false').config('spark.ssl.enabled', 'true').getOrCreate())\n"
        "from spark_torch import TorchDistributor\n"
        "try:\n"
        "    TorchDistributor(num_processes=1, local_mode=False, use_gpu=False)\n"
        "except RuntimeError as exc:\n"
        "    print('RuntimeError:', exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert "RuntimeError: this Spark cluster requires encryption" in done.stdout, done.stderr[-3000:]
    assert "pytorch.spark.distributor.ignoreSsl=true" in done.stdout
