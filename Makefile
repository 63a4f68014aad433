# Two entry points, both self-contained on a fresh machine with Python 3.10+:
#   make demo   sets up .venv and runs the main job (the Lightning example, CPU)
#   make test   sets up .venv and runs ruff + the test suite
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]" "$(TORCH)"
	touch $@

.PHONY: demo test bench
demo: $(VENV)/.installed
	$(BIN)/python examples/lightning/train.py

test: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/overhead.py
