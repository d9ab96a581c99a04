#!/usr/bin/env bash
# The host-time target (host time per iteration below the device time at bs=1): the overlap
# loop's host split (schedule / launch / process, Engine.loop_times) and tokens/s under XLA
# command buffer settings (benchmarks/xla_flag_variants.sh). Without command buffers the host
# launches every kernel of a step itself (~450 for the small model's EAGLE-3 step), which
# is what the launch column measures. One JSON per variant:
# $OUT_DIR/bench_overlap_host_<variant>.json.
#   OUT_DIR=... MODELS=small,8b BATCHES=1 bash benchmarks/bench_overlap_xla_flags.sh [variant ...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT_DIR:-benchmarks/results}
PY=${PY:-python}
source benchmarks/xla_flag_variants.sh
for v in ${@:-default cmdbuf_all cmdbuf_loops}; do
  run_variant "$v" $PY -m benchmarks.bench_overlap \
      --models "${MODELS:-small,8b}" --batches "${BATCHES:-1}" --name "bench_overlap_host_$v" --out "$OUT_DIR" \
      2>&1 | grep -v "^{" | tail -8
done
