#!/usr/bin/env bash
# The wheels a lent GPU machine lacks (it has PyTorch and transformers, Python 3.12, no registry):
# this project's web stack at the versions installed in .venv, for CPython 3.12 on x86_64 Linux,
# into .whl/ (git-ignored; carry it with the device tool's `carry: [".whl"]`). Prints the one
# command to run there: the smoke checks (python -m scripts.bench gpu-smoke, under 2 minutes),
# then the GPU benchmark (and its verifiers) with the wheels on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
PACKAGES="fastapi starlette uvicorn pydantic pydantic_core pydantic-settings python-dotenv orjson
typing_extensions typing-inspection annotated-types httptools gguf opentelemetry-api
prometheus_client annotated-doc"
pins=()
for name in $PACKAGES; do
  version=$($PY -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  pins+=("$name==$version")
done
rm -rf .whl && mkdir -p .whl
$PY -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .whl "${pins[@]}"
size_kib=$(du -sk .whl | cut -f1)
count=$(ls .whl/*.whl | wc -l)
if [ "$size_kib" -gt 65536 ]; then
  echo "gpu_kit: .whl holds ${size_kib} KiB, over the device tool's 64 MiB carry limit" >&2
  exit 1
fi
echo "gpu_kit: ${count} wheels, ${size_kib} KiB in .whl/ (${pins[*]})"
cat <<'RUN'
run on the GPU machine (carry [".whl"]):
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && timeout 150 python3 -m scripts.bench gpu-smoke --device cuda --out $OUT/gpu-smoke.json && python3 -m scripts.bench gpu --device cuda --out $OUT/gpu.json
RUN
