"""The digits DDP example (examples/ddp_digits.py) trains for real and reaches > 0.9 accuracy."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from spark_torch import Distributor

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ddp_digits.py"
EPOCHS = 5


@pytest.fixture
def ddp_digits() -> Iterator[ModuleType]:
    """examples/ddp_digits.py imported as module ``ddp_digits`` (examples is not a package).

    It is registered in sys.modules like any user module on the driver; the executors cannot
    import it, so spark_torch has to ship ``train`` by value.
    """
    spec = importlib.util.spec_from_file_location("ddp_digits", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ddp_digits"] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("ddp_digits", None)


def test_ddp_digits_distributed(spark_session: Any, ddp_digits: ModuleType, no_leftovers: None) -> None:
    result = Distributor(num_processes=2, local_mode=False, spark=spark_session, timeout=240).run(
        ddp_digits.train, epochs=EPOCHS, seed=0
    )
    assert result["world_size"] == 2
    assert result["test_accuracy"] > 0.9, result
    losses = result["losses"]
    assert len(losses) == EPOCHS
    assert losses[-1] < losses[0]


@pytest.mark.slow
def test_ddp_digits_script() -> None:
    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable)
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--epochs", str(EPOCHS)],
        cwd=EXAMPLE.parent.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=240,
    )
    output = proc.stdout
    assert proc.returncode == 0, output
    assert "[rank 0] epoch" in output, output
    assert "test accuracy:" in output, output
