"""What the suite builds once per environment, made by ``make bootstrap`` instead of by the
first test that needs it: the JVMs' class-data archive (:mod:`tests.jvm_archive`) and DeepSpeed's
CPU shared-memory op (compiled by DeepSpeed on its first CPU run, ``tests/test_integrations.py``).

Both are built side by side (the archive is one JVM, the op two C++ files). In CI the install of
the PySpark 3.5 venv runs beside ``make bootstrap``, so these minutes overlap downloads instead of
the suite's tests. Either one failing only costs time later: the suite makes the archive at its
start, and DeepSpeed compiles its op in the test, as before. ``python -m tests.prebuild``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

#: where DeepSpeed's op is built: one cache per environment (tests/conftest.py sets the same)
TORCH_EXTENSIONS_DIR = os.path.join(sys.prefix, "torch-extensions")
#: how long the op's build may take on 2 cores
BUILD_SECONDS = 900.0

_BUILD_OP = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"


def main() -> int:
    """Build both; say what was built and how long it took. Always 0: nothing here is required."""
    from tests import jvm_archive

    started = time.monotonic()
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", TORCH_EXTENSIONS_DIR)}
    op = None
    if importlib.util.find_spec("deepspeed") is not None:
        op = subprocess.Popen(
            [sys.executable, "-c", _BUILD_OP], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
    archive = jvm_archive.ensure_archive()
    print(f"tests/prebuild.py: class-data archive {'ready' if archive else 'not made'}")
    if op is not None:
        try:
            _, errors = op.communicate(timeout=BUILD_SECONDS)
        except subprocess.TimeoutExpired:
            op.kill()
            _, errors = op.communicate()
            errors = f"not built within {BUILD_SECONDS:.0f} s"
        state = "built" if op.returncode == 0 else f"not built (the test builds it): {errors.strip()[-500:]}"
        print(f"tests/prebuild.py: DeepSpeed's CPU op {state}")
    print(f"tests/prebuild.py: {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
