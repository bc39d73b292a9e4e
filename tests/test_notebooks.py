"""The notebooks in notebooks/ execute top to bottom in a real Jupyter kernel.

Each runs with nbclient in its own ipykernel process (this venv's interpreter), with the
notebooks directory as working directory, like a user opening it in Jupyter. Their Spark
sessions live in the kernel process, so they do not clash with the test process's session.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import pytest

from . import notebook_runner

pytestmark = pytest.mark.slow


def execute(name: str, tmp_path: Path, monkeypatch: Any) -> Any:
    """Execute the notebook afresh and check that its stored outputs are current: the same
    cells have outputs of the same kinds and print the same lines, numbers aside (the docs
    site shows the stored outputs; refresh them with `python -m tests.notebook_runner`)."""
    import nbformat

    book = notebook_runner.execute(name, tmp_path)
    stored = nbformat.read(notebook_runner.NOTEBOOKS / f"{name}.ipynb", as_version=4)
    fresh_sig, stored_sig = notebook_runner.signature(book), notebook_runner.signature(stored)
    assert len(stored_sig) == len(fresh_sig), f"{name}: code cells changed; run python -m tests.notebook_runner {name}"
    for (index, kinds, lines), (_, stored_kinds, stored_lines) in zip(fresh_sig, stored_sig):
        assert stored_kinds == kinds, (
            f"{name}: cell {index} now outputs {kinds}, the stored notebook {stored_kinds}; "
            f"run python -m tests.notebook_runner {name}"
        )
        assert stored_lines == lines, (
            f"{name}: cell {index} prints other lines than stored: new {sorted(lines - stored_lines)[:5]}, "
            f"gone {sorted(stored_lines - lines)[:5]}; run python -m tests.notebook_runner {name}"
        )
    return book


#: an absolute path at the start of a word (not a URL's ``//``, not a fraction like ``0/2``)
_ABSOLUTE_PATH = re.compile(r"(?:^|(?<=[\s'\"(\[=]))/(?!/)[\w.-]+/[\w.-]")
#: what a JVM prints on every start (see spark_torch.driver.spark.session.JVM_START_NOISE)
_JVM_NOISE = ("Using incubator modules", "log4j", "Setting default log level", "sc.setLogLevel", "NativeCodeLoader")
#: other libraries' advertisements and deprecation notices: filtered in the notebook, not stored
_THIRD_PARTY = ("💡", "litlogger", "is deprecated", "DeprecationWarning", "FutureWarning", "UserWarning")


@pytest.mark.parametrize("path", sorted(notebook_runner.NOTEBOOKS.glob("*.ipynb")), ids=lambda p: p.stem)
def test_stored_outputs_are_clean(path: Path) -> None:
    """What the docs site shows: no absolute path, temporary directory or host name of the
    machine that ran it, no JVM start-up lines, no other library's advertisement or warning box,
    no SPARK_LOCAL_IP boilerplate, and the status as one line per run (not one per refresh)."""
    import socket

    import nbformat

    book = nbformat.read(path, as_version=4)
    hosts = {socket.gethostname(), socket.getfqdn()} - {"", "localhost"}
    for index, cell in enumerate(book.cells):
        where = f"{path.name} cell {index}"
        assert "SPARK_LOCAL_IP" not in cell.source, f"{where}: SPARK_LOCAL_IP boilerplate"
        outputs = cell.get("outputs", [])
        text = texts(nbformat.from_dict({"cells": [cell]}))
        for machine_path, _ in notebook_runner.machine_paths():
            assert machine_path not in text, f"{where} shows {machine_path}"
        assert "/work/" not in text and "site-packages/" not in text.replace("<site-packages>/", "")
        absolute = [m.group(0) for line in text.splitlines() for m in [_ABSOLUTE_PATH.search(line)] if m]
        assert not absolute, f"{where} shows absolute paths: {absolute}"
        named = [h for h in hosts if re.search(rf"(?<![\w.-]){re.escape(h)}(?![\w-])", text)]
        assert not named, f"{where} shows this machine's name {named}"
        for noise in (*_JVM_NOISE, *_THIRD_PARTY):
            assert noise not in text, f"{where} shows {noise!r}"
        assert "TqdmWarning" not in text and "IProgress" not in text, f"{where}: a widget warning"
        status = [o for o in outputs if "spark_torch ranks:" in str(o.get("text", "")) + str(o.get("data", {}))]
        assert not status, f"{path.name} cell {index}: a status line per refresh was stored"


def texts(book: Any) -> str:
    """All text outputs of all cells (stream, results and errors), joined."""
    parts: list[str] = []
    for cell in book.cells:
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                parts.append(out.text)
            elif out.output_type in ("execute_result", "display_data"):
                parts.append(out.get("data", {}).get("text/plain", ""))
            elif out.output_type == "error":
                parts.append("\n".join(out.traceback))
    return "\n".join(parts)


def accuracy_from(text: str, label: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(label))
    return float(line.split(":", 1)[1])


def test_01_quickstart(tmp_path: Path, monkeypatch: Any) -> None:
    book = execute("01_quickstart", tmp_path, monkeypatch)
    out = texts(book)
    assert "[rank 0] hello from rank 0 of 2" in out
    assert "[rank 1] hello from rank 1 of 2" in out
    assert "[rank 0] epoch 8: loss" in out
    assert accuracy_from(out, "test accuracy") > 0.9
    images = [
        out.data["image/png"]
        for cell in book.cells
        for out in cell.get("outputs", [])
        if out.output_type == "display_data" and "image/png" in out.get("data", {})
    ]
    assert len(images) == 2  # the loss curve, and the resumed run's live chart of its reports
    assert all(base64.b64decode(image).startswith(b"\x89PNG") for image in images)
    assert "[rank 0] dataframe epoch 5: train accuracy" in out
    assert "spark_torch: 2 rank(s): 2 finished, 0 failed" in out  # the live status's summary
    assert accuracy_from(out, "dataframe train accuracy") > 0.9
    # a rank SIGKILLed after batch 15 of epoch 1, the gang restarted from the checkpoint after batch 10:
    # the loaders go on at batch 11, and every row is trained once per epoch
    assert "failed: killed by SIGKILL); restarting the gang (1 of 1)" in out
    assert "[rank 0] life 1: resumed at step 10, epoch 1, batch 11" in out and "restarts: 1" in out
    assert "epoch 1: 1796 rows trained, every one of the 1796 once: True" in out
    assert "epoch 2: 1796 rows trained, every one of the 1796 once: True" in out


def test_02_migrate_a_script(tmp_path: Path, monkeypatch: Any) -> None:
    out = texts(execute("02_migrate_a_script", tmp_path, monkeypatch))
    assert "[rank 0] rank 0/2" in out and "[rank 1] rank 1/2" in out
    assert "[rank 0] epoch 3/3 loss" in out
    assert "[rank 0] saved checkpoint to" in out
    assert "checkpoint exists: True" in out
    assert accuracy_from(out, "test accuracy") > 0.85


def test_03_lightning(tmp_path: Path, monkeypatch: Any) -> None:
    out = texts(execute("03_lightning", tmp_path, monkeypatch))
    assert "[rank 0] Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2" in out
    assert "[rank 1] Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in out
    assert "[rank 1] global rank 1, node rank 1, environment TorchElasticEnvironment" in out
    assert "'cluster_environment': 'TorchElasticEnvironment'" in out
    assert "'world_size': 2" in out
    assert accuracy_from(out, "final accuracy") > 0.85


def test_04_troubleshooting(tmp_path: Path, monkeypatch: Any) -> None:
    out = texts(execute("04_troubleshooting", tmp_path, monkeypatch))
    assert "DistributedRunError: failing rank = 1" in out
    assert "ValueError: bad batch on rank 1" in out
    assert "[rank 1] rank 1 starting" in out
    assert "PicklingError (a TypeError: True)" in out
    assert "lock" in out
    assert "RunTimeoutError (a TimeoutError: True)" in out
    assert "Stopped while still running: ranks 0, 1" in out and "still running: stopped" not in out
    # the stall cell: the grouped stacks while rank 1 is late, then the run goes on
    assert "no rank made progress for" in out and "(stall_timeout=3s)" in out
    assert "rank 0: in all_reduce" in out and "rank 1: in load_batch" in out
    assert "the run moves again after" in out and "the run went on and finished; all_reduce gave 2.0" in out
    assert "InsufficientSlotsError (a ValueError: True)" in out
    assert "ConfigurationError" in out


def images(book: Any) -> list[bytes]:
    return [
        base64.b64decode(out.data["image/png"])
        for cell in book.cells
        for out in cell.get("outputs", [])
        if out.output_type == "display_data" and "image/png" in out.get("data", {})
    ]


def test_05_report_and_resume(tmp_path: Path, monkeypatch: Any) -> None:
    book = execute("05_report_and_resume", tmp_path, monkeypatch)
    out = texts(book)
    assert "final weights equal to the uninterrupted run: True" in out
    assert "steps: [1, 2, 3, 4, 5, 6, 7, 8]" in out and "restarts: 1" in out
    assert "[rank 0] resuming after epoch 4" in out and "[rank 0] resuming after epoch 7" in out
    assert "restarting the gang (1 of 1)" in out
    charts = images(book)  # the live chart of each training cell, left as a static image
    assert len(charts) == 3 and all(c.startswith(b"\x89PNG") for c in charts)


def test_stored_notebooks_have_outputs() -> None:
    import nbformat

    for path in sorted(notebook_runner.NOTEBOOKS.glob("*.ipynb")):
        book = nbformat.read(path, as_version=4)
        code = [c for c in book.cells if c.cell_type == "code"]
        assert any(c.get("outputs") for c in code), f"{path.name} is stored without outputs"


def test_06_replica_groups(tmp_path: Path, monkeypatch: Any) -> None:
    pytest.importorskip("torchft")
    book = execute("06_replica_groups", tmp_path, monkeypatch)
    out = texts(book)
    assert "restarting it alone (1 of 1), the other groups go on" in out
    assert (
        "group 0: start, succeeded\ngroup 1: start, failed\ngroup 1: restart after a failure, succeeded\nrestarts: 1"
        in out
    )
    went_on = re.search(r"group 1's first process reported steps up to (\d+); the second went on at step (\d+)", out)
    assert went_on is not None and int(went_on.group(2)) > int(went_on.group(1)) >= 8, out[-2000:]  # its peer's step
    assert "group 0 reported every step from its first: True" in out
    assert "torchft::" not in out  # the lighthouse's INFO lines stay out of the notebook
