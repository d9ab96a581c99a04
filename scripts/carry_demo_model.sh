#!/usr/bin/env bash
# Moves the demo model (the 98 MB SmolLM2-135M GGUF, jspec/checkpoint/demo.py) to the GPU machine,
# which has no network and takes at most 64 MiB per call: two consecutive calls on a warm
# machine, each carrying one half (ignored files stay there between calls).
#   here:              bash scripts/carry_demo_model.sh split
#   call 1 (carry .carry/demo.0): bash scripts/carry_demo_model.sh stash
#   call 2 (carry .carry/demo.1 and .whl with gguf; jspec's imports need the wheels installed:
#     python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl and
#     PYTHONPATH=/tmp/site): PY=python3 bash scripts/carry_demo_model.sh assemble
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python}
# Only split and assemble need the path; it comes from jspec, whose imports need the server's
# wheels on the GPU machine, which stash (the first call) does without.
gguf_path() { $PY -c "from jspec.checkpoint.demo import DEMO_GGUF_PATH; print(DEMO_GGUF_PATH)"; }
case "${1:-}" in
  split)
    GGUF=$(gguf_path)
    [ -f "$GGUF" ] || $PY -c "from jspec.checkpoint.demo import fetch_demo_gguf; fetch_demo_gguf()"
    mkdir -p .carry && split -b 55M -d -a 1 "$GGUF" .carry/demo. && ls -l .carry ;;
  stash)  # the first half waits in an ignored folder that is not carried again
    mkdir -p .demo_stash && cp .carry/demo.0 .demo_stash/ && ls -l .demo_stash ;;
  assemble)
    GGUF=$(gguf_path)
    mkdir -p "$(dirname "$GGUF")" && cat .demo_stash/demo.0 .carry/demo.1 > "$GGUF"
    $PY -m jspec.checkpoint.demo ;;  # checks the sha256, then converts
  *) echo "usage: $0 split|stash|assemble" >&2; exit 2 ;;
esac
