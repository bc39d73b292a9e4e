#!/usr/bin/env bash
# The end-to-end suites that go through Spark (distributed, local-cluster, faults, DataFrame,
# CLI, GPUs) once more on PySpark 3.5, then the built wheel beside it, in a venv of their own
# (.venv35; `--install-only` makes that venv and stops). Spark Connect tests skip
# there: pip's pyspark 3.5 ships no Connect server.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV35:-.venv35}
LOCK=.ci/constraints-pyspark35.txt  # refreshed by `make lock`
# the dependencies (what --install-only makes: .ci/run installs them beside the main toolchain)
if [ ! -f "$VENV/.deps" ] || [ pyproject.toml -nt "$VENV/.deps" ] || [ .ci/requirements-pyspark35.txt -nt "$VENV/.deps" ] || [ "$LOCK" -nt "$VENV/.deps" ]; then
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade --constraint "$LOCK" pip
  # the CPU build of torch from the local wheel index; other torch requests may pull CUDA
  "$VENV/bin/python" -m pip install --quiet --constraint "$LOCK" torch==2.13.0
  "$VENV/bin/python" -m pip install --quiet --constraint "$LOCK" -r .ci/requirements-pyspark35.txt
  touch "$VENV/.deps"
fi
"$VENV/bin/python" -c "import pyspark; assert pyspark.__version__.startswith('3.5'), pyspark.__version__; print('pyspark', pyspark.__version__)"
[ "${1:-}" = "--install-only" ] && exit 0
# the checkout itself (editable), not beside another install: setuptools writes its egg-info here
if [ ! -f "$VENV/.installed" ] || [ "$VENV/.deps" -nt "$VENV/.installed" ]; then
  "$VENV/bin/python" -m pip install --quiet --constraint "$LOCK" --build-constraint "$LOCK" --no-deps -e .
  touch "$VENV/.installed"
fi
# the tests of these files that go through Spark (the channel's own tests, local mode and the CLI's
# argument handling do not depend on its version: they are left out by name below), in TEST_WORKERS
# workers, as `make test` deals them out (default: one process)
no_spark="test_version_and_help or test_run_local_passes_script_args_untouched or test_failing_rank_exit_code_and_paragraph"
no_spark="$no_spark or test_bad_input_exit_2 or (test_ctrl_c_stops_every_rank and local) or test_ctrl_c_prints_where_each_rank_was_once"
no_spark="$no_spark or test_very_long_line_split_and_marked or test_line_endings_and_utf8_across_reads"
no_spark="$no_spark or test_client_delivers_in_order_and_drains or test_batches_larger_than_a_frame_are_split"
no_spark="$no_spark or test_full_queue_drops_and_reports or test_rendezvous_through_the_channel"
no_spark="$no_spark or test_rendezvous_stopped_before_every_node_said_hello or test_wrong_secret_rejected"
no_spark="$no_spark or test_client_reconnects_after_connection_drop or test_the_stop_reason_reaches_the_node_and_its_end_comes_back"
SPARK_LOCAL_IP=127.0.0.1 "$VENV/bin/python" -m pytest -p no:cacheprovider -n "${TEST_WORKERS:-0}" --dist loadscope --no-loadscope-reorder \
  tests/test_run_distributed.py tests/test_dataframe.py tests/reliability/test_faults.py \
  tests/reliability/test_channel_e2e.py tests/reliability/test_log_channel.py tests/test_cli.py tests/test_gpu.py \
  tests/test_concurrent_runs.py tests/test_spark_submit.py tests/test_connect.py tests/test_quiet_console.py \
  -k "not doctor and not test_the_command_as_docs_cli_md_says and not ($no_spark)" "$@"
# left out above: doctor's probe is the preflight every distributed run above makes; the CLI's log
# switches (test_the_command_as_docs_cli_md_says: three CLI runs) are the same code on either
# version, and what Spark's console prints on each is checked by the other test_quiet_console tests
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
