# One image, two entry points: `specdec-verifier` (default) and `specdec` (the client, and the
# OpenAI-compatible `specdec serve`).
#   docker build -t specdec .                                         # CPU
#   docker build -t specdec:cuda --build-arg TORCH_VARIANT=cu126 .    # CUDA 12.6 wheels
# Build arguments:
#   BASE_IMAGE      any Debian-like image with python3 (3.10+), python3-venv and
#                   ca-certificates; default python:3.11-slim. `make test-compose` uses one made
#                   with debootstrap + `podman import` where Docker Hub is out of reach.
#   TORCH_PIP_ARGS  where pip finds torch==2.13.0; default the PyTorch index of TORCH_VARIANT.
#                   Wheels and extra CA certificates placed in deploy/build-extra/ (wheels/,
#                   ca/*.crt) are in the build: e.g. TORCH_PIP_ARGS="--find-links
#                   /tmp/build-extra/wheels" installs a torch wheel from there.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG TORCH_VARIANT=cpu
# empty: the PyTorch index of TORCH_VARIANT (compose passes an empty value when unset)
ARG TORCH_PIP_ARGS=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt
COPY deploy/build-extra /tmp/build-extra
# Certificates a TLS-inspecting proxy needs (deploy/build-extra/ca/*.crt), trusted by pip too.
RUN if ls /tmp/build-extra/ca/*.crt >/dev/null 2>&1; then \
      cp /tmp/build-extra/ca/*.crt /usr/local/share/ca-certificates/ && update-ca-certificates; \
    fi
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
RUN pip install .

FROM ${BASE_IMAGE} AS runtime
RUN useradd --create-home --uid 10001 specdec && mkdir /models && chown specdec /models
COPY --from=build /opt/venv /opt/venv
COPY scripts /app/scripts
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    SPECDEC_HOME=/models \
    SPECDEC_HOST=0.0.0.0 \
    SPECDEC_PORT=8000
WORKDIR /app
USER specdec
EXPOSE 8000
CMD ["specdec-verifier"]
