"""The live chart in Jupyter (driver/console/tracker.py) leaves the user's matplotlib alone.

A run in a real Jupyter kernel (nbclient, this venv's ipykernel) whose user chose a matplotlib
backend and has a pyplot figure open: the run draws its chart under the cell, and afterwards
the backend is still the user's and pyplot holds the same figures (a later ``plt.show()`` still
draws).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from . import notebook_runner

pytestmark = pytest.mark.slow

CELL = """
import json, matplotlib
matplotlib.use("svg")  # the user's choice: one spark_torch must not change
import matplotlib.pyplot as plt
plt.figure()  # the user's own open figure
before = (matplotlib.get_backend(), plt.get_fignums())

from spark_torch import Distributor

def train(steps):
    import spark_torch
    for step in range(steps):
        spark_torch.report({"loss": 1.0 / (step + 1)})
    return steps

assert Distributor(num_processes=1, storage_path=STORAGE).run(train, 3) == 3
print("MATPLOTLIB", json.dumps({"before": before, "after": (matplotlib.get_backend(), plt.get_fignums())}))
"""


def test_live_chart_keeps_the_users_backend_and_figures(tmp_path: Path, monkeypatch: Any, no_leftovers: None) -> None:
    import nbformat
    from nbclient import NotebookClient

    kernel, env = notebook_runner.kernel_environment(tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code = f"STORAGE = {str(tmp_path / 'runs')!r}\n{CELL}"
    book = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])
    NotebookClient(book, timeout=240, kernel_name=kernel, resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = book.cells[0].outputs
    images = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    assert images, f"no chart was drawn under the cell: {outputs}"
    printed = "".join(o.text for o in outputs if o.output_type == "stream" and o.name == "stdout")
    state = json.loads(next(line for line in printed.splitlines() if line.startswith("MATPLOTLIB ")).split(" ", 1)[1])
    assert state["before"][0] == "svg"
    assert state["after"] == state["before"], "the run changed the user's matplotlib backend or pyplot's figures"
