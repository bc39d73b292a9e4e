"""End to end in distributed mode: Spark barrier tasks on local[2] and local-cluster[2,1,1024]."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest

from spark_torch import ConfigurationError, DistributedRunError, Distributor, InsufficientSlotsError

from .conftest import SCRIPTS


def world_info(tag: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    keys = (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "NODE_RANK",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "OMP_NUM_THREADS",
    )
    mine = {k: os.environ[k] for k in keys}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return {"tag": tag, "sum": t.item(), "ranks": gathered}


def check_world(out: dict[str, Any]) -> None:
    assert out["tag"] == "x" and out["sum"] == 2.0
    ranks = out["ranks"]
    assert [r["RANK"] for r in ranks] == ["0", "1"]
    assert [r["NODE_RANK"] for r in ranks] == ["0", "1"] == [r["GROUP_RANK"] for r in ranks]
    assert all(r["LOCAL_RANK"] == "0" and r["LOCAL_WORLD_SIZE"] == "1" and r["WORLD_SIZE"] == "2" for r in ranks)
    assert len({(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in ranks}) == 1
    assert ranks[0]["MASTER_ADDR"] == "127.0.0.1"
    assert all(r["OMP_NUM_THREADS"] == "1" for r in ranks)


@pytest.mark.smoke
def test_function_local2(spark_session: Any, no_leftovers: None) -> None:
    environ_before = dict(os.environ)
    out = Distributor(num_processes=2, local_mode=False, spark=spark_session).run(world_info, "x")
    check_world(out)
    assert dict(os.environ) == environ_before


@pytest.mark.slow
def test_function_cluster(cluster_spark: Any, no_leftovers: None) -> None:
    check_world(Distributor(num_processes=2, local_mode=False, spark=cluster_spark).run(world_info, tag="x"))


def _script_run(spark: Any, tmp_path: Path) -> None:
    result = Distributor(num_processes=2, local_mode=False, spark=spark, env={"EXTRA_VAR": "y"}).run(
        str(SCRIPTS / "env_dump.py"), tmp_path, "--batch_size=16"
    )
    assert result is None
    infos = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [i["NODE_RANK"] for i in infos] == ["0", "1"] and all(i["sum"] == 2.0 for i in infos)
    assert all(i["EXTRA_VAR"] == "y" and i["argv"] == ["--batch_size=16"] for i in infos)


@pytest.mark.smoke
def test_script_local2(spark_session: Any, tmp_path: Path, no_leftovers: None) -> None:
    _script_run(spark_session, tmp_path)


@pytest.mark.slow
def _rpc_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "Spark's RPC is not encrypted" in r.getMessage()]


def test_a_cluster_run_without_rpc_encryption_warns_once(
    cluster_spark: Any, caplog: pytest.LogCaptureFixture, no_leftovers: None
) -> None:
    """local-cluster with spark.network.crypto.enabled off: the run secret travels in the task
    closure, in clear; one WARNING says so and what to set (docs/security.md)."""
    with caplog.at_level(logging.WARNING, logger="spark_torch"):
        Distributor(num_processes=1, local_mode=False, spark=cluster_spark).run(os.getpid)
    (line,) = _rpc_warnings(caplog)
    assert "channel secret reaches the executors inside the Spark task" in line
    assert "spark.authenticate=true and spark.network.crypto.enabled=true" in line


def test_a_local_master_run_does_not_warn_about_rpc_encryption(
    spark_session: Any, caplog: pytest.LogCaptureFixture, no_leftovers: None
) -> None:
    """local[2]: the tasks never leave this machine's processes; no warning."""
    with caplog.at_level(logging.WARNING, logger="spark_torch"):
        Distributor(num_processes=1, local_mode=False, spark=spark_session).run(os.getpid)
    assert _rpc_warnings(caplog) == []


def test_script_cluster(cluster_spark: Any, tmp_path: Path, no_leftovers: None) -> None:
    _script_run(cluster_spark, tmp_path)


def raise_on_rank1() -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    if dist.get_rank() == 1:
        print("rank 1 is about to fail", flush=True)
        raise ValueError("bad learning rate")
    dist.all_reduce(torch.ones(1))
    dist.barrier()


def fail_before_init_on_rank1() -> None:
    """Rank 0 waits in init_process_group (30 min default) unless it is torn down."""
    import torch.distributed as dist

    if os.environ["RANK"] == "1":
        raise RuntimeError("could not read the data")
    dist.init_process_group("gloo", init_method="env://")


def _assert_fails_fast(spark: Any, fn: Any, pattern: str, cause: type[BaseException]) -> None:
    start = time.monotonic()
    with pytest.raises(DistributedRunError, match=pattern) as info:
        Distributor(num_processes=2, local_mode=False, spark=spark).run(fn)
    assert time.monotonic() - start < 60
    assert isinstance(info.value, RuntimeError) and info.value.rank == 1
    assert isinstance(info.value.__cause__, cause)
    assert "Traceback from rank 1" in str(info.value)


@pytest.mark.smoke
def test_rank_failure_local2(spark_session: Any, no_leftovers: None) -> None:
    _assert_fails_fast(
        spark_session, raise_on_rank1, r"^rank 1 on 127\.0\.0\.1 failed: ValueError: bad learning rate", ValueError
    )


def test_rank_failure_before_init_local2(spark_session: Any, no_leftovers: None) -> None:
    _assert_fails_fast(
        spark_session, fail_before_init_on_rank1, r"^rank 1 on .* failed: RuntimeError: could not read", RuntimeError
    )


@pytest.mark.slow
def test_rank_failure_cluster(cluster_spark: Any, no_leftovers: None) -> None:
    _assert_fails_fast(
        cluster_spark, fail_before_init_on_rank1, r"^rank 1 on .* failed: RuntimeError: could not read", RuntimeError
    )


def test_script_exit_code_distributed(spark_session: Any, no_leftovers: None) -> None:
    with pytest.raises(DistributedRunError, match=r"^rank 1 on .* failed: exited with code 2"):
        Distributor(num_processes=2, local_mode=False, spark=spark_session).run(str(SCRIPTS / "exit_code.py"), 2, 1)


def test_more_tasks_than_slots(spark_session: Any, no_leftovers: None) -> None:
    start = time.monotonic()
    with pytest.raises(
        InsufficientSlotsError, match=r"needs 3 Spark task slots at once .* has 2\. Use num_processes<=2"
    ):
        Distributor(num_processes=3, local_mode=False, spark=spark_session).run(world_info, "x")
    assert time.monotonic() - start < 5


def chatty_failure_on_rank1() -> None:
    """Rank 1 prints 40 lines of 60,000 characters, then raises with a 200,000-character message."""
    import os

    if os.environ["RANK"] == "1":
        for i in range(40):
            print(f"line {i} " + "y" * 60_000, flush=True)
        raise RuntimeError("boom " + "z" * 200_000)


def test_a_failure_report_of_any_size_reaches_the_driver(
    spark_session: Any, no_leftovers: None, channels: list[Any]
) -> None:
    """A failed rank's report (its last lines, message and traceback) is bounded before it
    travels, so it always fits the channel: the driver receives it over the channel (it once
    overflowed a frame and was dropped with everything queued beside it), and the lines the
    rank printed before it all arrive."""
    distributor = Distributor(num_processes=2, local_mode=False, spark=spark_session, log_ranks=[])
    with pytest.raises(DistributedRunError) as info:
        distributor.run(chatty_failure_on_rank1)
    root = info.value.failures[0]
    assert (
        root.rank == 1
        and (root.exc_message or "").startswith("boom zzz")
        and "characters cut" in (root.exc_message or "")
    )
    assert sum(len(line) for line in root.last_lines) < 20_000 and "earlier line(s) cut" in root.last_lines[0]
    ends = channels[0].node_outcomes()
    assert 1 in ends and ends[1].failures, "node 1's failed rank never arrived over the channel"
    got = ends[1].failures[0]
    assert got.rank == 1 and len(got.exc_message or "") < 10_000


def big(megabytes: int) -> bytes:
    return os.urandom(1024) * (megabytes * 1024)


def big_with_digest(megabytes: int) -> tuple[str, bytes]:
    import hashlib

    data = big(megabytes)
    return hashlib.sha256(data).hexdigest(), data


@pytest.mark.parametrize("transfer", ["auto", "channel", "spark"])
def test_large_result_distributed(
    transfer: str, spark_session: Any, no_leftovers: None, monkeypatch: pytest.MonkeyPatch, channels: list[Any]
) -> None:
    """auto: node 0 shares the driver's host, so the result is handed over by file; channel: it
    streams over the run's authenticated channel (what a result from another host takes); spark:
    as 16 MiB Arrow rows through Spark's result channel (the fallback without a channel)."""
    import hashlib

    monkeypatch.setenv("SPARK_TORCH_RESULT_TRANSFER", transfer)
    digest, out = Distributor(num_processes=2, local_mode=False, spark=spark_session).run(big_with_digest, 110)
    assert len(out) == 110 * 1024 * 1024
    assert hashlib.sha256(out).hexdigest() == digest
    sink = channels[0].bulk_sink
    streamed = sink.received if sink is not None else 0
    assert streamed > 110 * 1024 * 1024 if transfer == "channel" else streamed == 0


def test_bad_result_transfer_setting(spark_session: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARK_TORCH_RESULT_TRANSFER", "carrier-pigeon")
    with pytest.raises(
        ConfigurationError, match=r"SPARK_TORCH_RESULT_TRANSFER='carrier-pigeon' is not valid; use 'auto'"
    ):
        Distributor(num_processes=1, local_mode=False, spark=spark_session).run(world_info, "x")


def unpicklable_on_driver() -> Any:
    from .test_run_local import OnlyOnRanks

    return OnlyOnRanks()


def hang() -> None:
    time.sleep(600)


def test_timeout_distributed(spark_session: Any, no_leftovers: None) -> None:
    from spark_torch import RunTimeoutError

    start = time.monotonic()
    with pytest.raises(RunTimeoutError, match=r"exceeded timeout=3s; the Spark job was cancelled"):
        Distributor(num_processes=2, local_mode=False, spark=spark_session, timeout=3).run(hang)
    assert time.monotonic() - start < 40


def rank1_returns_rank0_hangs() -> None:
    if os.environ["RANK"] == "0":
        time.sleep(600)


def test_a_distributed_timeout_names_only_the_ranks_still_running(spark_session: Any, no_leftovers: None) -> None:
    """Rank 1 returns at once, rank 0 runs past the timeout: each node says how its ranks ended,
    and the error names rank 0 alone as stopped while still running."""
    from spark_torch import RunTimeoutError

    with pytest.raises(
        RunTimeoutError,
        match=r"exceeded timeout=10s; the Spark job was cancelled; rank 0 was still running and stopped",
    ) as info:
        Distributor(num_processes=2, local_mode=False, spark=spark_session, timeout=10).run(rank1_returns_rank0_hangs)
    assert [s.rank for s in info.value.stopped] == [0] and "Stopped while still running: rank 0\n" in str(
        info.value
    ) + "\n"


@pytest.mark.slow
def test_user_module_not_importable_on_executors(cluster_spark: Any, tmp_path: Path, no_leftovers: None) -> None:
    """A function from a module only the driver can import (a notebook's folder) is shipped by value."""
    import importlib
    import sys

    (tmp_path / "my_training_lib.py").write_text(
        "import os\n"
        "import torch\n"  # a module-level import the user does not have to move inside the function
        "SCALE = 3\n"
        "def helper(x):\n    return x * SCALE\n"
        "def train(x):\n"
        "    import torch.distributed as dist\n"
        "    dist.init_process_group('gloo', init_method='env://')\n"
        "    t = torch.tensor([float(helper(x))])\n"
        "    dist.all_reduce(t)\n"
        "    return t.item()\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        module = importlib.import_module("my_training_lib")
        out = Distributor(num_processes=2, local_mode=False, spark=cluster_spark).run(module.train, 2)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("my_training_lib", None)
    assert out == 12.0


def test_plain_local_master_has_one_slot_at_once(plain_local_spark: Any) -> None:
    """``local`` (no brackets) is one slot: no executor wait, the error comes at once."""
    start = time.monotonic()
    with pytest.raises(InsufficientSlotsError, match=r"needs 2 Spark task slots at once .*\(local\) has 1"):
        Distributor(num_processes=2, local_mode=False, spark=plain_local_spark).run(world_info, "x")
    assert time.monotonic() - start < 10


def _scratch_dir() -> str:
    return os.path.dirname(os.environ["TORCHELASTIC_ERROR_FILE"])


def test_node_scratch_goes_to_spark_local_dirs(spark_session: Any, no_leftovers: None) -> None:
    """Node files (payload, data shard, results) live in the executor's Spark local dir, which
    Spark cleans up with the executor, not in /tmp."""
    scratch = Distributor(num_processes=1, local_mode=False, spark=spark_session).run(_scratch_dir)
    parent = os.path.basename(os.path.dirname(scratch))
    assert parent.startswith("blockmgr-") and os.path.basename(scratch).startswith("spark-torch-"), scratch


def rank1_fails_first_but_its_node_is_slow() -> None:
    """Rank 1 raises first; a child it leaves behind keeps its output open, so its node runner
    waits (up to 2 s) for the last lines and raises its task failure after node 0's, whose rank
    0 then fails in all_reduce. Spark sees node 0's failure first."""
    import subprocess
    import sys

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    if dist.get_rank() == 1:
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(4)"])
        raise ValueError("the real cause")
    dist.all_reduce(torch.ones(1))


def test_root_cause_leads_whichever_task_spark_saw_fail_first(spark_session: Any, no_leftovers: None) -> None:
    with pytest.raises(DistributedRunError) as info:
        Distributor(num_processes=2, local_mode=False, spark=spark_session, timeout=120).run(
            rank1_fails_first_but_its_node_is_slow
        )
    assert str(info.value).startswith("rank 1 on 127.0.0.1 failed: ValueError: the real cause"), str(info.value)[:500]
    assert isinstance(info.value.__cause__, ValueError) and [f.rank for f in info.value.failures][:1] == [1]


def test_executors_missing_a_dependency(no_psutil_spark: Any, no_leftovers: None) -> None:
    """The executors' Python lacks a dependency: one LaunchError naming the interpreter, the module
    and the fix, from the check before the barrier stage (not Py4J's 'An error occurred while
    calling ...getResult'); tests/test_preflight.py has the end-to-end cases."""
    from spark_torch import LaunchError

    started = time.monotonic()
    with pytest.raises(
        LaunchError,
        match=r"the executors' Python cannot run spark_torch: .*/python \(Python [\d.]+, on .*\) cannot import psutil \(PYSPARK_PYTHON was .*Point PYSPARK_PYTHON",
    ) as info:
        Distributor(num_processes=2, local_mode=False).run(world_info, "x")
    assert "getResult" not in str(info.value) and "\n" not in str(info.value)
    assert time.monotonic() - started < 60
