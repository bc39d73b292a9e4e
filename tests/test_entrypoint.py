"""Bad entry points fail before anything starts, with errors naming the problem."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from spark_torch import Distributor, PicklingError
from spark_torch.driver.run.entrypoint import FunctionEntrypoint, ScriptEntrypoint, make_entrypoint
from spark_torch.driver.run.payload import dump_function_payload
from spark_torch.errors import ArgumentError
from spark_torch.shared.rank_files import load_function_payload

from .conftest import run_temp_dirs


def test_function_and_script_detected(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    assert isinstance(make_entrypoint(len, (1,), {}), FunctionEntrypoint)
    entry = make_entrypoint(str(script), ("--lr", 0.1), {})
    assert isinstance(entry, ScriptEntrypoint) and entry.argv == ("--lr", "0.1")


def test_missing_script(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(FileNotFoundError, match=r"training script not found: .*nope\.py"):
        Distributor(num_processes=2).run(str(tmp_path / "nope.py"))
    assert time.monotonic() - start < 5


def test_script_is_directory(tmp_path: Path) -> None:
    with pytest.raises(IsADirectoryError, match="is a directory; pass the path of a .py file"):
        Distributor().run(str(tmp_path))


def test_kwargs_with_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(ValueError, match=r"keyword arguments \['lr'\] cannot be passed to a script"):
        Distributor().run(str(script), lr=0.1)


def test_main_of_wrong_type() -> None:
    with pytest.raises(TypeError, match="main must be a function or the path"):
        Distributor().run(42)


def test_unpicklable_argument_named() -> None:
    lock = threading.Lock()

    def train(x: object) -> None:
        return None

    before = set(run_temp_dirs())
    start = time.monotonic()
    with pytest.raises(PicklingError, match=r"positional argument 0 \(lock") as info:
        Distributor(num_processes=2).run(train, lock)
    assert isinstance(info.value, TypeError)
    assert "create them inside the function" in str(info.value)
    assert time.monotonic() - start < 5
    assert set(run_temp_dirs()) == before


def test_unpicklable_closure_variable_named() -> None:
    lock = threading.Lock()

    def train() -> bool:
        return lock.locked()

    with pytest.raises(PicklingError, match=r"closure variable 'lock'"):
        dump_function_payload(FunctionEntrypoint(train))


def test_payload_round_trip() -> None:
    data = dump_function_payload(FunctionEntrypoint(divmod, (7, 2), {}))
    fn, args, kwargs = load_function_payload(data)
    assert fn(*args, **kwargs) == (3, 1)


def takes_epochs(lr: float, epochs: int = 1) -> float:
    return lr * epochs


def test_a_misspelt_keyword_fails_before_launch_in_local_mode() -> None:
    """``epoch=3`` for ``epochs``: an ArgumentError on the driver, before any rank or session."""
    distributor = Distributor(num_processes=2, local_mode=True)
    with pytest.raises(ArgumentError, match=r"unexpected keyword argument 'epoch' \(did you mean 'epochs'\?\)"):
        distributor.run(takes_epochs, 0.1, epoch=3)
    assert distributor.last_run is None  # the run never began: no rank, no run directory
    assert run_temp_dirs() == []


def test_a_misspelt_keyword_fails_before_any_spark_job(spark_session: Any, no_leftovers: None) -> None:
    """Distributed mode: no Spark job between two probe jobs, so neither preflight nor the barrier stage ran."""
    sc = spark_session.sparkContext

    def probe(group: str) -> list[int]:
        sc.setJobGroup(group, group)
        try:
            spark_session.range(1).count()
        finally:
            sc.setLocalProperty("spark.jobGroup.id", None)
        return sorted(sc.statusTracker().getJobIdsForGroup(group))

    before = probe("before-argument-check")
    distributor = Distributor(num_processes=2, local_mode=False, spark=spark_session)
    with pytest.raises(ArgumentError, match=r"'epoch' \(did you mean 'epochs'\?\).*no rank was started"):
        distributor.run(takes_epochs, 0.1, epoch=3)
    after = probe("after-argument-check")
    assert after[0] == before[-1] + 1, "a Spark job ran between the probes"
    assert distributor.last_run is None
