#!/usr/bin/env bash
# Packaging check: build the wheel and sdist, install the wheel WITHOUT extras in a clean venv
# (torch pinned to the local CPU wheel first), and check that it does not pull pyspark, that
# `spark-torch --version` works and that a local-mode run (no Spark at all) works.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUILD_PY=${BUILD_PY:-.venv/bin/python}   # an environment that has `build` (the test extra)
# `--build-only DIR`: build into DIR and stop; `DIST=DIR`: check what was built there (.ci/run builds
# once, then checks the package while the PySpark 3.5 suites run from the same wheel)
if [ "${1:-}" = "--build-only" ]; then
  mkdir -p "$2"
  # what `make dist` runs
  "$BUILD_PY" -m build --wheel --sdist --outdir "$2" . >"$2/build.log" 2>&1 || { cat "$2/build.log"; echo "package check: build failed"; exit 1; }
  if grep -i "license" "$2/build.log" | grep -qi "warn"; then echo "package check: license warning while building:"; grep -i "license" "$2/build.log"; exit 1; fi
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -n "${DIST:-}" ]; then
  mkdir -p "$work/dist" && cp "$DIST"/*.whl "$DIST"/*.tar.gz "$work/dist/"
else
  bash .ci/package_check.sh --build-only "$work/dist"
fi
ls "$work/dist"
"$PYTHON" -m venv "$work/venv"
# the versions of the lock (constraints.txt), as `make test` installs them
export PIP_CONSTRAINT="$(pwd)/constraints.txt"
"$work/venv/bin/python" -m pip install --quiet --upgrade pip
# the CPU build of torch from the local wheel index; other torch requests may pull CUDA
"$work/venv/bin/python" -m pip install --quiet torch==2.13.0
"$work/venv/bin/python" -m pip install --quiet "$work"/dist/*.whl
if "$work/venv/bin/python" -c "import pyspark" 2>/dev/null; then
  echo "package check: a plain install pulled pyspark (it must stay an extra: spark-torch[spark])"; exit 1
fi
"$work/venv/bin/spark-torch" --version
cd "$work"
"$work/venv/bin/python" - <<'PY'
from spark_torch import Distributor

def rank_sum():
    import os
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="env://")
    t = torch.tensor([float(os.environ["RANK"]) + 1])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()

assert Distributor(num_processes=2, log_ranks=[]).run(rank_sum) == 3.0
try:
    Distributor(num_processes=2, local_mode=False).run(rank_sum)
except ImportError as exc:
    assert "spark-torch[spark]" in str(exc), exc
else:
    raise AssertionError("distributed mode without pyspark did not say what to install")
print("package check: wheel installs without pyspark; local mode runs; distributed mode asks for spark-torch[spark]")
PY
# the wheel beside PySpark 4.x: the [spark] extra, and a distributed run from the installed wheel
"$work/venv/bin/python" -m pip install --quiet "$(ls "$work"/dist/*.whl)[spark]"
SPARK_LOCAL_IP=127.0.0.1 "$work/venv/bin/python" - <<'PY'
import pyspark
import spark_torch
from spark_torch import Distributor

assert pyspark.__version__.startswith("4."), pyspark.__version__
assert "site-packages" in spark_torch.__file__, spark_torch.__file__

def world() -> int:
    import os
    return int(os.environ["WORLD_SIZE"])

assert Distributor(num_processes=2, local_mode=False, log_ranks=[]).run(world) == 2
print(f"package check: the wheel runs distributed beside pyspark {pyspark.__version__}")
PY
