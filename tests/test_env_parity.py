"""The rank environment matches torchrun's where users rely on it: NCCL async error handling,
a per-rank TORCHELASTIC_ERROR_FILE whose content becomes the error's traceback, thread counts
that respect what the user or the cluster chose."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from spark_torch import DistributedRunError, Distributor
from spark_torch.driver.config import DistributorConfig
from spark_torch.driver.run.plan import make_plan
from spark_torch.driver.spark.cluster import ClusterInfo

from .conftest import SCRIPTS


def _env(*keys: str) -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in keys}


KEYS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_ERROR_FILE", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "RANK")


def test_torchrun_variables(no_leftovers: None) -> None:
    os.environ.pop("OMP_NUM_THREADS", None)
    ranks = [Distributor(num_processes=2).run(_env, *KEYS)]
    env = ranks[0]
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["TORCHELASTIC_ERROR_FILE"] and env["TORCHELASTIC_ERROR_FILE"].endswith("rank-0.torchelastic-error.json")
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == str(max(1, len(os.sched_getaffinity(0)) // 2))


def test_user_choices_win(no_leftovers: None) -> None:
    os.environ["OMP_NUM_THREADS"] = "3"  # exported on the driver: local-mode ranks keep it
    env = Distributor(num_processes=2, env={"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}).run(_env, *KEYS)
    assert env["OMP_NUM_THREADS"] == "3" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"
    env = Distributor(num_processes=2, env={"OMP_NUM_THREADS": "5"}).run(_env, *KEYS)
    assert env["OMP_NUM_THREADS"] == "5"


def test_cluster_thread_setting_is_kept() -> None:
    config = DistributorConfig(num_processes=2, local_mode=False)
    assert make_plan(config, ClusterInfo(task_cpus=4)).threads_per_rank == 4
    assert make_plan(config, ClusterInfo(task_cpus=4, executor_threads="8")).threads_per_rank is None


def test_record_error_file_becomes_the_traceback(no_leftovers: None) -> None:
    """A script using torch's @record fails on rank 1: the error names the exception and shows
    the traceback @record wrote, as torchrun's error summary would."""
    with pytest.raises(DistributedRunError) as info:
        Distributor(num_processes=2).run(str(SCRIPTS / "elastic_record.py"))
    message = str(info.value)
    assert message.startswith("rank 1 on ") and "failed: ValueError: shard 1 is corrupt" in message.splitlines()[0]
    assert "Traceback from rank 1" in message and "in load_shard" in message


def _whole_env() -> dict[str, str]:
    return dict(os.environ)


#: set by a node for its own ranks' plumbing (spark_torch.base.envnames), not part of the contract
INTERNAL = {
    "SPARK_TORCH_PARENT_PID",
    "SPARK_TORCH_REPORT_FDS",
    "SPARK_TORCH_STORAGE",
    "SPARK_TORCH_START_STEP",
    "SPARK_TORCH_CHECKPOINT",
    "SPARK_TORCH_DATA_FILE",
    "SPARK_TORCH_DATA_COLUMNS",
    "SPARK_TORCH_DATA_ROWS",
}
ROOT = Path(__file__).resolve().parent.parent


def _function_main_table() -> set[str]:
    """The variables in the first column of the table in spark_torch/rank/function_main.py."""
    import spark_torch.rank.function_main as function_main

    doc = function_main.__doc__ or ""
    rulers = [i for i, line in enumerate(doc.splitlines()) if re.fullmatch(r"=+ +=+", line)]
    assert len(rulers) == 2, "function_main's docstring has one table between two rulers"
    rows = doc.splitlines()[rulers[0] + 1 : rulers[1]]
    width = doc.splitlines()[rulers[0]].index(" ")
    return {name for row in rows for name in re.findall(r"``([A-Z_]+)``", row[:width])}


def _concepts_table() -> set[str]:
    """The variables in the first column of the environment table in docs/concepts.md."""
    page = (ROOT / "docs" / "concepts.md").read_text(encoding="utf-8")
    table = page[page.index("| variable | value |") :].split("\n\n")[0]
    return {name for row in table.splitlines()[2:] for name in re.findall(r"`([A-Z_]+)`", row.split("|")[1])}


def _readme_names() -> set[str]:
    page = (ROOT / "README.md").read_text(encoding="utf-8")
    paragraph = page[page.index("Every rank gets torchrun's environment") :].split("\n\n")[0]
    return set(re.findall(r"`([A-Z][A-Z_]+)`", paragraph))


def test_environment_tables_are_what_a_rank_gets(no_leftovers: None) -> None:
    """The tables in function_main's docstring and docs/concepts.md, and README's list, name
    every variable a real rank gets from spark_torch and nothing it does not get."""
    before = dict(os.environ)
    env = Distributor(num_processes=2).run(_whole_env)
    documented = _function_main_table()
    assert documented == _concepts_table(), "function_main.py and docs/concepts.md list different variables"
    assert documented - env.keys() == set(), "documented but not set for a rank"
    set_by_spark_torch = {k for k, v in env.items() if before.get(k) != v} - INTERNAL
    assert set_by_spark_torch - documented == set(), "set for a rank but not documented"
    assert _readme_names() <= documented and _readme_names() - env.keys() == set()
