#!/usr/bin/env bash
# The end-to-end tests that go through what differs between PySpark versions (.ci/pyspark35-tests.txt)
# once more on PySpark 3.5, then the built wheel beside it, in a venv of their own (.venv35;
# `--install-only` makes that venv and stops).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV35:-.venv35}
LOCK=.ci/constraints-pyspark35.txt  # refreshed by `make lock`
# the dependencies (what --install-only makes: .ci/run installs them beside the main toolchain)
# INSTALLER=uv (as .ci/run sets it): uv's pip interface, which pip installs into the venv first
# (the Makefile's INSTALLER)
deps_install() {
  if [ "${INSTALLER:-pip}" = uv ]; then
    "$VENV/bin/uv" pip install --python "$VENV/bin/python" --compile-bytecode --index-strategy unsafe-best-match "$@"
  else
    "$VENV/bin/python" -m pip install "$@"
  fi
}
if [ ! -f "$VENV/.deps" ] || [ pyproject.toml -nt "$VENV/.deps" ] || [ .ci/requirements-pyspark35.txt -nt "$VENV/.deps" ] || [ "$LOCK" -nt "$VENV/.deps" ]; then
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade --constraint "$LOCK" pip
  if [ "${INSTALLER:-pip}" = uv ]; then "$VENV/bin/python" -m pip install --quiet "${UV_SPEC:-uv==0.13.9}"; fi
  # the CPU build of torch from the local wheel index; other torch requests may pull CUDA
  deps_install --quiet --constraint "$LOCK" torch==2.13.0
  deps_install --quiet --constraint "$LOCK" -r .ci/requirements-pyspark35.txt
  touch "$VENV/.deps"
fi
"$VENV/bin/python" -c "import pyspark; assert pyspark.__version__.startswith('3.5'), pyspark.__version__; print('pyspark', pyspark.__version__)"
[ "${1:-}" = "--install-only" ] && exit 0
# the checkout itself (editable), not beside another install: setuptools writes its egg-info here
if [ ! -f "$VENV/.installed" ] || [ "$VENV/.deps" -nt "$VENV/.installed" ]; then
  "$VENV/bin/python" -m pip install --quiet --constraint "$LOCK" --build-constraint "$LOCK" --no-deps -e .
  touch "$VENV/.installed"
fi
# the tests that go through what differs between PySpark 3.5 and 4.x (.ci/pyspark35-tests.txt says
# which and why), in TEST_WORKERS workers, as `make test` deals them out (default: one process)
mapfile -t selected < <(grep -v '^\s*\(#\|$\)' .ci/pyspark35-tests.txt)
SPARK_LOCAL_IP=127.0.0.1 "$VENV/bin/python" -m pytest -p no:cacheprovider -n "${TEST_WORKERS:-0}" --dist loadscope --no-loadscope-reorder \
  "${selected[@]}" "$@"
# the wheel beside PySpark 3.5: installed over the checkout's editable install, run from outside it
# (WHEEL: one built already, as .ci/run does once for this and the package check)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if [ -n "${WHEEL:-}" ]; then
  cp "$WHEEL" "$work/"
else
  .venv/bin/python -m build --wheel --outdir "$work" . >"$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
fi
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
