# One image, two entry points: `specdec-verifier` (default) and `specdec` (the client).
#   docker build -t specdec .                              # CPU
#   docker build -t specdec:cuda --build-arg TORCH_VARIANT=cu126 .   # CUDA 12.6 wheels
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ARG TORCH_VARIANT=cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the PyTorch wheel index of the chosen variant, so no other build is pulled.
RUN pip install "torch==2.13.0" --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY drafter_client ./drafter_client
COPY verifier_service ./verifier_service
RUN pip install .

FROM python:${PYTHON_VERSION}-slim AS runtime
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
