# Two commands on a fresh machine with Python 3.10+ and Java 17+:
#   make demo   - create .venv, install what the demo needs, run a 2-rank DDP training on an embedded Spark
#   make test   - create .venv, install the test toolchain, run the whole test suite (in 3 workers; TEST_WORKERS=0: one process)
#   make test-fast - the unit tests and a smoke run in each mode (the development loop, minutes)
#   make coverage  - the suite under coverage.py, every process a test starts measured (COVERAGE_ARGS=tests/...)
# and
#   make dist   - build the wheel and sdist into dist/ (pip install dist/spark_torch-*.whl on the driver and executors)
#   make lock   - refresh constraints.txt, the versions `make test`/`make demo` install, from today's releases
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# TEST_WORKERS=N runs the suite in N pytest-xdist workers (default 3; 0: one process): tests/conftest.py
# orders the tests by the Spark session they need and tests/scheduling.py deals them out one at a
# time in that order (each worker switches sessions in the same order); with 3 or more workers the
# last one is a waiting lane (the tests that mostly wait, then the heaviest sessions' files) beside
# the others. A fresh clone on the 2-core machine (2026-12-03, CI's rehearsals): 1,301-1,518 s with 3 workers.
TEST_WORKERS ?= 3
XDIST_ARGS := -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder
# torch: on Linux without an NVIDIA driver (no /proc/driver/nvidia/version), the CPU build from
# PyTorch's CPU index (about 200 MB) instead of PyPI's CUDA build (several GB); with a driver,
# PyPI's CUDA build. Override either way: TORCH_INDEX= (PyPI only) or TORCH_INDEX=<an index URL>.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?= $(if $(wildcard /proc/driver/nvidia/version),,https://download.pytorch.org/whl/cpu)
TORCH_PIP_ARGS := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)
# every package the suite and the demo install comes from this lock (refresh: make lock)
LOCK ?= constraints.txt
LOCK_ARGS := --constraint $(LOCK) --build-constraint $(LOCK)
# what installs the packages: pip (the default), or INSTALLER=uv, uv's pip interface (the same
# lock; it fetches and unpacks in parallel: CI's two venvs in 108 s against pip's 225 s): pip installs uv into the venv
# first. uv reads no pip configuration: give it an index or a wheel folder of your own through its
# own variables (UV_INDEX_URL, UV_FIND_LINKS); like pip, it takes each package's best match from
# every index (TORCH_INDEX's copies of torch's dependencies may be older than the lock's). CI
# installs with uv (.ci/run)
INSTALLER ?= pip
UV_SPEC ?= uv==0.13.9
ifeq ($(INSTALLER),uv)
INSTALL := $(VENV)/bin/uv pip install --python $(PY) --compile-bytecode --index-strategy unsafe-best-match
else ifeq ($(INSTALLER),pip)
INSTALL := $(PY) -m pip install
else
$(error INSTALLER=$(INSTALLER): use pip or uv)
endif
JAVA_MIN ?= 17

.PHONY: demo test test-fast bootstrap check-java bench dist clean lock coverage lint format

check-java:
	@command -v java >/dev/null 2>&1 || { echo "Java not found: install Java $(JAVA_MIN) or newer (e.g. 'apt-get install openjdk-17-jre-headless') and retry."; exit 1; }
	@v=$$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\)\(\.[0-9]*\)*.*/\1/p' | head -1); \
	 [ "$$v" = "1" ] && v=8; \
	 [ -n "$$v" ] && [ "$$v" -ge $(JAVA_MIN) ] || { echo "Java $$v found; PySpark 4 needs Java $(JAVA_MIN) or newer (java -version: $$(java -version 2>&1 | head -1)). Install it or put it first on PATH (JAVA_HOME)."; exit 1; }

$(VENV)/bin/python:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "$(PYTHON) not found: install Python 3.10 or newer and retry."; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade --constraint $(LOCK) pip
	$(if $(filter uv,$(INSTALLER)),$(PY) -m pip install --quiet $(UV_SPEC))
	# torch first (see TORCH_INDEX): the packages below then take it as it is
	$(INSTALL) --quiet $(LOCK_ARGS) $(TORCH_PIP_ARGS) $(TORCH_SPEC)

# the demo: pyspark, pyarrow, pandas and scikit-learn (the [examples] extra)
$(VENV)/.demo: pyproject.toml $(LOCK) $(VENV)/bin/python
	$(INSTALL) --quiet $(LOCK_ARGS) -e '.[examples]'
	touch $@

# the whole toolchain of the suite (the [test] extra)
$(VENV)/.installed: pyproject.toml $(LOCK) $(VENV)/bin/python
	$(INSTALL) --quiet $(LOCK_ARGS) -e '.[test]'
	touch $@

# what the suite builds once per environment (the JVMs' class-data archive, DeepSpeed's CPU op):
# here, beside CI's other install, not in the first test that needs it (tests/prebuild.py)
$(VENV)/.prebuilt: $(VENV)/.installed
	SPARK_LOCAL_IP=127.0.0.1 $(PY) -m tests.prebuild
	touch $@

bootstrap: check-java $(VENV)/.installed $(VENV)/.prebuilt

demo: check-java $(VENV)/.demo
	SPARK_LOCAL_IP=127.0.0.1 $(PY) examples/ddp_digits.py --num-processes 2

test: bootstrap
	SPARK_LOCAL_IP=127.0.0.1 $(PY) -m pytest $(XDIST_ARGS) $(PYTEST_ARGS)

# the development loop: tests/unit and the smoke runs (a success and a failure in local mode and on
# local[2]); mypy keeps its cache in .mypy_cache, so it is quick from the second run on
test-fast: bootstrap
	SPARK_LOCAL_IP=127.0.0.1 $(PY) -m pytest -n 2 --dist loadscope --no-loadscope-reorder -m "unit or smoke" $(PYTEST_ARGS)

# the house's linter and formatter over the package, tests, benchmarks and examples (tests/unit/test_quality.py
# runs the same checks in the suite); `make format` rewrites the files as ruff format would
LINTED := spark_torch tests benchmarks examples
lint: bootstrap
	$(PY) -m ruff check $(LINTED)
	$(PY) -m ruff format --check $(LINTED)

format: bootstrap
	$(PY) -m ruff format $(LINTED)

# the suite under coverage.py (pyproject.toml's [tool.coverage.*]): every Python process a test starts
# is measured; the report lists spark_torch's lines by module (COVERAGE_ARGS: e.g. tests/unit)
COVERAGE_ARGS ?=
COVERAGE_DIR := $(abspath .coverage-data)
coverage: bootstrap
	rm -rf $(COVERAGE_DIR) && mkdir -p $(COVERAGE_DIR)
	export COVERAGE_FILE=$(COVERAGE_DIR)/data; status=0; \
	SPARK_LOCAL_IP=127.0.0.1 $(PY) -m coverage run -m pytest $(PYTEST_ARGS) $(COVERAGE_ARGS) || status=$$?; \
	$(PY) -m coverage combine --quiet $(COVERAGE_DIR) && \
	$(PY) -m coverage report --precision=1 > $(COVERAGE_DIR)/report.txt; \
	tail -1 $(COVERAGE_DIR)/report.txt; echo "coverage by module: $(COVERAGE_DIR)/report.txt"; exit $$status

bench: bootstrap
	SPARK_LOCAL_IP=127.0.0.1 $(PY) benchmarks/run.py
	SPARK_LOCAL_IP=127.0.0.1 $(PY) benchmarks/bench_stall.py

dist: $(VENV)/bin/python
	$(PY) -m pip install --quiet build
	rm -rf dist
	$(PY) -m build --wheel --sdist --outdir dist .
	@ls dist

# resolve the test toolchain again from today's releases into constraints.txt (and the PySpark 3.5
# environment's .ci/constraints-pyspark35.txt), each in a fresh venv with no pip cache
lock:
	TORCH_SPEC='$(TORCH_SPEC)' TORCH_INDEX='$(TORCH_INDEX)' PYTHON=$(PYTHON) bash .ci/lock.sh

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
