"""Kept shards (``reuse_staged``) without Spark: the assignment every node computes, the folder's
locks (a shard in use is never swept, a dead writer's temporary folder is), and its modes."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from spark_torch.node.shard_reuse import assign_shards
from spark_torch.shared.column_files import ColumnWriter
from spark_torch.shared.owned_files import UnsafePathError
from spark_torch.shared.staged_shards import cache_dir, held_shards, publish, shard_name, start_shard, sweep

pytestmark = pytest.mark.unit

KEY = "ab" * 32


def test_assignment_takes_each_shard_once_preferring_a_nodes_own() -> None:
    assert assign_shards([[0, 1], [0, 1]], 2) == [0, 1]
    assert assign_shards([[1], [0]], 2) == [1, 0]
    # greedy in node order would give node 0 shard 0 and leave node 1 with nothing
    assert assign_shards([[1, 0], [0]], 2) == [1, 0]
    assert assign_shards([[0, 1, 2], [0], [1]], 3) == [2, 0, 1]


def test_assignment_is_none_when_the_offers_do_not_cover_every_node() -> None:
    assert assign_shards([[0, 1], []], 2) is None
    assert assign_shards([[0], [0]], 2) is None
    assert assign_shards([[0], [5]], 2) is None  # a shard of another layout is no shard here
    assert assign_shards([[0]], 2) is None


def _stage(cache: str, generation: str, shard: int, rows: int = 3) -> str:
    import pyarrow as pa

    temp, lock = start_shard(cache, KEY, generation, shard)
    writer = ColumnWriter(temp)
    writer.write(pa.RecordBatch.from_pydict({"id": list(range(rows))}))
    writer.close()
    final = publish(temp, lock, cache, KEY, generation, shard)
    os.close(lock)
    assert final is not None
    return final


def test_kept_shards_are_private_and_found_complete(tmp_path: Path) -> None:
    cache = cache_dir(str(tmp_path))
    final = _stage(cache, "0" * 12, 1, rows=5)
    assert os.path.basename(final) == shard_name(KEY, "0" * 12, 1)
    for path in (cache, final):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    held = held_shards(cache, KEY, "0" * 12)
    assert [(h.shard, h.rows, h.path) for h in held] == [(1, 5, final)]
    assert held_shards(cache, KEY, "1" * 12) == []  # another generation
    for h in held:
        h.release()


def test_a_nodes_data_folder_is_private_under_umask_0(tmp_path: Path) -> None:
    """The data folder of a node's scratch folder (and a kept shard): files 0600, itself 0700,
    whatever the umask (Spark executors often run with umask 0)."""
    import pyarrow as pa

    old = os.umask(0)
    try:
        writer = ColumnWriter(str(tmp_path / "data"))
        writer.write(pa.RecordBatch.from_pydict({"id": [1, 2], "name": ["a", "b"]}))
        writer.close()
    finally:
        os.umask(old)
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in (tmp_path / "data").iterdir()}
    assert len(modes) > 2 and set(modes.values()) == {"0o600"}, modes
    assert stat.S_IMODE((tmp_path / "data").stat().st_mode) == 0o700


def test_a_folder_of_another_mode_is_refused(tmp_path: Path) -> None:
    os.mkdir(tmp_path / "spark_torch_staged", 0o755)
    os.chmod(tmp_path / "spark_torch_staged", 0o755)
    with pytest.raises(UnsafePathError, match="is not a folder of this user that only it may use"):
        cache_dir(str(tmp_path))


def test_a_shard_in_use_is_not_swept_and_an_unused_one_is(tmp_path: Path) -> None:
    cache = cache_dir(str(tmp_path))
    old_in_use = _stage(cache, "0" * 12, 0)
    old_free = _stage(cache, "0" * 12, 1)
    new = _stage(cache, "1" * 12, 0)
    held = held_shards(cache, KEY, "0" * 12)
    for h in held[1:]:
        h.release()  # another node took it
    assert held[0].shard == 0  # a running attempt's
    removed = sweep(cache, KEY, keep="1" * 12)
    assert removed == [old_free]
    assert os.path.isdir(old_in_use) and os.path.isdir(new)
    held[0].release()
    assert sweep(cache, KEY, keep="1" * 12) == [old_in_use]
    assert os.listdir(cache) == [os.path.basename(new)]


def test_a_temporary_folder_is_swept_only_once_its_writer_is_gone(tmp_path: Path) -> None:
    cache = cache_dir(str(tmp_path))
    temp, lock = start_shard(cache, KEY, "0" * 12, 0)
    assert sweep(cache, KEY, keep="0" * 12) == []  # being written
    os.close(lock)
    assert sweep(cache, KEY, keep="0" * 12) == [temp]
    # a writer that died: its lock went with it
    code = (
        "import sys; from spark_torch.shared.staged_shards import start_shard; "
        f"print(start_shard({cache!r}, {KEY!r}, '0' * 12, 1)[0])"
    )
    dead = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert sweep(cache, KEY, keep="0" * 12) == [dead]


def test_a_taken_name_is_not_published_over(tmp_path: Path) -> None:
    cache = cache_dir(str(tmp_path))
    final = _stage(cache, "0" * 12, 0)
    temp, lock = start_shard(cache, KEY, "0" * 12, 0)
    os.makedirs(os.path.join(temp, "x"))
    assert publish(temp, lock, cache, KEY, "0" * 12, 0) is None
    assert os.path.isdir(temp) and os.path.isdir(final)
    os.close(lock)
