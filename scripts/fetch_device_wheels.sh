#!/usr/bin/env bash
# The wheels the GPU machine's image lacks (the server's, the grammar engine's, the structured-
# output tests' jsonschema and gguf, which converts the demo model there), downloaded here into
# .whl for a device call to carry; that machine has no network. benchmarks/gpu_session.sh
# installs whatever .whl holds.
#   bash scripts/fetch_device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64)
# The image's python is 3.12; names only, pip picks each one's newest wheel.
packages=(fastapi starlette pydantic pydantic-core annotated-types annotated-doc typing-inspection
  typing-extensions opentelemetry-api importlib-metadata uvicorn "llguidance>=1.9"
  jsonschema jsonschema-specifications referencing rpds-py gguf)
rm -rf .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl "${packages[@]}"
ls .whl
du -sh .whl
