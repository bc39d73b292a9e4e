"""The notebooks in notebooks/ execute top to bottom in a real Jupyter kernel.

Each runs with nbclient in its own ipykernel process (this venv's interpreter), with the
notebooks directory as working directory, like a user opening it in Jupyter. Their Spark
sessions live in the kernel process, so they do not clash with the test process's session.
"""

from __future__ import annotations

import base64
import os
import sys
from pathlib import Path
from typing import Any

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
CELL_TIMEOUT = 300

pytestmark = pytest.mark.slow


def _kernel_name(tmp_dir: Path) -> tuple[str, dict[str, str]]:
    """A kernelspec named python3 that runs sys.executable (installed under a temp prefix when
    the venv has none), and the environment that makes jupyter_client find it."""
    env: dict[str, str] = {}
    spec = Path(sys.prefix) / "share" / "jupyter" / "kernels" / "python3" / "kernel.json"
    if not spec.exists():
        from ipykernel.kernelspec import install

        install(prefix=str(tmp_dir), kernel_name="python3")
        env["JUPYTER_PATH"] = os.pathsep.join(
            [str(tmp_dir / "share" / "jupyter"), os.environ.get("JUPYTER_PATH", "")]
        ).rstrip(os.pathsep)
    return "python3", env


def execute(name: str, tmp_path: Path, monkeypatch: Any) -> Any:
    import nbformat
    from nbclient import NotebookClient

    kernel, env = _kernel_name(tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # the kernel must start the venv's interpreter: jupyter_client maps "python" in a
    # kernelspec's argv to sys.executable; PATH first so nothing else can win
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    book = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    client = NotebookClient(
        book,
        timeout=CELL_TIMEOUT,
        kernel_name=kernel,
        resources={"metadata": {"path": str(NOTEBOOKS)}},
    )
    client.execute()
    return book


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
    assert len(images) == 1
    assert base64.b64decode(images[0]).startswith(b"\x89PNG")
    assert "[rank 0] dataframe epoch 5: train accuracy" in out
    assert "spark_torch: 2 rank(s): 2 finished, 0 failed" in out  # the live status's summary
    assert accuracy_from(out, "dataframe train accuracy") > 0.9


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
    assert "InsufficientSlotsError (a ValueError: True)" in out
    assert "ConfigurationError" in out
