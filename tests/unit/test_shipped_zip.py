"""The zip of spark_torch that the driver ships: its bytes depend on the package alone."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from spark_torch.driver.spark.shipping import build_zip
from spark_torch.version import package_identity


def test_two_builds_are_the_same_file(tmp_path: Path) -> None:
    """Spark refuses a fetched file whose name it knows with other bytes ("exists and does not match
    contents"): two applications whose executors share a working directory fetch the same name."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    one = build_zip(str(first))
    time.sleep(1.1)  # a zip keeps times to two seconds: the builds straddle at least one tick
    other = build_zip(str(second))
    assert one is not None and other is not None
    assert os.path.basename(one) == os.path.basename(other)
    assert Path(one).read_bytes() == Path(other).read_bytes()


def test_its_bytecode_is_hash_based_and_imported(tmp_path: Path) -> None:
    path = build_zip(str(tmp_path))
    assert path is not None
    with zipfile.ZipFile(path) as zf:
        compiled = [info for info in zf.infolist() if info.filename.endswith(".pyc")]
        sources = [info for info in zf.infolist() if info.filename.endswith(".py")]
        assert len(compiled) == len(sources) > 10
        for info in compiled:
            flags = int.from_bytes(zf.read(info)[4:8], "little")
            assert flags == 0b01, info.filename  # hash-based, not checked against the source
    probe = (
        "import sys, zipimport\n"
        f"sys.path.insert(0, {path!r})\n"
        "import spark_torch.version as v\n"
        "assert '.zip' in v.__file__, v.__file__\n"
        "print(v.package_identity())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == package_identity()


def test_a_package_imported_by_a_relative_path_still_starts_children_after_its_directory_is_gone(
    tmp_path: Path,
) -> None:
    """An executor's Python worker may import the shipped zip by a path relative to its current
    directory, which Spark can remove under it (an executor lost and replaced): the children's
    PYTHONPATH is the package's absolute place, found at import, not an error from ``os.getcwd()``."""
    where = tmp_path / "worker-dir"
    where.mkdir()
    path = build_zip(str(where))
    assert path is not None
    probe = (
        "import os, sys\n"
        f"sys.path.insert(0, {os.path.basename(path)!r})\n"
        "from spark_torch.node import processes\n"
        "assert not os.path.isabs(processes.__file__), processes.__file__\n"
        "here = os.getcwd()\n"
        f"os.unlink({os.path.basename(path)!r}); os.rmdir(here)\n"
        "print(processes.with_package_on_path({})['PYTHONPATH'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-I", "-c", probe], capture_output=True, text=True, env=env, timeout=60, cwd=where
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == path  # the zip, absolute
