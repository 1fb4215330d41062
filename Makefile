# All targets use the project's own virtual environment in .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run

.PHONY: install test test-fast test-asan test-real test-reliability test-compose lint demo bench \
	bench-drafters bench-suite bench-batching bench-network bench-profile fetch-models clean \
	ensure-nginx ensure-nettools ensure-chromium ensure-containers

install: $(STAMP)

# Two steps: what running needs (RUN_STAMP: `make demo`), then what testing adds (STAMP).
# torch==2.13.0 is the CPU wheel; installing it first keeps pip from pulling a CUDA build.
# [llama]: llama-cpp-python, built from source once per machine kind (minutes on 2 cores: the
# longest step of a fresh install) without llama.cpp's AMX kernels, which crash on AMX cloud VMs,
# and without the libraries the engine never loads (scripts/llama_build.py). It builds in the
# background (log: .venv/llama-build.log) while pip installs the rest, which is mostly
# unpacking; `make demo` also fetches its two models meanwhile (FETCH_WHILE_BUILDING). Last,
# the w4a8 engine's kernels (shared/engines/w4a8/kernels.cpp, g++ against PyTorch's headers,
# kept in $SPECDEC_HOME/kernels; a changed source builds again at its first load).
$(RUN_STAMP): pyproject.toml Makefile scripts/llama_build.py shared/machine_cache.py
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	@echo "building llama-cpp-python in the background: $(VENV)/llama-build.log"
	@$(BIN)/python -m scripts.llama_build wheel $(BIN)/python \
	  > $(VENV)/llama-wheel.path 2> $(VENV)/llama-build.log & build=$$!; \
	$(BIN)/pip install "torch==2.13.0" && $(BIN)/pip install -e ".$(RUN_EXTRAS)" \
	  && { [ -z "$(FETCH_WHILE_BUILDING)" ] \
	       || $(BIN)/python -m shared.models.fetch --keep-gguf --no-convert; }; \
	status=$$?; \
	if ! wait $$build; then tail -30 $(VENV)/llama-build.log; \
	  echo "building llama-cpp-python failed: $(VENV)/llama-build.log"; exit 1; fi; \
	exit $$status
	$(BIN)/pip install --no-deps --force-reinstall "$$(cat $(VENV)/llama-wheel.path)"
	$(BIN)/pip install "$$(cat $(VENV)/llama-wheel.path)"  # its dependencies: the [llama] extra
	$(BIN)/python -m shared.engines.w4a8.build  # the w4a8 engine's kernels (g++, seconds)
	touch $(RUN_STAMP)

# The test tools (installed while llama.cpp builds, where the run step is still to do); and the
# oldest supported transformers (the GPU machine's) beside the venv for
# tests/test_min_transformers.py, with huggingface-hub < 2, which it needs.
$(STAMP): RUN_EXTRAS = [dev]
$(STAMP): $(RUN_STAMP)
	$(BIN)/pip install -e ".[dev,llama]"
	$(BIN)/pip install --no-deps --upgrade --target $(VENV)/transformers-min \
	  "transformers==5.17.0" "huggingface-hub==1.33.0"
	touch $(STAMP)

# Every core: pytest-xdist workers, each test handed to whichever worker is free. Bytecode is
# written even where PYTHONDONTWRITEBYTECODE is set: without it every worker and every verifier
# or client process a test starts compiles the project (and pytest rewrites the asserts of its
# plugins' modules) again - 2 of the suite's 17 CPU minutes on a 2-core machine. Next to the
# sources (__pycache__), not under a PYTHONPYCACHEPREFIX: a prefix also hides the bytecode pip
# compiled at install, so on a fresh clone the first processes compiled torch and transformers
# again (6.5 s of CPU for one verifier's imports).
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -n auto --dist worksteal

test: install ensure-nginx ensure-nettools ensure-chromium
	$(PYTEST)

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

# The network tests put client and verifier in two namespaces (iproute2) and drop packets with
# tc netem, or nftables where the kernel has no netem; installed here when missing and root.
ensure-nettools:
	@command -v nft >/dev/null 2>&1 && command -v ip >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing iproute2 and nftables (Debian packages) for the network tests"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      iproute2 nftables >/dev/null \
	      || echo "iproute2/nftables could not be installed: the network tests will be skipped"; \
	  else echo "ip/nft missing and not root: the network tests will be skipped"; fi; }

# The playground page's tests drive Debian's chromium with Playwright (its own browser download
# cannot be reached from every machine); installed here when missing and we are root.
ensure-chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing chromium (Debian package) for the playground page's browser tests"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      chromium >/dev/null \
	      || echo "chromium could not be installed: the browser tests will be skipped"; \
	  else echo "chromium missing and not root: the browser tests will be skipped"; fi; }

test-fast: install
	$(PYTEST) -m "not slow and not real and not faults and not fuzz and not netns and not compose"

# The real docker-compose.yml end to end with Podman + docker-compose 1.29 (minutes; not in
# `make test`): builds the image (llama.cpp in a cached stage) on a debootstrapped Debian base,
# compose up on a tiny Q4_K_M pair on the image's llama.cpp engine (models -> verifier healthy ->
# client output equal to this host's verifier, the OpenAI gateway), then the scale profile with
# 2 replicas behind nginx (session affinity, a replica stopped mid-generation), the gpu
# profile's build arguments, then tears it all down. See docs/deploy.md.
test-compose: install ensure-containers
	$(BIN)/python -m pytest -q -s -m compose -p no:xdist tests/test_compose_e2e.py

# Debian's podman (+ runc), docker-compose 1.29 and debootstrap; installed when root.
ensure-containers:
	@for tool in podman runc docker-compose debootstrap; do command -v $$tool >/dev/null 2>&1 \
	  || missing="$$missing $$tool"; done; [ -z "$$missing" ] || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing podman runc docker-compose debootstrap (Debian packages)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc \
	      docker-compose debootstrap >/dev/null \
	      || echo "could not install them: the compose test will be skipped"; \
	  else echo "missing:$$missing (not root): the compose test will be skipped"; fi; }

# Faults, fuzzing, load and the network namespaces alone (all are part of `make test`).
test-reliability: install ensure-nettools
	$(PYTEST) -m "faults or fuzz or load or netns"

# The w4a8 kernels built with AddressSanitizer, UBSan and the C++ library's bounds assertions
# (SPECDEC_W4A8_SANITIZE: a key of their own, built in a fresh SPECDEC_HOME), and the kernel
# and loader tests run on them. Not in `make test`: the build takes minutes.
ASAN_TESTS = tests/test_w4a8_engine.py tests/test_w4a8_digest.py tests/test_w4a8_headers.py \
  tests/test_w4a8_fuzz.py tests/test_w4a8_kernel_library.py tests/test_w4a8_sanitized.py
test-asan: install
	@home=$$(mktemp -d) && export SPECDEC_HOME=$$home SPECDEC_W4A8_SANITIZE=1 \
	  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
	  LD_PRELOAD="$$($${CXX:-g++} -print-file-name=libasan.so) $$($${CXX:-g++} -print-file-name=libubsan.so)" && \
	  $(BIN)/python -m shared.engines.w4a8.build && \
	  $(BIN)/python -m pytest -q -p no:xdist -m 'not real' $(ASAN_TESTS); \
	  status=$$?; rm -rf $$home; exit $$status

test-real: install fetch-models
	$(BIN)/python -m pytest -q -m real

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

fetch-models: install
	$(BIN)/python -m shared.models.fetch

# scripts/demo.py fetches the two models it runs (once; then "ready"): on llama.cpp their GGUF
# files and tokenizers only. A fresh install fetches them while llama.cpp builds.
demo: FETCH_WHILE_BUILDING = 1
demo: $(RUN_STAMP)
	$(BIN)/python scripts/demo.py

# Every benchmark is a subcommand of one tool: python -m scripts.bench --help
BENCH := $(BIN)/python -m scripts.bench

# Draft length on chat prompts (code, English), specdec next to HF assisted with the same k.
bench: install fetch-models
	$(BENCH) suite --suites k --k-workloads code-chat english --ks 2 4 6 \
	  --max-new-tokens 128 --out bench_results/bench

# Every drafter on every workload at 0 / 20 / 100 ms of simulated round trip.
bench-drafters: install fetch-models
	$(BENCH) suite --suites rtt --rtts 0 20 100 --no-hf --max-new-tokens 48 \
	  --rtt-workloads code-chat english input-grounded --out bench_results/drafters

bench-suite: install fetch-models
	$(BENCH) suite

bench-batching: install fetch-models
	$(BENCH) batching

bench-network: install fetch-models ensure-nettools
	$(BENCH) network

bench-profile: install fetch-models
	$(BENCH) profile

clean:
	rm -rf $(VENV) build *.egg-info
