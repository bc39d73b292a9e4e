"""A replica group's loader without Spark or torchft: its rows are its own block of the node's rows,
each ``next()`` hands out the committed step's batch (a dropped step repeats it, a heal jumps to the
peers' step), two batches without a quorum between them are refused, workers are refused; and the
ledger that counts the steps each group did not train (``spark_torch.ft.data_position``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from spark_torch.ft import data_position
from spark_torch.ft.data_position import Ledger, group_of
from spark_torch.node.staging import check_shards, write_node_data
from spark_torch.rank import positions
from spark_torch.rank.data import rank_dataset, rank_loader
from spark_torch.reporting import loader_positions

ROWS, BATCH = 80, 4  # two groups of one rank: 40 rows each, 10 batches an epoch


class _Manager:
    """What a ledger reads of torchft's Manager: its committed step."""

    def __init__(self) -> None:
        self.step = 0

    def current_step(self) -> int:
        return self.step


@pytest.fixture
def group1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Ledger, _Manager]]:
    """Rank 0 of group 1 of 2 (one rank each) on 80 staged rows, with a ledger as its Manager's."""
    table = pa.table({"id": pa.array(range(ROWS), pa.int64())})
    path, _ = write_node_data(table.to_batches(max_chunksize=7), str(tmp_path))
    env = {"SPARK_TORCH_DATA_FILE": path, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    env.update({"REPLICA_GROUP_ID": "1", "NUM_REPLICA_GROUPS": "2"})
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in ("SPARK_TORCH_CHECKPOINT", "SPARK_TORCH_DATA_ROWS"):
        monkeypatch.delenv(name, raising=False)
    positions.forget()
    manager = _Manager()
    ledger = Ledger(1, 2, manager)
    monkeypatch.setattr(data_position, "_current", ledger)
    yield ledger, manager
    positions.forget()
    loader_positions.track(None)


def _step(ledger: Ledger, manager: _Manager, batches: Iterator[Any], commit: bool = True) -> list[int]:
    """One torchft step: a batch, a quorum, a commit (or a dropped step)."""
    batch = next(batches)
    ledger.started()
    ledger.saw_quorum([0, 1])
    if commit:
        manager.step += 1
    return [int(i) for i in batch[0].tolist()]


def test_a_group_trains_its_own_block_by_the_committed_step(group1: tuple[Ledger, _Manager]) -> None:
    ledger, manager = group1
    loader = rank_loader(batch_size=BATCH, columns=["id"])
    assert len(loader) == 10 and loader.epoch == 0
    batches = iter(loader)
    assert _step(ledger, manager, batches) == [40, 41, 42, 43]  # group 1's rows: 40..79
    assert _step(ledger, manager, batches, commit=False) == [44, 45, 46, 47]
    assert _step(ledger, manager, batches) == [44, 45, 46, 47]  # the dropped step's batch again
    manager.step = 8  # a heal: the peers' step
    assert _step(ledger, manager, batches) == [72, 73, 74, 75]
    assert _step(ledger, manager, batches) == [76, 77, 78, 79]
    assert list(batches) == [] and loader.epoch == 1  # the step reached epoch 1: the iteration ends
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["batch"] == 0
    manager.step = 23  # a heal past a whole epoch: the next iteration is the step's epoch
    assert [int(i) for i in next(iter(loader))[0].tolist()] == [52, 53, 54, 55]


def test_a_second_batch_without_a_quorum_is_refused_and_by_step_false_counts(group1: tuple[Ledger, _Manager]) -> None:
    ledger, manager = group1
    batches = iter(rank_loader(batch_size=BATCH, columns=["id"]))
    next(batches)
    with pytest.raises(RuntimeError) as info:
        next(batches)
    assert "a second batch at torchft step 0 with no quorum since the first" in str(info.value)
    assert "pass by_step=False to that loader" in str(info.value)
    evaluation = rank_loader(batch_size=BATCH, columns=["id"], by_step=False)
    assert [int(b[0][0]) for b in evaluation] == list(range(40, 80, BATCH))  # its own rows, counted
    dataset = rank_dataset(batch_size=BATCH, columns=["id"])  # iterated in the rank: by the step too
    manager.step = 3
    assert [int(i) for i in next(iter(dataset))[0].tolist()] == [52, 53, 54, 55]


def test_workers_are_refused_and_by_step_needs_a_manager(
    group1: tuple[Ledger, _Manager], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError) as info:
        rank_loader(batch_size=BATCH, num_workers=2)
    assert "rank_loader(num_workers=2) in a replica group" in str(info.value) and "num_workers=0" in str(info.value)
    rank_loader(batch_size=BATCH, num_workers=2, by_step=False)  # counted as in any run: allowed
    monkeypatch.setattr(data_position, "_current", None)
    with pytest.raises(RuntimeError, match=r"make the Manager \(spark_torch.ft.manager\(...\)\) before iterating"):
        iter(rank_loader(batch_size=BATCH, by_step=True))


def test_the_ledger_counts_the_steps_each_group_did_not_train() -> None:
    assert [group_of(r) for r in ("spark_torch_group_0:ab-12", "train_ddp_12:x", "nodigits")] == [0, 12, 0]
    group0, group1 = Ledger(0, 2), Ledger(1, 2)
    # step 0, both at step 0: torchft's init_sync heals every rank but its source's (rank 0: group 0)
    for ledger, mine in ((group0, True), (group1, False)):
        ledger.saw_quorum([0, 1])
        ledger.committed(0, 2, 0, True, mine)
    assert group0.skipped == group1.skipped == [0, 1]
    for step in (1, 2):  # group 1 is down: group 0 commits alone
        group0.saw_quorum([0])
        group0.committed(step, 1, 0, True, True)
    assert group0.skipped == [0, 3]
    # group 1 restarted: it heals at step 3 from group 0 (its ledger through step 2), is not taking part
    group0.saw_quorum([0, 1])
    group1 = Ledger(1, 2)
    group1.saw_quorum([0, 1])
    group1.load_state_dict(group0.state_dict())
    group0.committed(3, 1, 0, True, True)  # one of the two took part: the newcomer healed
    group1.committed(3, 1, 0, True, False)
    assert group0.skipped == group1.skipped == [0, 4] and group1.mine() == 4
    for ledger in (group0, group1):  # both take part
        ledger.saw_quorum([0, 1])
        ledger.committed(4, 2, 0, True, True)
        ledger.committed(4, 2, 0, True, True)  # accounted once
    assert group0.skipped == group1.skipped == [0, 4]
    assert group1.state_dict() == {"skipped": [0, 4], "members": [0, 1], "next": 5}
    # rank 1's ledgers: at step 0 its source is the quorum's second group
    rank1 = Ledger(0, 2)
    rank1.saw_quorum([0, 1])
    assert rank1.took_part(0, 2, 1, True) == {1} and rank1.took_part(0, 2, 1, False) == {0, 1}


def test_the_heal_is_announced_once_by_rank_0(capsys: pytest.CaptureFixture[str]) -> None:
    peer, ledger = Ledger(0, 2), Ledger(1, 2)
    peer.skipped = [0, 5]
    ledger.saw_quorum([0, 1])
    ledger.load_state_dict(peer.state_dict())
    ledger.committed(5, 1, 0, True, False)  # the heal step: not trained
    ledger.saw_quorum([0, 1])
    ledger.committed(6, 2, 0, True, True)
    ledger.saw_quorum([0, 1])
    ledger.committed(7, 2, 0, True, True)
    err = capsys.readouterr().err
    assert err.count("replica group 1 takes part again at step 6") == 1, err
    assert "batches of 6 committed step(s) in all (report() rows: skipped_batches)" in err


def test_a_node_needs_a_row_for_every_rank_of_every_group() -> None:
    assert check_shards([4], 2, 2) is None
    message = check_shards([3], 2, 2)
    assert message is not None and "3 row(s) for 2 replica groups of 2 rank(s)" in message
    assert check_shards([3], 2) is None


def test_report_refuses_skipped_batches_as_a_metric_name() -> None:
    from spark_torch import report

    with pytest.raises(ValueError, match=r"'skipped_batches' is recorded by spark_torch; name your metric differently"):
        report({"skipped_batches": 1})


class _TorchftManager:
    """What attach() wraps of torchft's Manager, for two groups: group 0 commits alone, then both."""

    def __init__(self) -> None:
        self.step, self.groups, self.registered = 0, ["spark_torch_group_0:u"], {}
        self._client = self
        self._group_rank, self._init_sync, self._use_async_quorum = 0, True, True

    def _quorum(self, **_: Any) -> Any:
        return type("Quorum", (), {"replica_ids": list(self.groups)})()

    def start_quorum(self) -> None:
        self._client._quorum(step=self.step)

    def should_commit(self) -> bool:
        self.step += 1
        return True

    def current_step(self) -> int:
        return self.step

    def num_participants(self) -> int:
        return len(self.groups)

    def is_participating(self) -> bool:
        return True

    def register_state_dict_fn(self, key: str, load: Any, save: Any) -> None:
        self.registered[key] = (load, save)


def test_attach_counts_through_the_managers_own_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    from spark_torch.data import skipped_batches
    from spark_torch.reporting import api

    env = {"REPLICA_GROUP_ID": "0", "NUM_REPLICA_GROUPS": "2"}
    assert data_position.attach(_TorchftManager(), env) is None  # not a DataFrame run: nothing
    monkeypatch.setattr(data_position, "_current", None)
    monkeypatch.setattr(api, "_skipped_source", None)
    manager = _TorchftManager()
    ledger = data_position.attach(manager, {**env, "SPARK_TORCH_DATA_FILE": "/x"})
    assert ledger is not None and data_position.STATE_KEY in manager.registered
    for groups in (["spark_torch_group_0:u"], ["spark_torch_group_0:u", "spark_torch_group_1:v"]):
        manager.groups = groups
        manager.start_quorum()
        assert manager.should_commit()
    assert ledger.quorums == 2 and ledger.skipped == [0, 1] and skipped_batches() == 0
    assert api._skipped() == {"skipped_batches": 0}
    assert manager.registered[data_position.STATE_KEY][1]() == {"skipped": [0, 1], "members": [0, 1], "next": 2}
