# Two set-up commands: `make demo` and `make test`. Both create .venv if missing and install the pinned set.
#
# Which Python: the newest of 3.13 and 3.12 found here (a pythonX.Y on PATH, or pyenv's when its shim is not
# selected; see .ci/pick-python), else python3. Choose another with `make test PYTHON=python3.11` (any interpreter
# name or path). The lock follows the interpreter: requirements.lock (jax 0.12) on Python >= 3.12,
# requirements-py311.lock (jax 0.10, the last jax for 3.11) on Python 3.11. A venv made by another Python version
# is rebuilt. `VENV=.venv-py311` keeps a second one beside the default.
ifeq ($(origin PYTHON),undefined)
PYTHON := $(shell sh .ci/pick-python)
endif
VENV ?= .venv
PY := $(VENV)/bin/python
PYVER := $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
LOCK := $(if $(filter 3.11,$(PYVER)),requirements-py311.lock,requirements.lock)
STAMP := $(VENV)/.installed-$(PYVER)
# pytest workers (pytest-xdist): most of the suite's time is XLA compiling, one thread per program, so two workers
# on a 2-core host nearly halve it. More only where there are cores and memory for them (each worker holds 8
# simulated devices and its compiles): `make test TEST_JOBS=4`; `TEST_JOBS=0` runs in one process.
TEST_JOBS ?= 2
# The lock (Python >= 3.12) holds the JAX CUDA plugin of the pinned jaxlib and cuDNN, without CUDA's other libraries
# (~1.6 GB; installed --no-deps, the lock being complete, since cuDNN's wheel would pull cuBLAS): XLA:GPU then compiles
# GPU targets deviceless on any host, cuDNN's fused attention included. CUDA=1 adds the CUDA wheels the plugin loads
# to run on an NVIDIA GPU (requirements-cuda.lock, ~3.3 GB more)
CUDA ?= 0
CUDA_STAMP := $(VENV)/.cuda-$(PYVER)
EXTRA_STAMPS := $(if $(filter 1,$(CUDA)),$(CUDA_STAMP))
# the short subset CI runs on the second Python (a few minutes): the version layer, costs, HLO reading, the
# roofline, partitioning, targets, the results store
SMOKE := tests/test_compat.py tests/cost/test_report.py tests/cost/test_hlo.py tests/roofline/test_prediction.py \
         tests/partitioning/test_shard.py tests/partitioning/test_topology.py tests/results/test_store.py \
         tests/hardware/test_catalogue.py tests/hardware/test_v7x.py

.PHONY: demo test smoke test-all lint bench paper clean python

$(STAMP): $(LOCK) pyproject.toml
	@test -n "$(PYVER)" || { echo "make: '$(PYTHON)' does not run here; pass PYTHON=python3.12 (or a path)"; exit 2; }
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' || \
		{ echo "make: $(PYTHON) is Python $(PYVER); the workbench needs 3.11 or newer (3.12+ for jax 0.12)"; exit 2; }
	@if [ -x $(PY) ] && ! $(PY) -c 'import sys; sys.exit("%d.%d" % sys.version_info[:2] != "$(PYVER)")'; then \
		echo "$(VENV) was made by another Python: rebuilding it with $(PYTHON) ($(PYVER))"; rm -rf $(VENV); fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(if $(filter 3.11,$(PYVER)),,--no-deps) -r $(LOCK)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	rm -f $(VENV)/.installed*
	touch $(STAMP)

$(CUDA_STAMP): $(STAMP) requirements-cuda.lock
	@if [ "$(PYVER)" = 3.11 ]; then $(PY) -m pip install -q -e '.[gpu-aot]'; \
		else $(PY) -m pip install -q -r requirements-cuda.lock; fi
	touch $(CUDA_STAMP)

python:
	@echo "$(PYTHON) (Python $(PYVER)) -> $(VENV), $(LOCK)"

demo: $(STAMP) $(EXTRA_STAMPS)
	$(VENV)/bin/workbench demo

test: $(STAMP) $(EXTRA_STAMPS)
	$(PY) -m pytest -n $(TEST_JOBS)

smoke: $(STAMP)
	$(PY) -m pytest -m "not compile_heavy" $(SMOKE)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

paper: $(STAMP)
	$(VENV)/bin/workbench paper build

bench: $(STAMP)
	$(PY) -m benchmarks.prediction_error

clean:
	rm -rf $(VENV) results reports .cache
