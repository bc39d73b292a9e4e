"""run_on_dataframe(reuse_staged=True): a second run on an unchanged DataFrame trains on the rows
the first one kept, without reading the DataFrame; a changed one is staged again; kept rows that
are not on every node are staged again; nothing is left once the session stops. Each run's ranks
take a DDP step per batch and gather every id they trained on: each row exactly once."""

from __future__ import annotations

import glob
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

import pytest

from spark_torch import ConfigurationError, Distributor
from spark_torch.shared.staged_shards import CACHE_DIR, Staging

ROWS = 1000  # even shares: 2 nodes x 2 ranks or 1 node x 2 ranks, no row repeated to even them


def ids_trained() -> list[int]:
    """Every id the ranks trained on (a DDP step per batch), gathered from every rank, sorted."""
    import torch
    import torch.distributed as dist

    from spark_torch.data import rank_loader

    dist.init_process_group("gloo", init_method="env://")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    mine: list[int] = []
    for ids, x in rank_loader(batch_size=50, dtype={"x": torch.float32}):
        mine += ids.tolist()
        loss = model(x.unsqueeze(1)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return sorted(i for part in every for i in part)


def _session(master: str) -> Any:
    from .conftest import make_session, wait_for_slots

    spark = make_session(master)
    wait_for_slots(spark, 2)
    return spark


def _parquet(spark: Any, path: Path, rows: int = ROWS, offset: int = 0) -> Any:
    spark.range(offset, offset + rows, 1, 4).selectExpr("id", "cast(id as double) as x").write.mode(
        "overwrite"
    ).parquet(str(path))
    return spark.read.parquet(str(path))


def _kept_folders() -> set[str]:
    """Every folder of kept shards under this test session's temp dir (driver and executors)."""
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "**", CACHE_DIR), recursive=True))


def _shards(folders: set[str]) -> list[str]:
    return sorted(os.path.join(f, name) for f in folders for name in os.listdir(f))


def _run(d: Distributor, df: Any, **kwargs: Any) -> tuple[list[int], Staging | None]:
    ids = d.run_on_dataframe(ids_trained, df, columns=["id", "x"], reuse_staged=kwargs.pop("reuse", True), **kwargs)
    assert d.last_run is not None
    return ids, d.last_run.staging


def _local_mode_part(spark: Any, base: Path, before: set[str]) -> None:
    """Local mode (1 node x 2 ranks): an unchanged DataFrame is reused, a changed one is staged."""
    df = _parquet(spark, base / "t")
    d = Distributor(num_processes=2, local_mode=True)
    assert _run(d, df) == (list(range(ROWS)), Staging.STAGED)
    kept = _kept_folders() - before
    assert (
        len(kept) == 1
        and _shards(kept)
        and all(stat.S_IMODE(os.stat(p).st_mode) == 0o700 for p in [*kept, *_shards(kept)])
    )
    # read again: the same plan, the same files
    assert _run(d, spark.read.parquet(str(base / "t"))) == (list(range(ROWS)), Staging.REUSED)
    assert _run(d, df.filter("id < 600")) == (list(range(600)), Staging.STAGED)
    assert _run(d, df.selectExpr("id", "x * 2 as x"))[1] is Staging.STAGED
    assert _run(d, df, reuse=False) == (list(range(ROWS)), None)
    shutil.rmtree(base / "t")  # the DataFrame cannot be read any more: a reuse does not read it
    assert _run(d, df) == (list(range(ROWS)), Staging.REUSED)
    assert len(_shards(kept)) == 3  # the unchanged, the filtered and the doubled DataFrame's


def _distributed_part(spark: Any, base: Path) -> None:
    """2 nodes x 2 ranks: the second run reads nothing (the files are moved away); a kept shard
    removed behind the run's back makes the next run stage again from the DataFrame (and the
    older generation's other shard is swept)."""
    before = _kept_folders()  # with the local-mode part's (the driver's, not the executors')
    df = _parquet(spark, base / "t")
    d = Distributor(num_processes=4, ranks_per_task=2, local_mode=False, spark=spark)
    assert _run(d, df) == (list(range(ROWS)), Staging.STAGED)
    kept = _kept_folders() - before
    first = _shards(kept)
    assert len(kept) == 1 and len(first) == 2, first
    os.rename(base / "t", base / "away")
    assert _run(d, df) == (list(range(ROWS)), Staging.REUSED)
    os.rename(base / "away", base / "t")
    shutil.rmtree(first[1])  # as if its executor was lost
    assert _run(d, df) == (list(range(ROWS)), Staging.RESTAGED)
    second = _shards(kept)
    assert len(second) == 2 and not set(first) & set(second), (first, second)  # the old generation swept
    assert _run(d, df) == (list(range(ROWS)), Staging.REUSED)
    assert _run(d, df, reuse=False) == (list(range(ROWS)), None)


def test_local_mode_then_distributed_reuse_and_stage_again_and_the_session_stop_removes_all(
    tmp_path: Path, no_leftovers: None
) -> None:
    """One local[2] session serves both parts (one session to start, not two); once it stops,
    no folder of kept shards is left."""
    spark = _session("local[2]")
    before = _kept_folders()
    try:
        _local_mode_part(spark, tmp_path / "local", before)
        _distributed_part(spark, tmp_path / "distributed")
    finally:
        spark.stop()
    assert not _kept_folders() - before  # Spark removed the driver's folder with the session


def test_local_mode_does_not_see_a_file_rewritten_in_place(
    spark_session: Any, tmp_path: Path, no_leftovers: None
) -> None:
    """What docs/dataframe.md says "unchanged" means: the same plan and the same file names. A
    file rewritten under its own name is not noticed (the kept rows are trained on); Spark's
    writer names new files, so data written by it again is staged again. (The suite's shared
    local[2] session: its kept folder goes when that session stops.)"""
    spark = spark_session
    df = _parquet(spark, tmp_path / "t")
    d = Distributor(num_processes=2, local_mode=True)
    assert _run(d, df)[1] is Staging.STAGED
    other = tmp_path / "other"
    _parquet(spark, other, offset=ROWS)
    for old, new in zip(
        sorted(glob.glob(str(tmp_path / "t" / "*.parquet"))), sorted(glob.glob(str(other / "*.parquet")))
    ):
        shutil.copyfile(new, old)  # other rows under the same names
    for checksum in glob.glob(str(tmp_path / "t" / ".*.crc")):
        os.remove(checksum)  # Hadoop's local checksums would refuse the new contents
    rewritten = spark.read.parquet(str(tmp_path / "t"))
    assert rewritten.agg({"id": "min"}).first()[0] == ROWS  # the files hold the new rows
    assert _run(d, rewritten) == (list(range(ROWS)), Staging.REUSED)  # not noticed: the old rows
    again = _parquet(spark, tmp_path / "t", offset=ROWS)
    assert _run(d, again) == (list(range(ROWS, 2 * ROWS)), Staging.STAGED)


@pytest.mark.slow
def test_local_cluster_reuses_on_its_executors_and_stages_again_after_one_is_lost(
    tmp_path: Path, no_leftovers: None
) -> None:
    """local-cluster[2,1,1024]: each node takes the kept shard of the executor it landed on; an
    executor SIGKILLed between runs takes its shard with it, so the next run stages again (on the
    executor Spark starts in its place); every executor's folder is gone once the session stops."""
    from .conftest import session_executors, wait_for_slots

    spark = _session("local-cluster[2,1,1024]")
    before = _kept_folders()
    try:
        df = _parquet(spark, tmp_path / "t")
        d = Distributor(num_processes=2, local_mode=False, spark=spark, warm_start=False)
        assert _run(d, df) == (list(range(ROWS)), Staging.STAGED)
        assert len(_kept_folders() - before) == 2  # one per executor
        assert _run(d, df) == (list(range(ROWS)), Staging.REUSED)
        executors = session_executors()
        assert len(executors) == 2
        killed = executors[0].environ()["SPARK_EXECUTOR_DIRS"].split(os.pathsep)
        executors[0].kill()
        executors[0].wait(60)
        wait_for_slots(spark, 2)
        assert _run(d, df) == (list(range(ROWS)), Staging.RESTAGED)
        assert _run(d, df) == (list(range(ROWS)), Staging.REUSED)
    finally:
        spark.stop()
    left = _kept_folders() - before
    # a SIGKILLed executor cannot remove its own directories: only its folder is left (for the
    # cluster manager; local-cluster's workers stop with the driver), which this test removes
    assert all(any(folder.startswith(os.path.join(d, "")) for d in killed) for folder in left), (left, killed)
    for folder in left:
        shutil.rmtree(folder)


def test_bad_reuse_staged_is_refused_before_anything_starts(spark_session: Any) -> None:
    df = spark_session.range(10)
    with pytest.raises(ConfigurationError, match=r"reuse_staged must be True or False, got 'yes'"):
        Distributor(num_processes=2, local_mode=True).run_on_dataframe(ids_trained, df, reuse_staged="yes")  # type: ignore[arg-type]
    with pytest.raises(
        ConfigurationError, match=r"run_on_dataframe with replica_groups does not take reuse_staged=True yet"
    ):
        Distributor(num_processes=2, local_mode=True, replica_groups=2).run_on_dataframe(
            ids_trained, df, reuse_staged=True
        )
