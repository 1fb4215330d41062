# One image, two entry points: `specdec-verifier` (default) and `specdec` (the client, and the
# OpenAI-compatible `specdec serve`). Both engines: transformers (torch) and llama.cpp
# (llama-cpp-python built from source by scripts/llama_build.py with `make install`'s flags: no
# AMX, no llamafile kernels, no common / multimodal library), so `--engine auto` runs a GGUF file
# on llama.cpp here as on the host.
#   docker build -t specdec .                                         # CPU
#   docker build -t specdec:cuda --build-arg TORCH_VARIANT=cu126 \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.6.3-devel-ubuntu24.04 \
#     --build-arg LLAMA_CMAKE_ARGS=-DGGML_CUDA=on .                  # CUDA 12.6 (untested)
# llama.cpp is compiled for the build machine's CPU (-march=native): build the image where it
# runs, or pass LLAMA_CMAKE_ARGS=-DGGML_NATIVE=OFF for one that runs on any x86-64 CPU (slower).
# Build arguments:
#   BASE_IMAGE      any Debian or Ubuntu image with python3 3.10+ (python3-venv and libgomp1
#                   are added where missing); default python:3.11-slim. `make test-compose` uses one made
#                   with debootstrap + `podman import` where Docker Hub is out of reach.
#   TORCH_PIP_ARGS  where pip finds torch==2.13.0; default the PyTorch index of TORCH_VARIANT.
#                   Wheels and extra CA certificates placed in deploy/build-extra/ (wheels/,
#                   ca/*.crt) are in the build: e.g. TORCH_PIP_ARGS="--find-links
#                   /tmp/build-extra/wheels" installs a torch wheel from there.
#   LLAMA_CMAKE_ARGS  CMake arguments added to llama.cpp's build (CMAKE_ARGS of
#                   scripts/llama_build.py), e.g. -DGGML_CUDA=on on a CUDA devel base image.
ARG BASE_IMAGE=python:3.11-slim

# What every stage starts from: python3 with venv (added from the distribution where the base has
# none, e.g. NVIDIA's CUDA images) and OpenMP, which llama.cpp's CPU backend runs its threads on.
FROM ${BASE_IMAGE} AS base
RUN if ! python3 -c "import venv, ensurepip" 2>/dev/null || ! ldconfig -p | grep -q libgomp; then \
      apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv ca-certificates libgomp1 && rm -rf /var/lib/apt/lists/*; \
    fi

# pip's settings and the certificates a TLS-inspecting proxy needs (deploy/build-extra/ca/*.crt,
# trusted by pip too), for the stages that download.
FROM base AS trusted
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt
COPY deploy/build-extra /tmp/build-extra
RUN if ls /tmp/build-extra/ca/*.crt >/dev/null 2>&1; then \
      cp /tmp/build-extra/ca/*.crt /usr/local/share/ca-certificates/ && update-ca-certificates; \
    fi

# llama-cpp-python's wheel, in a stage of its own: it depends only on the base image, the build
# tools and scripts/llama_build.py, so a change of the project's code does not rebuild it (the
# longest step: minutes on 2 cores).
FROM trusted AS llama
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      cmake g++ make ninja-build && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/llama-venv
WORKDIR /src
COPY shared/machine_cache.py ./shared/machine_cache.py
COPY scripts/llama_build.py ./scripts/llama_build.py
ARG LLAMA_CMAKE_ARGS=""
RUN touch shared/__init__.py scripts/__init__.py \
    && CMAKE_ARGS="${LLAMA_CMAKE_ARGS}" SPECDEC_HOME=/opt/llama \
       python3 -m scripts.llama_build wheel /opt/llama-venv/bin/python \
    && mkdir /wheels && cp /opt/llama/llama-wheels/*/llama_cpp_python-*.whl /wheels/

FROM trusted AS build
ARG TORCH_VARIANT=cpu
# empty: the PyTorch index of TORCH_VARIANT (compose passes an empty value when unset)
ARG TORCH_PIP_ARGS=""
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from TORCH_PIP_ARGS, so no other build of it is pulled.
RUN pip install "torch==2.13.0" \
      ${TORCH_PIP_ARGS:---index-url https://download.pytorch.org/whl/${TORCH_VARIANT}}
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY drafter_client ./drafter_client
COPY verifier_service ./verifier_service
COPY --from=llama /wheels /wheels
RUN pip install /wheels/llama_cpp_python-*.whl && pip install ".[llama]"
# The w4a8 engine's kernels (the default engine for a Q4_K_M file), built here with every ISA path
# the source has (one library; the CPU picks its path at load) into the venv's
# share/specdec/kernels, owned by root with its manifest (sha256): the runtime stage has no
# compiler and loads only that library.
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      g++ && rm -rf /var/lib/apt/lists/* \
    && cd / && python -m shared.engines.w4a8.build --prebuilt

FROM base AS runtime
# The builds' CA bundle (with deploy/build-extra/ca/*.crt where given): the models service's pip
# downloads through the same proxy as the build.
COPY --from=trusted /etc/ssl/certs/ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
# /models: what specdec-fetch fetched (compose mounts it read-only but for its models service);
# /var/cache/specdec: what the verifier measured (a volume of its own in compose). Compose runs
# every container on a read-only root: nothing else here is written.
RUN useradd --create-home --uid 10001 specdec && mkdir /models /var/cache/specdec \
    && chown specdec /models /var/cache/specdec
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    PYTHONUNBUFFERED=1 \
    SPECDEC_HOME=/models \
    SPECDEC_HOST=0.0.0.0 \
    SPECDEC_PORT=8000
WORKDIR /app
USER specdec
EXPOSE 8000
CMD ["specdec-verifier"]
