# raying: the two set-up commands are `make demo` and `make test`; each builds .venv from scratch.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.raying-installed

.PHONY: demo test test-all test-faults bench lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[all,dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/raying demo

test: $(STAMP)
	$(VENV)/bin/ruff check raying tests jobs
	$(PY) -m pytest -q -rs -m "not slow and not hdfs"
	# The live HDFS tests host a JVM in the test process (libhdfs): a process of their own.
	$(PY) -m pytest -q -rs -m "hdfs and not slow"

test-all: $(STAMP)
	$(PY) -m pytest -q

test-faults: $(STAMP)
	$(PY) -m pytest -q tests/faults

bench: $(STAMP)
	$(VENV)/bin/raying bench

lint: $(STAMP)
	$(VENV)/bin/ruff check raying tests jobs
	$(VENV)/bin/mypy raying

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
