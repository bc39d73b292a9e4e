"""``run_on_dataframe(..., replica_groups=2)`` end to end (real torchft ranks on gloo, loopback):
groups of two ranks, each rank a block of the DataFrame's rows, torchft's DDP across the groups
and a plain all-reduce within each group; rank 1 of group 1 SIGKILLs itself mid-step (a step count
and a file decide when, never timing), its group restarts alone and heals at its peer's step.
Every rank logs each step it took (tests/df_group_programs.py): the batch of every committed step
it trained is that step's batch of its own rows, no committed batch is trained twice, no row twice
in an epoch, the groups' rows are disjoint and cover the DataFrame, and ``skipped_batches`` (the
run's rows, and each rank's ``spark_torch.data.skipped_batches()``) counts exactly the committed
steps whose batch a rank did not train."""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from spark_torch import ConfigurationError, Distributor, RunResult
from spark_torch.driver.result import AttemptEnd
from tests import df_group_programs

pytest.importorskip("torchft")

ROWS, GROUPS, RANKS, BATCH = 240, 2, 2, 10
#: batches per epoch of every rank: each rank a block of ROWS / (GROUPS * RANKS) rows
PER_EPOCH = ROWS // (GROUPS * RANKS) // BATCH
#: the kill: at the 13th step both groups take together, and the run ends after 26 such steps: each
#: life of group 1 then trains at least one whole epoch (11 steps in a row hold one, wherever they start)
KILL_STEP, TOGETHER = 13, 26


def _options() -> object:
    from spark_torch.ft.lighthouse import LighthouseOptions

    return LighthouseOptions(min_replicas=1, join_timeout_ms=500, quorum_tick_ms=20, heartbeat_timeout_ms=1_000)


def _distributor(**options: Any) -> Distributor:
    return Distributor(
        num_processes=GROUPS * RANKS,
        replica_groups=GROUPS,
        max_restarts=1,
        lighthouse_options=_options(),
        timeout=300,
        log_ranks=[],
        **options,
    )


def _steps(work: Path, group: int, rank: int) -> list[tuple[int, int, bool, bool, list[int]]]:
    """``(pid, step, took part, committed, ids)`` of each step the rank logged, in order."""
    lines = (line.split() for line in (work / f"g{group}r{rank}.rows").read_text().splitlines())
    return [(int(p), int(s), t == "1", c == "1", [int(i) for i in ids]) for p, s, t, c, *ids in lines]


def _check_rows(work: Path, last: RunResult | None, in_order: bool) -> dict[tuple[int, int], int]:
    """The checks of the module's docstring; returns each rank's skipped batches."""
    assert last is not None and last.error is None
    shares: dict[tuple[int, int], set[int]] = {}
    skipped: dict[tuple[int, int], int] = {}
    for group in range(GROUPS):
        for rank in range(RANKS):
            logged = _steps(work, group, rank)
            final, counted = (int(v) for v in (work / f"g{group}r{rank}.final").read_text().split())
            trained = [(step, ids) for _, step, took_part, committed, ids in logged if took_part and committed]
            steps = [step for step, _ in trained]
            assert len(steps) == len(set(steps)), f"group {group} rank {rank} trained a committed batch twice"
            by_epoch: dict[int, list[int]] = defaultdict(list)
            for step, ids in trained:
                assert len(ids) == BATCH, (group, rank, step, ids)
                by_epoch[step // PER_EPOCH].extend(ids)
                if in_order:  # the committed step's batch of this rank's own block, exactly
                    first = ((group * RANKS + rank) * PER_EPOCH + step % PER_EPOCH) * BATCH
                    assert ids == list(range(first, first + BATCH)), (group, rank, step, ids)
            for epoch, ids in by_epoch.items():
                assert len(ids) == len(set(ids)), f"group {group} rank {rank} trained a row twice in epoch {epoch}"
            # every step below the final one: trained once, or counted as skipped
            assert counted == final - len([s for s in steps if s < final]), (group, rank, final, counted, steps[:5])
            skipped[(group, rank)] = counted
            share = {i for _, ids in trained for i in ids}
            assert len(share) == ROWS // (GROUPS * RANKS), (group, rank, len(share))  # its whole block, once an epoch
            full = [e for e in by_epoch if len(by_epoch[e]) == PER_EPOCH * BATCH]
            assert full and all(set(by_epoch[e]) == share for e in full), (group, rank, sorted(by_epoch))
            shares[(group, rank)] = share
    every = [i for share in shares.values() for i in share]
    assert sorted(every) == list(range(ROWS)), "the ranks' rows overlap or leave rows out"
    # the run's rows: each group's skipped_batches, as its rank 0 counted them
    for group in range(GROUPS):
        rows = [row for row in last.history if row["replica_group"] == group]
        assert rows and all("skipped_batches" in row for row in rows), rows[:2]
        assert rows[-1]["skipped_batches"] == skipped[(group, 0)], (group, rows[-1], skipped)
        assert [r["skipped_batches"] for r in rows] == sorted(r["skipped_batches"] for r in rows)
    return skipped


def _check_kill(work: Path, last: RunResult | None, skipped: dict[tuple[int, int], int]) -> None:
    """Group 1 was restarted alone, its second processes healed past their first's last step, and
    the steps its peer committed meanwhile are its skipped batches (group 0 never lost one)."""
    assert last is not None
    assert [(a.replica_group, a.end) for a in last.attempts] == [
        (0, AttemptEnd.SUCCEEDED),
        (1, AttemptEnd.FAILED),
        (1, AttemptEnd.SUCCEEDED),
    ]

    def survivor_steps(rank: int) -> list[int]:
        return [s for _, s, t, c, _ in _steps(work, 0, rank) if t and c]

    for rank in range(RANKS):
        survivor = _steps(work, 0, rank)
        assert len({pid for pid, *_ in survivor}) == 1
        lives = list(dict.fromkeys(pid for pid, *_ in _steps(work, 1, rank)))
        assert len(lives) == 2, lives
        before = [s for p, s, t, c, _ in _steps(work, 1, rank) if p == lives[0] and t and c]
        after = [s for p, s, t, c, _ in _steps(work, 1, rank) if p == lives[1] and t and c]
        assert after[0] > before[-1] + 1, (before[-3:], after[:3])
        missed = after[0] - before[-1] - 1  # the steps between its last batch and its first after the heal
        # and the steps before its first (a late start; at torchft's first step, every rank but its
        # source's heals: init_sync): nothing else, each life trained every step it took part in
        assert before == list(range(before[0], before[-1] + 1)) and after == list(range(after[0], after[-1] + 1))
        assert missed > 0 and skipped[(1, rank)] == before[0] + missed, (rank, skipped, missed, before[:2])
        kept = survivor_steps(rank)
        assert kept == list(range(kept[0], kept[-1] + 1)) and skipped[(0, rank)] == kept[0], (skipped, kept[:2])


def test_replica_groups_train_their_own_rows_through_a_kill_in_local_mode(
    spark_session: Any, tmp_path: Path, no_leftovers: None
) -> None:
    df = spark_session.range(ROWS)
    distributor = _distributor()
    distributor.run_on_dataframe(df_group_programs.train_rows, df, TOGETHER, str(tmp_path), 1, KILL_STEP, 1, BATCH)
    skipped = _check_rows(tmp_path, distributor.last_run, in_order=True)
    _check_kill(tmp_path, distributor.last_run, skipped)


def test_replica_groups_train_their_own_rows_through_a_kill_in_distributed_mode(
    spark_session: Any, tmp_path: Path, no_leftovers: None
) -> None:
    """On ``local[2]``: each group a barrier job of one node with two ranks, shuffled rows."""
    df = spark_session.range(ROWS).repartition(3)
    distributor = _distributor(local_mode=False, spark=spark_session, ranks_per_task=RANKS)
    distributor.run_on_dataframe(
        df_group_programs.train_rows, df, TOGETHER, str(tmp_path), 1, KILL_STEP, 1, BATCH, True
    )
    skipped = _check_rows(tmp_path, distributor.last_run, in_order=False)
    _check_kill(tmp_path, distributor.last_run, skipped)


def test_more_group_ranks_than_rows_fail_before_any_rank_starts(spark_session: Any, no_leftovers: None) -> None:
    df = spark_session.range(3)  # 3 rows for 2 groups of 2 ranks
    started = time.monotonic()
    with pytest.raises(ConfigurationError) as info:
        _distributor().run_on_dataframe(df_group_programs.train_rows, df, 1, "/nonexistent")
    message = str(info.value)
    assert "3 row(s) for 2 replica groups" in message and "every rank of every group needs at least one row" in message
    assert "Use fewer replica groups or processes, or more data" in message
    assert time.monotonic() - started < 120


def test_reuse_staged_with_replica_groups_is_refused(spark_session: Any, no_leftovers: None) -> None:
    df = spark_session.range(8)
    with pytest.raises(ConfigurationError) as info:
        _distributor().run_on_dataframe(df_group_programs.train_rows, df, 1, "/nonexistent", reuse_staged=True)
    assert "does not take reuse_staged=True yet" in str(info.value) and "reuse_staged=False" in str(info.value)


def test_groups_that_do_not_divide_the_processes_are_refused(spark_session: Any, no_leftovers: None) -> None:
    df = spark_session.range(8)
    with pytest.raises(ValueError) as info:
        Distributor(num_processes=3, replica_groups=2).run_on_dataframe(df_group_programs.train_rows, df, 1, "/x")
    assert "replica_groups" in str(info.value)


def test_groups_of_two_nodes_split_the_same_rows_in_distributed_mode(
    local4_spark: Any, tmp_path: Path, no_leftovers: None
) -> None:
    """On ``local[4]``: each group a barrier job of two nodes (one rank each). Each group's job
    repartitions the DataFrame over its own two nodes: both get the same rows per node, so the four
    ranks' blocks are still disjoint and cover the rows (no kill)."""
    df = local4_spark.range(0, ROWS, 1, 2)  # two input partitions of 120 rows: 120 rows a node (even shares)
    distributor = _distributor(local_mode=False, spark=local4_spark, ranks_per_task=1)
    distributor.run_on_dataframe(df_group_programs.train_rows, df, TOGETHER, str(tmp_path), None, None, 0, BATCH, True)
    _check_rows(tmp_path, distributor.last_run, in_order=False)
    assert [(a.replica_group, a.end) for a in distributor.last_run.attempts] == [  # type: ignore[union-attr]
        (0, AttemptEnd.SUCCEEDED),
        (1, AttemptEnd.SUCCEEDED),
    ]
