# Two set-up commands: `make demo` and `make test`. Both create .venv if missing and install the pinned set.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-all lint bench paper clean

$(STAMP): requirements.lock pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.lock
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/workbench demo

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check .

paper: $(STAMP)
	$(VENV)/bin/workbench paper build

bench: $(STAMP)
	$(PY) -m benchmarks.prediction_error

clean:
	rm -rf $(VENV) results reports .cache
