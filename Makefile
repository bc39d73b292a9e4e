# Two commands on a fresh machine with Python 3.11 and Java 17:
#   make demo   - create .venv, install, run a 2-rank DDP training on an embedded Spark
#   make test   - create .venv, install, run the whole test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test bootstrap check-java bench clean

check-java:
	@command -v java >/dev/null 2>&1 || { echo "Java not found: install Java 17 (e.g. 'apt-get install openjdk-17-jre-headless') and retry."; exit 1; }

$(VENV)/.installed: pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "$(PYTHON) not found: install Python 3.11 and retry."; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# the CPU build of torch from the local wheel index; other torch requests may pull CUDA
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

bootstrap: check-java $(VENV)/.installed

demo: bootstrap
	SPARK_LOCAL_IP=127.0.0.1 $(PY) examples/ddp_digits.py --num-processes 2

test: bootstrap
	SPARK_LOCAL_IP=127.0.0.1 $(PY) -m pytest $(PYTEST_ARGS)

bench: bootstrap
	SPARK_LOCAL_IP=127.0.0.1 $(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
