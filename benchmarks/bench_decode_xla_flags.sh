#!/usr/bin/env bash
# The bs=1 decode-step target (the step vs its bandwidth floor): the step under XLA command
# buffer settings (CUDA graphs of a step's kernels, which remove per-kernel launch gaps),
# plus the --parts split of the step's time, and the step with its skinny matmuls in Pallas. One JSON per variant:
# $OUT_DIR/bench_decode_<variant>.json.
#   OUT_DIR=... bash benchmarks/bench_decode_xla_flags.sh [variant ...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT_DIR:-benchmarks/results}
PY=${PY:-python}
source benchmarks/xla_flag_variants.sh
for v in ${@:-default no_cmdbuf cmdbuf_all}; do
  extra=()
  [ "$v" = default ] && extra=(--parts)
  run_variant "$v" $PY -m benchmarks.bench_decode --quick --no-stacked --batches 1,32 \
      --contexts 1024 --tag "$v" --out "$OUT_DIR" "${extra[@]}" 2>&1 | grep -v "^{" | tail -20
done
