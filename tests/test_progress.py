"""The live status: counts ranks in both modes, collapses into one summary line, off when not interactive."""

from __future__ import annotations

import os
import re
from typing import Any

import pytest

from spark_torch import DistributedRunError, Distributor
from spark_torch.driver.console.status import RunStatus


def say_hello() -> int:
    print(f"hello from {os.environ['RANK']}", flush=True)
    return 1


def fail_rank1() -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("boom")


def test_unit_counts_and_summary(capsys: pytest.CaptureFixture[str]) -> None:
    status = RunStatus(2, enabled=True)
    for event in ("started", "started", "finished", "failed"):
        status.event(0, event)
    assert (status.started, status.running, status.finished, status.failed) == (2, 0, 1, 1)
    with status.around_output():
        print("a log line")
    status.close()
    err = capsys.readouterr().err
    assert re.search(r"spark_torch: 2 rank\(s\): 1 finished, 1 failed, 0 stopped, 0 not started, in \d+\.\ds", err)
    assert "spark_torch ranks" in err  # the bar was drawn


def test_local_summary_and_logs_intact(capsys: pytest.CaptureFixture[str], no_leftovers: None) -> None:
    assert Distributor(num_processes=2, progress=True).run(say_hello) == 1
    captured = capsys.readouterr()
    assert "[rank 0] hello from 0" in captured.out and "[rank 1] hello from 1" in captured.out
    assert "spark_torch: 2 rank(s): 2 finished, 0 failed" in captured.err


def test_distributed_summary_counts_failure(
    spark_session: Any, capsys: pytest.CaptureFixture[str], no_leftovers: None
) -> None:
    assert Distributor(num_processes=2, local_mode=False, spark=spark_session, progress=True).run(say_hello) == 1
    assert "spark_torch: 2 rank(s): 2 finished, 0 failed" in capsys.readouterr().err
    with pytest.raises(DistributedRunError):
        Distributor(num_processes=2, progress=True).run(fail_rank1)
    assert re.search(r"2 rank\(s\): [01] finished, [12] failed", capsys.readouterr().err)


def test_off_when_not_interactive(capsys: pytest.CaptureFixture[str], no_leftovers: None) -> None:
    Distributor(num_processes=1).run(say_hello)
    assert "spark_torch ranks" not in capsys.readouterr().err


def test_importing_ipykernel_is_not_interactive() -> None:
    """Only a running Jupyter kernel counts, not a process that merely imported ipykernel."""
    import ipykernel  # noqa: F401

    from spark_torch.driver.console.status import interactive

    assert interactive() is False


def hang() -> None:
    import time

    print("waiting", flush=True)
    time.sleep(600)


@pytest.mark.parametrize("local_mode", [True, False])
def test_a_timeout_counts_stopped_ranks(
    local_mode: bool, spark_session: Any, capsys: pytest.CaptureFixture[str], no_leftovers: None
) -> None:
    """Ranks stopped by spark_torch (here: the timeout) are counted as stopped, not failed."""
    from spark_torch import RunTimeoutError

    # long enough for both ranks to start first: on a loaded machine (two busy loops on 2 cores)
    # they had not within 8 s ("0 stopped, 2 not started")
    with pytest.raises(RunTimeoutError):
        Distributor(num_processes=2, local_mode=local_mode, spark=spark_session, progress=True, timeout=15).run(hang)
    assert "spark_torch: 2 rank(s): 0 finished, 0 failed, 2 stopped, 0 not started" in capsys.readouterr().err


SUMMARY_CELL = """
from spark_torch import Distributor

def talk():
    import os
    for n in range(3):
        print(f"line {n} of rank {os.environ['RANK']}", flush=True)

Distributor(num_processes=2, progress=True).run(talk)
"""


@pytest.mark.slow
def test_jupyter_summary_below_the_rank_lines(tmp_path: Any, monkeypatch: Any, no_leftovers: None) -> None:
    """In a real Jupyter kernel the summary is printed after the last rank line it sums up, and
    the live line leaves no status text behind."""
    import nbformat
    from nbclient import NotebookClient

    from . import notebook_runner

    kernel, env = notebook_runner.kernel_environment(tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    book = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(SUMMARY_CELL)])
    NotebookClient(book, timeout=240, kernel_name=kernel, resources={"metadata": {"path": str(tmp_path)}}).execute()
    texts = [
        o.text if o.output_type == "stream" else o.get("data", {}).get("text/plain", "") for o in book.cells[0].outputs
    ]
    summary = [i for i, text in enumerate(texts) if text.startswith("spark_torch: 2 rank(s): 2 finished")]
    rank_lines = [i for i, text in enumerate(texts) if "[rank " in text]
    assert len(summary) == 1 and len(rank_lines) >= 1, texts
    assert "".join(texts).count("line 2 of rank") == 2
    assert summary[0] > max(rank_lines), f"the summary is above rank lines: {texts}"
    assert not any("spark_torch ranks:" in text for text in texts), texts
