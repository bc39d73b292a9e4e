"""The package version (one place: ``pyproject.toml`` reads it from here), and the identity of
the code that runs: the version plus a digest of the package's source, so that a driver and an
executor with the same version string but different code are told apart.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import zipfile

__version__ = "0.1.0"

#: written into a package zip the driver ships to the executors: the digest it was built from
SHIPPED_FILE = "_shipped.json"


def _package_dir() -> str:
    return os.path.dirname(os.path.abspath(__file__))


def source_digest(root: str) -> str:
    """SHA-256 (16 hex digits) over every ``.py`` file under the package directory ``root``,
    by relative path and content."""
    digest = hashlib.sha256()
    for directory, dirs, files in sorted(os.walk(root)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(directory, name)
            digest.update(os.path.relpath(path, root).replace(os.sep, "/").encode() + b"\0")
            with open(path, "rb") as fh:
                digest.update(fh.read() + b"\0")
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def package_identity() -> str:
    """``VERSION+DIGEST`` of the spark_torch this process runs (from a shipped zip: the digest
    the driver built it from)."""
    root = _package_dir()
    archive, _, inner = root.rpartition(".zip")
    if archive and os.path.isfile(archive + ".zip"):  # imported from a zip the driver shipped
        with zipfile.ZipFile(archive + ".zip") as zf:
            shipped = json.loads(zf.read(f"spark_torch/{SHIPPED_FILE}"))
        return str(shipped["identity"])
    return f"{__version__}+{source_digest(root)}"
