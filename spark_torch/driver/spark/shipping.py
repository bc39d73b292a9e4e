"""The driver's spark_torch travels to the executors, so driver and executors run the same code.

Before a distributed run, the package this driver imported is zipped (its ``.py`` files, their
bytecode for this Python, and the digest they were built from) into a temporary file and added
to the session: ``SparkContext.addPyFile`` (classic) or ``SparkSession.addArtifacts(...,
pyfile=True)`` (Spark Connect). Spark's Python workers put such a file on ``sys.path`` ahead
of site-packages, so an executor without spark_torch, or with another version, imports the
driver's; the ranks get it on ``PYTHONPATH`` from their node. It happens once per session and
package identity. The nodes check the identity when they meet either way
(:func:`spark_torch.node.lifecycle.package_mismatch`). The ``ship_package`` setting turns it off.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import py_compile
import shutil
import tempfile
import threading
import zipfile
from typing import Any

from spark_torch import version
from spark_torch.driver.spark.cluster import is_connect_session
from spark_torch.version import SHIPPED_FILE, package_identity

__all__ = ["ship_package", "build_zip"]

logger = logging.getLogger(__name__)

_lock = threading.Lock()
#: (session key, identity) pairs already shipped in this process
_shipped: set[tuple[str, str]] = set()
#: every entry's time: the zip's bytes depend on the package alone. Spark refuses a file whose name
#: it has fetched before with other bytes (two builds of one package, e.g. two applications whose
#: executors share a working directory, must be the same file)
_ENTRY_TIME = (1980, 1, 1, 0, 0, 0)


def _session_key(spark: Any) -> str:
    if is_connect_session(spark):
        return f"connect:{getattr(spark, 'session_id', id(spark))}"
    return f"classic:{spark.sparkContext.applicationId}"


def _add(zf: zipfile.ZipFile, arcname: str, data: bytes) -> None:
    """One entry with a fixed time and mode, so the same package always makes the same bytes."""
    entry = zipfile.ZipInfo(arcname, date_time=_ENTRY_TIME)
    entry.external_attr = 0o644 << 16
    entry.compress_type = zipfile.ZIP_DEFLATED
    zf.writestr(entry, data)


def build_zip(directory: str) -> str | None:
    """``directory/spark_torch-IDENTITY.zip`` of this driver's package, the same bytes for the same
    package; None when the package is not a plain directory (it was itself imported from an archive)."""
    root = os.path.dirname(os.path.abspath(version.__file__))
    if not os.path.isdir(root):
        return None
    identity = package_identity()
    path = os.path.join(directory, f"spark_torch-{identity.replace('+', '-')}.zip")
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf, tempfile.TemporaryDirectory() as tmp:
        for current, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(f for f in files if f.endswith(".py")):
                source = os.path.join(current, name)
                arcname = "spark_torch/" + os.path.relpath(source, root).replace(os.sep, "/")
                with open(source, "rb") as handle:
                    _add(zf, arcname, handle.read())
                # zipimport reads ``module.pyc`` beside the source: no compiling in every worker. A
                # hash-based pyc does not depend on the source's time, which the zip does not keep.
                compiled = os.path.join(tmp, "module.pyc")
                py_compile.compile(
                    source,
                    cfile=compiled,
                    dfile=arcname,
                    doraise=True,
                    invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
                )
                with open(compiled, "rb") as handle:
                    _add(zf, arcname + "c", handle.read())
        _add(zf, f"spark_torch/{SHIPPED_FILE}", json.dumps({"identity": identity}).encode())
    return path


def ship_package(spark: Any) -> bool:
    """Add this driver's spark_torch to the session's Python files (once); True if it is there."""
    key = (_session_key(spark), package_identity())
    with _lock:
        if key in _shipped:
            return True
        directory = tempfile.mkdtemp(prefix="spark_torch_ship-")  # served to executors while the session lives
        atexit.register(shutil.rmtree, directory, True)
        path = build_zip(directory)
        if path is None:
            logger.warning("spark_torch: this driver's spark_torch is not a directory; the executors use their own")
            return False
        if is_connect_session(spark):
            spark.addArtifacts(path, pyfile=True)
        else:
            spark.sparkContext.addPyFile(path)
        _shipped.add(key)
        logger.info("spark_torch: shipped spark_torch %s to the executors (%s)", key[1], path)
        return True
