# Each target creates .venv when missing and installs what it needs: torch 2.13.0 first (a CPU build this
# machine serves from a local file; installing it first stops any dependency from pulling a multi-GB CUDA build),
# then shardwise itself, editable, with the extras the target uses.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION := 2.13.0
PYTEST_ARGS ?=

.PHONY: demo test bench clean

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

demo: $(VENV)/.installed
	$(BIN)/shardwise demo

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: $(VENV)/.installed
	$(BIN)/python bench/ddp.py

clean:
	rm -rf $(VENV) runs .pytest_cache
