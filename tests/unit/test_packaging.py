"""What the package and the Makefile promise: the demo installs only what it needs, optional
dependencies stay extras, Java is checked by version."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!\[ ;]", r, maxsplit=1)[0].lower() for r in requirements}


def test_core_dependencies_stay_small() -> None:
    assert _names(PROJECT["dependencies"]) == {"torch", "cloudpickle", "tqdm", "psutil", "fsspec", "cryptography"}


def test_the_demo_extra_has_no_test_toolchain() -> None:
    examples = _names(PROJECT["optional-dependencies"]["examples"])
    assert examples == {"spark-torch", "scikit-learn"}  # spark-torch[spark]: pyspark, pyarrow, pandas
    assert "make demo" in (ROOT / "Makefile").read_text()
    demo = re.search(r"^\$\(VENV\)/\.demo:.*?\n\n", (ROOT / "Makefile").read_text(), re.S | re.M)
    assert demo is not None and "'.[examples]'" in demo.group(0) and "test" not in demo.group(0)


def test_check_java_names_the_version_it_needs() -> None:
    done = subprocess.run(["make", "-s", "check-java", "JAVA_MIN=99"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "needs Java 99 or newer" in done.stdout + done.stderr
    assert subprocess.run(["make", "-s", "check-java"], cwd=ROOT, capture_output=True, timeout=60).returncode == 0
