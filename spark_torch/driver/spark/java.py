"""Is there a Java that this PySpark can start? Asked before an embedded session starts.

PySpark starts its JVM the way Spark's ``spark-class`` script does: ``$JAVA_HOME/bin/java`` when
``JAVA_HOME`` is set, else ``java`` on ``PATH``. Without one, or with one too old for this Spark
(Spark 4 needs Java 17), PySpark fails with "Java gateway process exited" and a Py4J traceback
that names neither. :func:`check_java` runs ``java -version`` first (about 0.1 s, against the
seconds a JVM takes to start) and raises one :class:`~spark_torch.errors.LaunchError` saying
where it looked, what it found and what is needed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping

from spark_torch.errors import LaunchError

__all__ = ["check_java", "find_java", "java_major", "required_java", "VERSION_SECONDS"]

#: how long ``java -version`` may take
VERSION_SECONDS = 30.0

_VERSION = re.compile(r'version "([^"]+)"')


def find_java(environ: Mapping[str, str]) -> tuple[str | None, str]:
    """(the java Spark would start or None, where it was looked for), as ``spark-class`` does."""
    home = environ.get("JAVA_HOME")
    if home:
        return os.path.join(home, "bin", "java"), f"JAVA_HOME={home}"
    return shutil.which("java", path=environ.get("PATH", os.defpath)), "on PATH; JAVA_HOME is not set"


def java_major(version_output: str) -> tuple[int, str] | None:
    """(major version, version string) from ``java -version``'s output: ``1.8.0_292`` is 8,
    ``11.0.2`` is 11, ``21-ea`` is 21; None when it names no version."""
    found = _VERSION.search(version_output)
    if found is None:
        return None
    text = found.group(1)
    parts = re.findall(r"\d+", text)
    if not parts:
        return None
    major = int(parts[1]) if parts[0] == "1" and len(parts) > 1 else int(parts[0])
    return major, text


def required_java(pyspark_version: str) -> int:
    """The oldest Java the given PySpark runs on: 17 for Spark 4, 8 before."""
    try:
        return 17 if int(pyspark_version.split(".")[0]) >= 4 else 8
    except ValueError:
        return 17


def check_java(pyspark_version: str, environ: Mapping[str, str] | None = None) -> None:
    """Raise :class:`LaunchError` (one line) unless a Java this PySpark can run on is there."""
    environ = os.environ if environ is None else environ
    needed = required_java(pyspark_version)
    install = (
        f"install a JDK {needed} or newer and set JAVA_HOME to it (or put its bin/ first on PATH), or use "
        "local_mode=True (`spark-torch run` without --master), which needs no Spark"
    )
    java, where = find_java(environ)
    if java is None:
        raise LaunchError(
            f"PySpark {pyspark_version} needs Java {needed} or newer, but there is none (JAVA_HOME is not set and "
            f"no java is on PATH); {install}"
        )
    if not os.path.isfile(java):
        raise LaunchError(
            f"PySpark {pyspark_version} needs Java {needed} or newer, but there is none ({where}, and {java} "
            f"does not exist); {install}"
        )
    try:
        done = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=VERSION_SECONDS, env=dict(environ), check=False
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise LaunchError(
            f"PySpark {pyspark_version} needs Java {needed} or newer, but {java} ({where}) does not run: {exc}; "
            f"{install}"
        ) from None
    found = java_major(done.stderr + done.stdout)
    if found is None:
        return  # an unusual build: let Spark try it
    major, text = found
    if major < needed:
        raise LaunchError(
            f"PySpark {pyspark_version} needs Java {needed} or newer, but {java} ({where}) is Java {text}; {install}"
        )
