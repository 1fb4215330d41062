# All targets use the project's own virtual environment in .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-fast test-real lint demo bench fetch-models clean

install: $(STAMP)

# torch==2.13.0 is the CPU wheel; installing it first keeps pip from pulling a CUDA build.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install "torch==2.13.0"
	$(BIN)/pip install -e ".[dev]"
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow and not real"

test-real: install fetch-models
	$(BIN)/python -m pytest -q -m real

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

fetch-models: install
	$(BIN)/python scripts/fetch_models.py

demo: install fetch-models
	$(BIN)/python scripts/demo.py

bench: install fetch-models
	$(BIN)/python scripts/bench.py

clean:
	rm -rf $(VENV) build *.egg-info
