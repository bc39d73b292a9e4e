#!/usr/bin/env bash
# The end-to-end suites that go through Spark (distributed, local-cluster, faults, DataFrame,
# CLI, GPUs) once more on PySpark 3.5, then the built wheel beside it, in a venv of their own (.venv35). Spark Connect tests skip
# there: pip's pyspark 3.5 ships no Connect server.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV35:-.venv35}
LOCK=.ci/constraints-pyspark35.txt  # refreshed by `make lock`
if [ ! -f "$VENV/.installed" ] || [ pyproject.toml -nt "$VENV/.installed" ] || [ .ci/requirements-pyspark35.txt -nt "$VENV/.installed" ] || [ "$LOCK" -nt "$VENV/.installed" ]; then
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade --constraint "$LOCK" pip
  # the CPU build of torch from the local wheel index; other torch requests may pull CUDA
  "$VENV/bin/python" -m pip install --quiet --constraint "$LOCK" torch==2.13.0
  "$VENV/bin/python" -m pip install --quiet --constraint "$LOCK" -r .ci/requirements-pyspark35.txt
  "$VENV/bin/python" -m pip install --quiet --constraint "$LOCK" --build-constraint "$LOCK" --no-deps -e .
  touch "$VENV/.installed"
fi
"$VENV/bin/python" -c "import pyspark; assert pyspark.__version__.startswith('3.5'), pyspark.__version__; print('pyspark', pyspark.__version__)"
# the suites that go through Spark (the channel's own tests and local mode do not depend on it)
# in TEST_WORKERS workers grouped by Spark session, as `make test` runs them (default: one process)
SPARK_LOCAL_IP=127.0.0.1 "$VENV/bin/python" -m pytest -p no:cacheprovider -n "${TEST_WORKERS:-0}" --dist loadgroup --no-loadscope-reorder \
  tests/test_run_distributed.py tests/test_dataframe.py tests/reliability/test_faults.py \
  tests/reliability/test_channel_e2e.py tests/reliability/test_log_channel.py tests/test_cli.py \
  tests/test_gpu.py tests/test_env_parity.py \
  tests/test_concurrent_runs.py tests/test_spark_submit.py tests/test_connect.py tests/test_quiet_console.py \
  -k "not doctor" "$@"  # doctor's probe is the preflight every distributed run above makes
# the wheel beside PySpark 3.5: installed over the checkout's editable install, run from outside it
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
.venv/bin/python -m build --wheel --outdir "$work" . >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
case "$VENV" in /*) py35="$VENV/bin/python" ;; *) py35="$(pwd)/$VENV/bin/python" ;; esac
"$py35" -m pip install --quiet --no-deps --force-reinstall "$work"/*.whl
(cd "$work" && SPARK_LOCAL_IP=127.0.0.1 "$py35" - <<'PY'
import pyspark
import spark_torch
from spark_torch import Distributor

assert pyspark.__version__.startswith("3.5"), pyspark.__version__
assert "site-packages" in spark_torch.__file__, spark_torch.__file__

def world() -> int:
    import os
    return int(os.environ["WORLD_SIZE"])

assert Distributor(num_processes=2, local_mode=False, log_ranks=[]).run(world) == 2
print(f"pyspark35: the wheel runs distributed beside pyspark {pyspark.__version__}")
PY
)
"$VENV/bin/python" -m pip install --quiet --build-constraint "$LOCK" --no-deps -e .  # back to the checkout for the next run
