#!/usr/bin/env bash
# The serving benchmark on the GPU machine: serve.py with random weights of the
# SmolLM2-135M and Llama-3.1-8B shapes (benchmarks/shapes/), speculation off and on (EAGLE-3
# with a random head, so acceptance ~1: the figures show the serving path's overheads),
# request rates 1, 4, 16 and inf. Results: $OUT_DIR/bench_serving.json (default benchmarks/results),
# written after every rate, so a run cut short keeps what it measured.
#   [SPECS="none eagle3"] [RATES=1,4,16,inf] bash benchmarks/bench_serving_gpu.sh [small|8b ...]
# Warm-up compiles every (rows, page-table width, sampling mode) program, ~6.5 s each at the 8B
# shape, so the servers here compile only what greedy requests of 256 + 128 tokens meet: context
# 480 (3 page-table widths), 32 rows at most (6 row counts), greedy only.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${OUT_DIR:-benchmarks/results}
PY=${PY:-python}
NUM_PROMPTS=${NUM_PROMPTS:-48}
RATES=${RATES:-1,4,16,inf}
WARMUP=${WARMUP:-64}
SPECS=${SPECS:-none eagle3}
t0=$SECONDS
mkdir -p "$OUT_DIR" /tmp/jspec-heads
for shape in ${@:-small 8b}; do
  dir=benchmarks/shapes/$([ "$shape" = small ] && echo smollm2-135m || echo llama-3.1-8b)
  head=/tmp/jspec-heads/$shape-eagle3
  $PY -c "
import jspec; from jspec.testing.eagle_tiny import make_tiny_draft
cfg = jspec.ModelConfig.from_pretrained('$dir'); make_tiny_draft('$head', cfg, 'EAGLE3', dtype='bfloat16')"
  for spec in $SPECS; do
    flags=()
    [ "$spec" = eagle3 ] && flags=(--speculative-algorithm EAGLE3 --speculative-draft-model-path "$head"
                                   --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4)
    $PY scripts/serve.py --model-path "$dir" --load-format dummy --port 30000 --max-running-requests 32 \
        --context-length 480 --warmup-sampling-modes greedy --log-level warning "${flags[@]}" & pid=$!
    for _ in $(seq 900); do  # serve.py compiles every bucket before it reports healthy
      $PY -c "import urllib.request as u; u.urlopen('http://127.0.0.1:30000/health', timeout=2)" 2>/dev/null && break
      kill -0 $pid 2>/dev/null || { echo "serve.py ($shape $spec) exited before it was healthy" >&2; continue 2; }
      sleep 1
    done
    echo "[$((SECONDS - t0)) s] $shape $spec: healthy" >&2
    $PY -m benchmarks.bench_serving --port 30000 --num-prompts $NUM_PROMPTS --random-input-len 256 --random-output-len 128 \
        --warmup-requests $WARMUP --request-rate $RATES --tag "$shape $spec" --output-file "$OUT_DIR/bench_serving.json"
    kill -TERM $pid; wait $pid
    echo "[$((SECONDS - t0)) s] $shape $spec: done" >&2
  done
done
