"""How the suite's workers get their tests (tests/scheduling.py): the scopes and the waiting lane."""

from __future__ import annotations

from pathlib import Path

from tests import scheduling

TESTS = Path(__file__).resolve().parents[1]


def test_scopes() -> None:
    assert scheduling.scope_of("tests/test_standalone.py::test_a[x]") == "one-worker"
    assert scheduling.scope_of("tests/test_integrations.py::test_b") == "test_integrations.py"
    assert scheduling.scope_of("tests/test_cli.py::test_c[y]") == "tests/test_cli.py::test_c[y]"


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
