# All targets use the project's own virtual environment in .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-fast test-real lint demo bench bench-drafters fetch-models clean \
	ensure-nginx

install: $(STAMP)

# torch==2.13.0 is the CPU wheel; installing it first keeps pip from pulling a CUDA build.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install "torch==2.13.0"
	$(BIN)/pip install -e ".[dev]"
	touch $(STAMP)

test: install ensure-nginx
	$(BIN)/python -m pytest -q

# The load-balancer test runs the real nginx from Debian's packages; installed here when missing
# and we are root, otherwise that test is skipped.
ensure-nginx:
	@command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing nginx (Debian package) for the load-balancer test"; \
	    apt-get update -qq && (DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light \
	      || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx) >/dev/null \
	      || echo "nginx could not be installed: the load-balancer test will be skipped"; \
	  else echo "nginx missing and not root: the load-balancer test will be skipped"; fi; }

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

bench-drafters: install fetch-models
	$(BIN)/python scripts/bench_drafters.py

clean:
	rm -rf $(VENV) build *.egg-info
