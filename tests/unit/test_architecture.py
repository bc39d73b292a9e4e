"""The layers are enforced: the import contracts in pyproject.toml hold, and they break on an
upward import (checked on a copy of the package with one injected)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"]


def _lint(cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run(
        [*LINT, "--no-cache", "--config", str(cwd / "pyproject.toml")],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_import_contracts_hold() -> None:
    done = _lint(ROOT, ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


@pytest.mark.parametrize(
    ("module", "upward", "contract"),
    [
        ("node/lifecycle.py", "import spark_torch.driver.run.barrier", "spark_torch.node.lifecycle -> spark_torch.driver.run.barrier"),
        ("channel/node_end.py", "import spark_torch.reporting.pipes", "spark_torch.channel.node_end -> spark_torch.reporting.pipes"),
        ("rank/function_main.py", "import pyspark", "spark_torch.rank.function_main -> pyspark"),
        ("errors.py", "import spark_torch.shared.spec", "spark_torch.errors -> spark_torch.shared.spec"),
        # the driver's sub-layers: Spark access and the console never reach up into the run loop
        ("driver/spark/session.py", "import spark_torch.driver.run.controller", "spark_torch.driver.spark.session -> spark_torch.driver.run.controller"),
        ("driver/console/logs.py", "import spark_torch.driver.spark.cluster", "spark_torch.driver.console.logs -> spark_torch.driver.spark.cluster"),
        ("driver/run/plan.py", "import spark_torch.driver.api.distributor", "spark_torch.driver.run.plan -> spark_torch.driver.api.distributor"),
    ],
)
def test_an_upward_import_breaks_the_contracts(tmp_path: Path, module: str, upward: str, contract: str) -> None:
    shutil.copytree(ROOT / "spark_torch", tmp_path / "spark_torch", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "spark_torch" / module
    target.write_text(target.read_text() + f"\n{upward}  # an upward import\n")
    done = _lint(tmp_path, tmp_path)
    assert done.returncode != 0, done.stdout
    assert contract in done.stdout and "BROKEN" in done.stdout, done.stdout


def test_every_package_says_what_it_may_import() -> None:
    """docs/architecture.md: each sub-package's ``__init__.py`` says what the package may import
    (the contracts in pyproject.toml enforce it)."""
    import ast

    silent = []
    for init in sorted((ROOT / "spark_torch").rglob("__init__.py")):
        if init.parent == ROOT / "spark_torch":
            continue  # the package itself: the public API, lazily
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        if not any(line.startswith("May import:") for line in doc.splitlines()):
            silent.append(str(init.relative_to(ROOT)))
    assert silent == [], f"no 'May import:' line in {silent}"


def test_the_top_level_holds_at_most_twelve_modules() -> None:
    """The top level keeps the public modules; the rest is grouped in packages (spark_torch.base,
    spark_torch.shared, the layers)."""
    top = sorted(p.name for p in (ROOT / "spark_torch").glob("*.py"))
    assert len(top) <= 12, top
