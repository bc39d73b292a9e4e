"""How the suite's workers get their tests (tests/scheduling.py): the scopes and the waiting lane."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests import scheduling

TESTS = Path(__file__).resolve().parents[1]


def test_scopes() -> None:
    assert scheduling.scope_of("tests/test_standalone.py::test_a[x]") == "one-worker"
    assert scheduling.scope_of("tests/test_integrations.py::test_b") == "test_integrations.py"
    assert scheduling.scope_of("tests/test_cli.py::test_c[y]") == "tests/test_cli.py::test_c[y]"


def test_each_session_kind_but_the_default_goes_to_one_worker() -> None:
    """A local-cluster's tests from several files are one unit (its session starts once in the
    run); the default local[2] session's tests, those without a session, and a waiting file's are
    dealt one at a time; the heaviest sessions' files keep their one worker."""
    cluster = [
        scheduling.scope_of("tests/test_run_distributed.py::test_function_cluster", "cluster_spark"),
        scheduling.scope_of("tests/reliability/test_faults.py::test_executor_loss", "cluster_spark"),
    ]
    assert cluster == ["session:cluster_spark"] * 2
    assert scheduling.scope_of("tests/test_gpu.py::test_a", "gpu_local_spark") == "session:gpu_local_spark"
    assert scheduling.scope_of("tests/test_run_distributed.py::test_b", "spark_session") == (
        "tests/test_run_distributed.py::test_b"
    )
    assert scheduling.scope_of("tests/test_cli.py::test_c", None) == "tests/test_cli.py::test_c"
    assert scheduling.scope_of("tests/test_stall.py::test_d", "cluster_spark") == "tests/test_stall.py::test_d"
    assert scheduling.scope_of("tests/test_standalone.py::test_e", "standalone_spark") == "one-worker"


def test_the_kinds_the_workers_record_reach_the_scheduler_once(tmp_path: Path, monkeypatch: Any) -> None:
    """Each test process has a private TMPDIR: a worker writes where the controller named (its own
    TMPDIR), and the controller reads and removes it."""
    monkeypatch.setattr(scheduling.tempfile, "tempdir", str(tmp_path))
    kinds = {"tests/test_gpu.py::test_a": "gpu_local_spark", "tests/test_cli.py::test_c": None}
    path = scheduling.kinds_path("run1")
    assert path.parent == tmp_path
    scheduling.record_kinds(path, kinds)
    scheduling.record_kinds(path, kinds)  # every worker writes the same
    assert scheduling.read_kinds("run1") == kinds
    assert list(tmp_path.iterdir()) == []  # read once, then removed (no partial file left either)
    assert scheduling.read_kinds("run1") == {}  # none recorded: every test is dealt alone
    scheduling.record_kinds(path, kinds)  # a worker started after a crash writes it again
    scheduling.forget_kinds()  # the controller's end
    assert list(tmp_path.iterdir()) == []


def test_the_waiting_lane_takes_the_waiting_files_and_the_heaviest_sessions_only() -> None:
    assert scheduling.in_waiting_lane(scheduling.scope_of("tests/test_stall.py::test_a[local-warm]"))
    assert scheduling.in_waiting_lane(scheduling.scope_of("tests/reliability/test_channel_faults.py::test_b"))
    assert scheduling.in_waiting_lane(scheduling.scope_of("tests/test_connect.py::test_c"))
    assert not scheduling.in_waiting_lane(scheduling.scope_of("tests/test_cli.py::test_d"))
    assert not scheduling.in_waiting_lane(scheduling.scope_of("tests/test_integrations.py::test_e"))


def test_every_file_the_scheduler_names_exists() -> None:
    """A renamed test file would silently leave its lane (and run beside the heavy ones)."""
    files = {p.name for p in TESTS.rglob("test_*.py")}
    named = scheduling.ONE_WORKER_FILES | scheduling.WHOLE_FILES | scheduling.WAITING_FILES
    assert named <= files, sorted(named - files)
