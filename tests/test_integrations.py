"""DeepSpeed, Hugging Face Trainer and Accelerate scripts run unchanged on spark_torch, on CPU
(tiny models built from a config: nothing is downloaded). The examples in examples/ are what
docs/deepspeed.md and docs/huggingface.md show."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spark_torch import DeepspeedTorchDistributor, Distributor

# one worker runs them all (pytest-xdist): the first DeepSpeed run on a fresh venv compiles its CPU
# communication op into TORCH_EXTENSIONS_DIR (minutes on 2 cores; in parallel runs one worker runs this file: scheduling.WHOLE_FILES)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CONFIG = {"train_batch_size": 16, "optimizer": {"type": "SGD", "params": {"lr": 0.05}}}


def _losses(text: str, tag: str) -> tuple[float, float]:
    match = re.search(rf"\[rank 0\] {tag}: world size 2, loss ([\d.]+) -> ([\d.]+)", text)
    assert match is not None, text[-3000:]
    return float(match.group(1)), float(match.group(2))


def test_deepspeed_script_with_a_dict_config(
    capsys: pytest.CaptureFixture[str], spark_session: Any, no_leftovers: None
) -> None:
    """As PySpark's: ``--deepspeed --deepspeed_config PATH`` after the script's arguments; a dict
    config becomes a JSON file on every node (here: two barrier tasks)."""
    pytest.importorskip("deepspeed")
    for local in (True, False):
        distributor = DeepspeedTorchDistributor(
            numGpus=1 if not local else 2,
            nnodes=2 if not local else 1,
            localMode=local,
            useGpu=False,
            deepspeedConfig=CONFIG,
        )
        assert distributor.num_processes == 2 and distributor.deepspeed_config == CONFIG
        assert distributor.run(str(EXAMPLES / "deepspeed_train.py"), "--steps=20") is None
        first, last = _losses(capsys.readouterr().out, "deepspeed")
        assert last < first
        assert distributor.input_params["deepspeed_config"] == CONFIG


def deepspeed_function(steps: int) -> float:
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    model = torch.nn.Linear(4, 1)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=CONFIG)
    for _ in range(steps):
        loss = engine(torch.ones(8, 4)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    return float(torch.distributed.get_world_size())


def test_deepspeed_function_and_bad_config(no_leftovers: None) -> None:
    pytest.importorskip("deepspeed")
    assert DeepspeedTorchDistributor(numGpus=2, useGpu=False).run(deepspeed_function, 3) == 2.0
    with pytest.raises(TypeError, match="deepspeedConfig must be a dict, the path of a JSON file, or None"):
        DeepspeedTorchDistributor(deepspeedConfig=42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="numGpus has to be a positive integer"):
        DeepspeedTorchDistributor(numGpus=0)


def test_transformers_trainer_through_the_cli(no_leftovers: None) -> None:
    pytest.importorskip("transformers")
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "spark_torch",
            "run",
            "-n",
            "2",
            "--log-ranks",
            "0",
            str(EXAMPLES / "hf_trainer.py"),
            "--max-steps",
            "6",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"\[rank 0\] trainer: world size 2, steps 6, loss [\d.]+", done.stdout), done.stdout[-2000:]


def test_accelerate_script(capsys: pytest.CaptureFixture[str], no_leftovers: None) -> None:
    pytest.importorskip("accelerate")
    Distributor(num_processes=2, log_ranks=[0]).run(str(EXAMPLES / "accelerate_train.py"), "--epochs=2")
    assert "[rank 0] accelerate: 2 processes, distributed type DistributedType.MULTI_CPU" in capsys.readouterr().out
