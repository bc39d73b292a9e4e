"""A slow but healthy replica group is never dropped from a quorum at spark_torch's lighthouse
defaults (a 0.2 s heartbeat timeout, so that a dead group is dropped within a step's time:
benchmarks/bench_ft_pause.py measures that), even when its process gets no CPU at all for
several timeouts (stopped with SIGSTOP: a process starved on a loaded machine, whose own
heartbeats come late, taken to the extreme without burning CPU): real torchft ranks on gloo, the
lighthouse on the driver, loopback. The lighthouse's pump vouches for every group whose ranks
live (spark_torch.ft.pump), so the groups' own heartbeats do not decide: the slow group is kept
with its Manager's heartbeats off too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from spark_torch import Distributor
from tests import ft_liveness_programs

pytest.importorskip("torchft")

#: joint steps; the slow group's process is stopped PAUSE seconds after each, four heartbeat timeouts
STEPS, PAUSE = 8, 0.8


def _quorums(path: Path) -> list[tuple[int, int, int, int]]:
    """``(PID, STEP, PARTICIPANTS, HEALED)`` of each commit a group logged, in order."""
    return [tuple(int(v) for v in line.split()) for line in path.read_text().splitlines()]  # type: ignore[misc]


def _never_dropped(work: Path) -> None:
    """From the first step both groups took together on, every commit of each group was taken by
    both (no quorum without the slow group, none without the fast one), no group healed again (a
    group dropped from a quorum falls behind and heals from its peer when it is back), each
    group's steps went up by one, in one process; both end with the same weights."""
    for group in (0, 1):
        rows = _quorums(work / f"g{group}.quorums")
        joint = next((i for i, row in enumerate(rows) if row[2] == 2), None)
        assert joint is not None, f"group {group} never committed a step with its peer: {rows[:3]} ... {rows[-3:]}"
        after = rows[joint:]
        assert len({pid for pid, *_ in rows}) == 1, rows[:3]
        alone = [row for row in after if row[2] != 2]
        healed = [row for row in after[1:] if row[3]]
        assert not alone and not healed, f"group {group} committed without its peer at {alone}, healed at {healed}"
        steps = [step for _, step, *_ in after]
        assert steps == list(range(steps[0], steps[0] + len(steps))), steps
        assert len(after) >= STEPS, len(after)
    assert ast.literal_eval((work / "g0.weights").read_text()) == ast.literal_eval((work / "g1.weights").read_text())


@pytest.mark.parametrize("heartbeat_interval", [None, 3600.0], ids=["manager-heartbeats", "manager-heartbeats-off"])
def test_a_slow_group_starved_of_cpu_is_never_dropped(
    tmp_path: Path, no_leftovers: None, heartbeat_interval: float | None
) -> None:
    """Group 1's process is stopped for 0.8 s after each commit (four times the 0.2 s heartbeat
    timeout, its Manager's heartbeat thread stopped with it: only the lighthouse's pump keeps it
    in); with its Manager heartbeating every 100 ms (torchft's default) while it runs and with its
    Manager's heartbeats off (an hour apart: the pump learns of it from its quorum requests)."""
    distributor = Distributor(num_processes=2, replica_groups=2, max_restarts=0, timeout=300, log_ranks=[])
    weights = distributor.run(ft_liveness_programs.slow_group, STEPS, str(tmp_path), 1, PAUSE, heartbeat_interval)
    _never_dropped(tmp_path)
    assert ast.literal_eval((tmp_path / "g0.weights").read_text()) == weights
