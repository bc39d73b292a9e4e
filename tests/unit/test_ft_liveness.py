"""The lighthouse's liveness rules as spark_torch sets them: a group silent for 0.2 s is out of
the next quorum (torchft's default: 5 s), looked for every 20 ms, while the lighthouse's pump
heartbeats every group whose ranks live (tests/unit/test_ft_pump.py); a user's own options are
kept. What that costs a surviving group is measured by benchmarks/bench_ft_pause.py; that a slow
healthy group is not dropped under load, by tests/test_replica_group_liveness.py."""

from __future__ import annotations

import pytest

from spark_torch.ft.lighthouse import HEARTBEAT_TIMEOUT_MS, QUORUM_TICK_MS, Lighthouse, LighthouseOptions


def test_the_defaults_drop_a_silent_group_well_within_half_a_second() -> None:
    assert (HEARTBEAT_TIMEOUT_MS, QUORUM_TICK_MS) == (200, 20)
    options = LighthouseOptions()
    assert (options.min_replicas, options.join_timeout_ms) == (1, None)  # torchft's join timeout
    assert (options.quorum_tick_ms, options.heartbeat_timeout_ms) == (QUORUM_TICK_MS, HEARTBEAT_TIMEOUT_MS)


@pytest.mark.parametrize(
    ("options", "argv"),
    [
        (None, ["1", "-", "20", "200"]),
        (LighthouseOptions(), ["1", "-", "20", "200"]),
        (LighthouseOptions(heartbeat_timeout_ms=5000, quorum_tick_ms=100), ["1", "-", "100", "5000"]),
        (LighthouseOptions(min_replicas=2, join_timeout_ms=500, heartbeat_timeout_ms=None), ["2", "500", "20", "-"]),
    ],
    ids=["no-options", "default-options", "torchft-timeouts", "torchft-heartbeat-default"],
)
def test_torchfts_lighthouse_gets_spark_torchs_defaults_or_the_users_options(
    options: LighthouseOptions | None, argv: list[str]
) -> None:
    """What the hidden lighthouse's process was started with (``-``: torchft's own default)."""
    pytest.importorskip("torchft")
    import psutil

    with Lighthouse("127.0.0.1", options) as lighthouse:
        assert lighthouse.hideout is not None
        child = psutil.Process(lighthouse.hideout._process.pid)  # type: ignore[union-attr]
        assert child.cmdline()[-4:] == argv
