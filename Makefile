# Each target creates .venv when missing and installs what it needs: torch 2.13.0 first (a CPU build this
# machine serves from a local file; installing it first stops any dependency from pulling a multi-GB CUDA build),
# then shardwise itself, editable, with the extras the target uses.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION := 2.13.0
MPI4PY_VERSION := 4.1.2
PYTEST_ARGS ?=
# `make test` runs the suite on this many pytest-xdist workers, whole files per worker (--dist loadfile: a file's
# module fixtures are built once). Two fit the 2-core CI machine: the process tests spend much of their time waiting
# on launches and timeouts, which the other worker fills (410 s serial -> 267 s). TEST_WORKERS=0 runs it serially.
# --no-loadscope-reorder keeps tests/conftest.py's file order (the files that start processes first), where xdist's
# own (most tests first) left those long files to the end.
TEST_WORKERS ?= 2

.PHONY: demo test test-gpu gpu-check soak bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.torch: $(BIN)/python
	$(BIN)/pip install --quiet torch==$(TORCH_VERSION)
	touch $@

# The tests draw plots too (the demo's loss.png), so they install the bench extra as well.
$(VENV)/.installed: $(VENV)/.torch pyproject.toml
	$(BIN)/pip install --quiet -e '.[test,bench]'
	touch $@

# The MPI backend is tested like every other one, so `make test` needs Open MPI and mpi4py. Open MPI comes from
# apt-get (as root, or through password-less sudo) when mpirun is missing; mpi4py is pinned into the venv (it has no
# dependencies, so torch is untouched). Two ranks then run an all-reduce: a missing or broken MPI stops here, loudly.
$(VENV)/.mpi: $(BIN)/python
	@if ! command -v mpirun >/dev/null 2>&1; then \
	  echo "mpirun not found: installing Open MPI (openmpi-bin libopenmpi-dev) with apt-get"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; \
	  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; \
	  else echo "error: Open MPI is missing and installing it needs root: run 'apt-get install openmpi-bin libopenmpi-dev' as root, then make test again" >&2; exit 1; fi; \
	  command -v apt-get >/dev/null 2>&1 || { echo "error: Open MPI is missing and there is no apt-get: install Open MPI (mpirun, libmpi) with your package manager" >&2; exit 1; }; \
	  $$SUDO apt-get update && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y openmpi-bin libopenmpi-dev \
	    || { echo "error: apt-get could not install Open MPI (openmpi-bin libopenmpi-dev)" >&2; exit 1; }; \
	fi
	$(BIN)/pip install --quiet mpi4py==$(MPI4PY_VERSION)
	OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --oversubscribe -np 2 $(BIN)/python -c \
	  "from mpi4py import MPI; assert MPI.COMM_WORLD.allreduce(1) == 2, 'MPI all-reduce gave a wrong sum'" \
	  || { echo "error: Open MPI + mpi4py cannot run 2 ranks here (see above)" >&2; exit 1; }
	touch $@

demo: $(VENV)/.installed
	$(BIN)/shardwise demo

# Byte-compiled first: where PYTHONDONTWRITEBYTECODE is set (as on CI), every process the tests start (over a hundred: ranks,
# supervisors, scripts) would otherwise compile shardwise's sources again on import (~0.5 s of CPU each); Python reads
# a cached .pyc all the same and recompiles in memory any file changed since.
test: $(VENV)/.installed $(VENV)/.mpi
	$(BIN)/python -m compileall -q src tests bench examples
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The CUDA paths on a GPU machine (NCCL in a world of one process; skipped with the reason printed elsewhere). Needs a
# CUDA build of torch in the venv: on a GPU machine install it first, e.g. pip install torch==$(TORCH_VERSION).
test-gpu: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m gpu -rs $(PYTEST_ARGS)

# The GPU check for a lent GPU machine (no network: it creates no venv and installs nothing): bench/gpu_check.py with
# the Python given as PYTHON= (default: .venv/bin/python when it exists, else python3), shardwise from src/. Report
# folder: GPU_CHECK_OUT= (default runs/gpu-check-<time>/). Without CUDA it runs the CPU dry run and exits 0.
# From a lent machine that returns a few files only, bring the folder back whole as one archive:
#   make gpu-check PYTHON=python3 GPU_CHECK_OUT=$OUT/g; tar czf $OUT/g.tgz -C $OUT g && rm -rf $OUT/g
GPU_CHECK_PYTHON := $(if $(filter command line environment,$(origin PYTHON)),$(PYTHON),$(if $(wildcard $(BIN)/python),$(BIN)/python,python3))
GPU_CHECK_OUT ?=
gpu-check:
	PYTHONPATH=src $(GPU_CHECK_PYTHON) bench/gpu_check.py $(if $(GPU_CHECK_OUT),--out "$(GPU_CHECK_OUT)")

# Fault injection over many seeds (kill -9, raise, stall of one of 3 gloo ranks: launch must blame that rank).
# SHARDWISE_SOAK_TRIALS sets the trials per fault (default 10).
soak: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m soak $(PYTEST_ARGS)

bench: $(VENV)/.installed
	$(BIN)/python bench/ddp.py

clean:
	rm -rf $(VENV) runs .pytest_cache
