# Two commands on a fresh machine with Python 3.10+ and Java 17+:
#   make demo   - create .venv, install what the demo needs, run a 2-rank DDP training on an embedded Spark
#   make test   - create .venv, install the test toolchain, run the whole test suite
# and
#   make dist   - build the wheel and sdist into dist/ (pip install dist/spark_torch-*.whl on the driver and executors)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# torch: a CPU build unless you ask for another. This workplace's pip takes torch==2.13.0 (CPU)
# from a local file; elsewhere a plain `pip install torch` on Linux pulls a multi-GB CUDA build,
# so on a machine without GPUs use e.g. TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
TORCH_PIP_ARGS := $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),)
JAVA_MIN ?= 17

.PHONY: demo test bootstrap check-java bench dist clean

check-java:
	@command -v java >/dev/null 2>&1 || { echo "Java not found: install Java $(JAVA_MIN) or newer (e.g. 'apt-get install openjdk-17-jre-headless') and retry."; exit 1; }
	@v=$$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\)\(\.[0-9]*\)*.*/\1/p' | head -1); \
	 [ "$$v" = "1" ] && v=8; \
	 [ -n "$$v" ] && [ "$$v" -ge $(JAVA_MIN) ] || { echo "Java $$v found; PySpark 4 needs Java $(JAVA_MIN) or newer (java -version: $$(java -version 2>&1 | head -1)). Install it or put it first on PATH (JAVA_HOME)."; exit 1; }

$(VENV)/bin/python:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "$(PYTHON) not found: install Python 3.10 or newer and retry."; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# the CPU build of torch first: the packages below then take it as it is
	$(PY) -m pip install --quiet $(TORCH_PIP_ARGS) $(TORCH_SPEC)

# the demo: pyspark, pyarrow, pandas and scikit-learn (the [examples] extra)
$(VENV)/.demo: pyproject.toml $(VENV)/bin/python
	$(PY) -m pip install --quiet -e '.[examples]'
	touch $@

# the whole toolchain of the suite (the [test] extra)
$(VENV)/.installed: pyproject.toml $(VENV)/bin/python
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

bootstrap: check-java $(VENV)/.installed

demo: check-java $(VENV)/.demo
	SPARK_LOCAL_IP=127.0.0.1 $(PY) examples/ddp_digits.py --num-processes 2

test: bootstrap
	SPARK_LOCAL_IP=127.0.0.1 $(PY) -m pytest $(PYTEST_ARGS)

bench: bootstrap
	SPARK_LOCAL_IP=127.0.0.1 $(PY) benchmarks/run.py

dist: $(VENV)/bin/python
	$(PY) -m pip install --quiet build
	rm -rf dist
	$(PY) -m build --wheel --sdist --outdir dist .
	@ls dist

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
