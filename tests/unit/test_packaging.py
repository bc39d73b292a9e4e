"""The test toolchain is locked: the Makefile and CI install from the lock files, and the lock
names every package the [test] extra asks for."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _pinned(lock: Path) -> dict[str, str]:
    pins = {}
    for line in lock.read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"{lock.name}: {line!r} is not pinned with =="
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    return pins


def _names(requirements: list[str]) -> set[str]:
    return {re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", r).group(0)).lower() for r in requirements}


def test_the_lock_pins_every_test_requirement() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = _names(project["dependencies"])
    for extra in ("spark", "mlflow", "examples", "test"):
        wanted |= _names(project["optional-dependencies"][extra])
    wanted -= {"spark-torch"}
    pins = _pinned(ROOT / "constraints.txt")
    assert not wanted - set(pins), f"not in constraints.txt (run make lock): {sorted(wanted - set(pins))}"
    assert pins["torch"] == "2.13.0"  # no local label: the same pin holds for CPU and CUDA builds
    assert {"pip", "setuptools", "wheel"} <= set(pins)  # the build tools are locked too


def test_the_pyspark35_lock_pins_its_requirements() -> None:
    lines = (ROOT / ".ci" / "requirements-pyspark35.txt").read_text().splitlines()
    wanted = _names([line for line in lines if line.strip() and not line.startswith("#")])
    pins = _pinned(ROOT / ".ci" / "constraints-pyspark35.txt")
    assert not wanted - set(pins), sorted(wanted - set(pins))
    assert pins["pyspark"].startswith("3.5.")


def test_make_and_ci_install_from_the_locks() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "LOCK ?= constraints.txt" in makefile
    recipes = [line for line in makefile.splitlines() if line.startswith("\t")]
    installs = [line for line in recipes if ("pip install" in line or "$(INSTALL)" in line) and "build" not in line]
    # every install takes the lock's versions, but uv's own, which UV_SPEC pins
    assert installs and all("$(LOCK" in line or "$(UV_SPEC)" in line for line in installs), installs
    assert re.search(r"^UV_SPEC \?= uv==[0-9.]+$", makefile, re.M)
    assert re.search(r"^INSTALL := \$\(PY\) -m pip install$", makefile, re.M)  # pip unless INSTALLER=uv
    assert "bash .ci/lock.sh" in makefile  # make lock
    ci = (ROOT / ".ci" / "run").read_text()
    assert "PIP_NO_CACHE_DIR=1" in ci and "rm -rf .venv .venv35" in ci
    assert "constraints-pyspark35.txt" in (ROOT / ".ci" / "pyspark35.sh").read_text()
    assert "constraints.txt" in (ROOT / ".ci" / "package_check.sh").read_text()


def test_torch_comes_from_the_cpu_index_without_an_nvidia_driver() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert (
        "TORCH_INDEX ?= $(if $(wildcard /proc/driver/nvidia/version),,https://download.pytorch.org/whl/cpu)" in makefile
    )
    assert "--extra-index-url $(TORCH_INDEX)" in makefile


def test_every_line_of_the_pyspark35_selection_names_a_test() -> None:
    """.ci/pyspark35-tests.txt: each node id is a test function (or a whole file) that exists, so a
    renamed test is not silently dropped from CI's PySpark 3.5 run."""
    lines = (ROOT / ".ci" / "pyspark35-tests.txt").read_text().splitlines()
    selected = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    assert len(selected) >= 20, selected
    for node in selected:
        path, _, name = node.partition("::")
        assert (ROOT / path).is_file(), f"{node}: no file {path}"
        if name:
            function = name.split("[", 1)[0]
            assert re.search(rf"^def {function}\(", (ROOT / path).read_text(), re.MULTILINE), (
                f"{node}: no test {function} in {path}"
            )
    assert ".ci/pyspark35-tests.txt" in (ROOT / ".ci" / "pyspark35.sh").read_text()
