"""An error raised by spark_torch on the driver leaves run() with the user's frames and the
message only: no internal frame (spark_torch's, the standard library's, an installed package's)
in its traceback or its cause's; ``SPARK_TORCH_FULL_TRACEBACK=1`` gives the whole chain back."""

from __future__ import annotations

import traceback
from typing import Any

import pytest

from spark_torch import ConfigurationError, DistributedRunError, Distributor, InsufficientSlotsError


def _frames(error: BaseException) -> list[str]:
    """The files of every frame printed for ``error`` and the exceptions chained to it."""
    text = "".join(traceback.format_exception(error))
    return [line.split('"')[1] for line in text.splitlines() if line.startswith('  File "')]


def nothing() -> None:
    pass


def fails() -> None:
    raise ValueError("the user's own error")


def test_a_preflight_error_shows_the_users_frame_and_the_message(spark_session: Any, no_leftovers: None) -> None:
    """Distributed mode, more ranks than local[2] has slots: found before the barrier stage,
    deep inside the controller; the user sees their own call and the message."""
    with pytest.raises(InsufficientSlotsError) as info:
        Distributor(num_processes=3, local_mode=False, spark=spark_session).run(nothing)
    assert _frames(info.value) == [__file__]
    assert "3" in str(info.value) and "slot" in str(info.value)


def test_a_config_error_shows_its_cause_in_one_line(no_leftovers: None) -> None:
    """A storage fsspec cannot open: the ConfigurationError names the URL and the fix; its cause
    (fsspec's ValueError) stays chained, without fsspec's frames."""
    with pytest.raises(ConfigurationError) as info:
        Distributor(num_processes=1, storage_path="nosuchproto://bucket/runs").run(nothing)
    assert _frames(info.value) == [__file__]
    assert isinstance(info.value.__cause__, ValueError) and "Protocol not known" in str(info.value.__cause__)
    text = "".join(traceback.format_exception(info.value))
    assert "During handling of the above exception" not in text and "spark_torch/" not in text


def test_a_rank_failure_keeps_the_remote_error(no_leftovers: None) -> None:
    with pytest.raises(DistributedRunError) as info:
        Distributor(num_processes=1, log_ranks=[]).run(fails)
    assert _frames(info.value) == [__file__, __file__]  # the call, and the rank's traceback: fails() only
    assert "ValueError: the user's own error" in str(info.value)


def test_the_switch_gives_the_whole_chain_back(monkeypatch: pytest.MonkeyPatch, no_leftovers: None) -> None:
    monkeypatch.setenv("SPARK_TORCH_FULL_TRACEBACK", "1")
    with pytest.raises(ConfigurationError) as info:
        Distributor(num_processes=1, storage_path="nosuchproto://bucket/runs").run(nothing)
    frames = _frames(info.value)
    assert frames[0].endswith("fsspec/core.py") or any("fsspec" in f for f in frames)
    assert any(f.endswith("spark_torch/driver/run/controller.py") for f in frames)
