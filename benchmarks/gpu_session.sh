#!/usr/bin/env bash
# The GPU runs of one device call, each under its own time limit, so that a step that hangs or
# fails costs only its own share. Every step's JSON lands in $RESULTS and its log in
# $RESULTS/logs; after each step all of it is packed into $OUT/gpu_results.tar.gz, so what a
# call measured comes back even if a later step is cut off.
#   JSPEC_COMMIT=<hash> bash benchmarks/gpu_session.sh STEP...     (steps: see `case` below)
# Wheels the image lacks travel in .whl (scripts/fetch_device_wheels.sh fetches them here).
set -uo pipefail
cd "$(dirname "$0")/.."
# The device machine's copy of .git is not this checkout's: results name the commit given here.
: "${JSPEC_COMMIT:?set JSPEC_COMMIT to this checkout s HEAD: the device copy of .git is stale}"
export JSPEC_COMMIT
OUT=${OUT:-/tmp/gpu_out}
RESULTS=${RESULTS:-/tmp/gpu_results}
PY=${PY:-python3}
mkdir -p "$OUT" "$RESULTS/logs"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && [ -z "${JSPEC_WHEELS_DONE:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} JSPEC_WHEELS_DONE=1
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
t0=$SECONDS
summary=()
SHAPE_8B="--model-path benchmarks/shapes/llama-3.1-8b --load-format dummy"
SHAPE_SMALL="--model-path benchmarks/shapes/smollm2-135m --load-format dummy"

# A random EAGLE-3 head for the 8B shape (nothing accepted: speculation's cost) in $head.
head=/tmp/jspec-heads/8b-eagle3
make_8b_head() {
  $PY -c "import jspec; from jspec.testing.eagle_tiny import make_tiny_draft
make_tiny_draft('$head', jspec.ModelConfig.from_pretrained('benchmarks/shapes/llama-3.1-8b'), 'EAGLE3', dtype='bfloat16')"
}

step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  local s=$SECONDS
  echo "=== [$((SECONDS - t0)) s] $name (limit $limit s): $*"
  timeout --kill-after=10 "$limit" "$@" >"$RESULTS/logs/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$RESULTS/logs/$name.log"
  summary+=("$(printf '%-22s rc=%-3s %4d s' "$name" "$rc" $((SECONDS - s)))")
  tar -C "$RESULTS" -czf "$OUT/gpu_results.tar.gz.part" . && mv "$OUT/gpu_results.tar.gz.part" "$OUT/gpu_results.tar.gz"
}

small_curve() {  # small_curve STEP NAME [SERVING_CURVE_ARGS...]: the SmolLM2 server at c 1 and 64,
  # 8 prompts per unit of concurrency (a c64 run of 128 lasts 2 s), into serving_curve's NAME.json
  local name=$1 result=$2
  shift 2
  step "$name" ${SMALL_LIMIT:-240} $PY -m benchmarks.serving_curve --server-args "$SHAPE_SMALL" --input-lens 128 \
    --concurrency 1,64 --prompts-per-c 8 --min-prompts 8 "$@" --out "$RESULTS" --name "$result"
}

for s in "$@"; do
  case $s in
    # KERNEL_TESTS: the files to run (default tests/kernels whole, ~270 s compiled on an H100);
    # the counts go to gpu_tests_kernels.json.
    kernel_tests) step kernel_tests ${KERNEL_TESTS_LIMIT:-300} $PY -m benchmarks.gpu_tests --kernels-only \
      ${KERNEL_TESTS:+--tests $KERNEL_TESTS} --limit-s $(( ${KERNEL_TESTS_LIMIT:-300} - 20 )) \
      --name gpu_tests_kernels --out "$RESULTS" ;;
    gpu_tests) step gpu_tests 300 $PY -m benchmarks.gpu_tests --limit-s 255 --out "$RESULTS" ;;
    gpu_tests_engine) step gpu_tests_engine ${ENGINE_TESTS_LIMIT:-540} $PY -m benchmarks.gpu_tests --engine-only \
      ${ENGINE_SHARD:+--shard $ENGINE_SHARD} --limit-s $(( ${ENGINE_TESTS_LIMIT:-540} - 20 )) \
      --name gpu_tests_engine${ENGINE_SHARD:+_$(echo $ENGINE_SHARD | tr / of)} --out "$RESULTS" ;;
    fp8) step fp8 ${FP8_LIMIT:-360} $PY -m benchmarks.bench_fp8 --batches ${FP8_BATCHES:-1,16,64} --out "$RESULTS" ;;
    # Each 8B projection alone at one row, FP8: XLA's dot and both GEMVs over their tiles.
    fp8_gemv) step fp8_gemv 240 $PY -m benchmarks.bench_fp8 --gemv --shapes llama-3.1-8b --out "$RESULTS" ;;
    fp8_quality)
      # FP8 quality on the demo SmolLM2's real weights (after `carry_demo_model.sh assemble`).
      step fp8_quality 300 $PY -m benchmarks.fp8_quality --out "$RESULTS" ;;
    kernels) step kernels 120 $PY -m benchmarks.bench_kernels --quick --out "$RESULTS" ;;
    kernels_mgpu) step kernels_mgpu 300 $PY -m benchmarks.bench_kernels_mgpu --out "$RESULTS" ;;
    gemv)
      # Each 8B projection's GEMV four ways (XLA [K, N] and [N, K], the Triton-backend and Mosaic GPU
      # skinny matmuls), then the whole decode step with every projection on the Mosaic one.
      step gemv 240 $PY -m benchmarks.bench_decode --parts --quick --no-stacked --batches 1,16 --tag gemv --out "$RESULTS"
      JSPEC_SKINNY_MATMUL=mosaic step decode_mosaic_gemv 150 $PY -m benchmarks.bench_decode --quick --no-stacked \
        --batches 1,16 --tag mosaic_gemv --out "$RESULTS" ;;
    gemv_small)
      # The SmolLM2 shape's projections, which XLA emits as reduction fusions at one row: its
      # GEMV table, then the profiled step with XLA's dots and each skinny matmul.
      step gemv_small 120 $PY -m benchmarks.bench_decode --small --parts --quick --no-stacked --batches 1 \
        --tag small_gemv --out "$RESULTS"
      for v in xla pallas mosaic; do
        JSPEC_SKINNY_MATMUL=$v step decode_small_gemv_$v 90 $PY -m benchmarks.bench_decode --small --quick \
          --no-stacked --batches 1 --profile --verify-tokens 0 --tag small_gemv_$v --out "$RESULTS"
      done
      # XLA's dots without its rewrite of small ones into reductions (they go to its GEMM path).
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_dot_strength_reduction=false" step decode_small_gemv_no_reduce 90 \
        $PY -m benchmarks.bench_decode --small --quick --no-stacked --batches 1 --profile --verify-tokens 0 \
        --tag small_gemv_no_reduce --out "$RESULTS" ;;
    mixed_step) step mixed_step 240 $PY -m benchmarks.bench_mixed_step --profile --out "$RESULTS" ;;
    mla) step mla ${MLA_LIMIT:-180} $PY -m benchmarks.bench_mla --out "$RESULTS" ;;
    nextn) step nextn 200 $PY -m benchmarks.bench_nextn --layers 4 --out "$RESULTS" ;;
    dflash_cost) step dflash_cost 150 $PY -m benchmarks.bench_dflash --draft-layers 5 --out "$RESULTS" ;;
    # The SmolLM2 shape (the served drafter's: 2 layers), each block's B=1 step traced: where a
    # block of 16 costs more than one of 8 on a launch-bound model.
    dflash_cost_small)
      # DFLASH_SMALL_VARIANTS: JSPEC_SKINNY_MATMUL settings, each its own run (auto's file untagged).
      for v in ${DFLASH_SMALL_VARIANTS:-auto}; do
        tag=(); [ $v = auto ] || tag=(--tag $v)
        JSPEC_SKINNY_MATMUL=$v step dflash_cost_small_$v 200 $PY -m benchmarks.bench_dflash --small --draft-layers 2 \
          --batch 16 --profile "${tag[@]}" --out "$RESULTS"
      done ;;
    # DFLASH on real weights, one call each on a warm machine after `carry_demo_model.sh assemble`
    # (the demo SmolLM2 here; .demo_stash survives between calls): the retrained EAGLE-3 head and
    # its answers, the DFlash drafter on the same answers (<empty_output>, id 16, a special token
    # no chat answer holds, is the block's mask), then each method on the same held-out prompts.
    eagle_smollm2)
      step eagle_smollm2 590 $PY scripts/train_eagle.py --out .demo_stash/eagle3-smol \
        --save-examples .demo_stash/answers.npz --sampled-answers 7 --max-new-tokens 192 --steps ${EAGLE_STEPS:-6000} \
        --batch-size 32 --max-running-requests 256 --eval-spec-prompts 16 --results "$RESULTS/train_eagle3_smollm2.json" ;;
    dflash_smollm2)
      # eagle_smollm2's answers when it ran on this machine, else the same answers generated here;
      # DFLASH_SELF_PROMPTS > 0: the target writes that many more prompts and answers them all
      # (DFLASH_SAMPLED sampled answers each besides greedy).
      # The self-prompted answers are kept for a second run on the same machine (other steps or
      # layers), which then skips their generation.
      answers=(--sampled-answers ${DFLASH_SAMPLED:-7})
      self=.demo_stash/answers_self_${DFLASH_SELF_PROMPTS:-0}_${DFLASH_SAMPLED:-7}.npz
      if [ "${DFLASH_SELF_PROMPTS:-0}" -gt 0 ] && [ -f "$self" ]; then
        answers=(--examples "$self")
      elif [ "${DFLASH_SELF_PROMPTS:-0}" -gt 0 ]; then
        answers+=(--self-prompts $DFLASH_SELF_PROMPTS --save-examples "$self")
      elif [ -f .demo_stash/answers.npz ]; then
        answers=(--examples .demo_stash/answers.npz)
      fi
      step dflash_smollm2 ${DFLASH_LIMIT:-590} $PY scripts/train_dflash.py --out .demo_stash/dflash-smol --mask-token-id 16 \
        "${answers[@]}" --max-running-requests 256 --max-new-tokens 192 --seq-len 256 --steps ${DFLASH_STEPS:-4000} \
        --batch-size 32 --block-size 16 --num-draft-layers ${DFLASH_LAYERS:-2} --anchors 16 --results "$RESULTS/train_dflash_smollm2.json" ;;
    spec_real_dflash|spec_real_eagle3|spec_real_ngram)
      case $s in
        spec_real_dflash) alg=(--algorithm DFLASH --draft-model-path .demo_stash/dflash-smol --configs 15/1/16,7/1/8) ;;
        spec_real_eagle3) alg=(--algorithm EAGLE3 --draft-model-path .demo_stash/eagle3-smol --configs 3/1/4,5/4/8) ;;
        spec_real_ngram) alg=(--algorithm NGRAM --configs 7/1/8,7/2/15) ;;
      esac
      step "$s" 590 $PY -m benchmarks.bench_spec_real "${alg[@]}" --batches 1,16,64 --num-prompts 64 \
        --max-new-tokens 128 --name "bench_spec_real_smollm2_${s#spec_real_}" --out "$RESULTS" ;;
    curve_smollm2_spec)
      # The same three through the server (DFLASH with its whole block and with 8), held-out chat
      # prompts, c 1 / 16 / 64.
      demo=$($PY -c "from jspec.checkpoint.demo import demo_model_path; print(demo_model_path())")
      step curve_smollm2_spec 590 $PY -m benchmarks.serving_curve --server-args "--model-path $demo" --prompts heldout \
        --concurrency 1,16,64 --output-len 128 --min-prompts 32 --variant default= \
        --variant "dflash=--speculative-algorithm DFLASH --speculative-draft-model-path .demo_stash/dflash-smol" \
        --variant "dflash8=--speculative-algorithm DFLASH --speculative-draft-model-path .demo_stash/dflash-smol --speculative-num-steps 7 --speculative-eagle-topk 1 --speculative-num-draft-tokens 8" \
        --variant "dflash_adaptive=--speculative-algorithm DFLASH --speculative-draft-model-path .demo_stash/dflash-smol --speculative-adaptive" \
        --variant "eagle3=--speculative-algorithm EAGLE3 --speculative-draft-model-path .demo_stash/eagle3-smol --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4" \
        --variant "ngram=--speculative-algorithm NGRAM" --run-timeout 120 --out "$RESULTS" --name serving_curve_smollm2_spec ;;
    add_norm)
      # The residual add + RMSNorm kernels (Triton-backend, Mosaic GPU) against XLA's ops
      # (JSPEC_ADD_RMS_NORM): the 8B step at bs 1 / 16 and the SmolLM2 shape's at bs 1, each
      # with its kernel profile.
      for v in ${ADD_NORM_VARIANTS:-xla pallas mosaic}; do
        JSPEC_ADD_RMS_NORM=$v step decode_add_norm_$v 150 $PY -m benchmarks.bench_decode --quick --no-stacked \
          --batches ${ADD_NORM_BATCHES:-1,16} --profile --verify-tokens 0 --tag add_norm_$v --out "$RESULTS"
        JSPEC_ADD_RMS_NORM=$v step decode_small_add_norm_$v 90 $PY -m benchmarks.bench_decode --small --quick \
          --no-stacked --batches 1 --profile --verify-tokens 0 --tag small_add_norm_$v --out "$RESULTS"
      done ;;
    out_in)
      # The small projection weights laid out [out, in] (the one-GPU default) against [in, out]
      # (JSPEC_SKINNY_MATMUL=xla, the same products for these widths): the SmolLM2 step at bs 1 / 16
      # with its kernel profile, then the server at c 1 / 64.
      # A 4-token verify forward beside each (a chain of EAGLE-3's default shape).
      for v in ${OUT_IN_VARIANTS:-xla auto}; do
        JSPEC_SKINNY_MATMUL=$v step decode_small_$v 120 $PY -m benchmarks.bench_decode --small --quick \
          --no-stacked --batches 1,16 --profile --verify-tokens 4 --tag small_$v --out "$RESULTS"
      done
      step curve_small_out_in 300 $PY -m benchmarks.serving_curve --server-args "$SHAPE_SMALL" --input-lens 128 \
        --concurrency 1,64 --min-prompts 4 --variant in_out=JSPEC_SKINNY_MATMUL=xla --variant default= \
        --out "$RESULTS" --name serving_curve_small_out_in ;;
    rope_kv)
      # The new tokens' RoPE and K / V write as one kernel (kernels/rope_kv.py) against XLA's four
      # (JSPEC_ROPE_KV): the SmolLM2 step at bs 1 and the 8B step at bs 1 / 16, each profiled
      # (kernel counts), then the SmolLM2 server at c 1 / 64 with each.
      for v in xla pallas; do
        JSPEC_ROPE_KV=$v step decode_small_rope_kv_$v 90 $PY -m benchmarks.bench_decode --small --quick \
          --no-stacked --batches 1 --profile --verify-tokens 0 --tag small_rope_kv_$v --out "$RESULTS"
        JSPEC_ROPE_KV=$v step decode_rope_kv_$v 150 $PY -m benchmarks.bench_decode --quick --no-stacked \
          --batches ${ROPE_KV_BATCHES:-1,16} --profile --verify-tokens 0 --tag rope_kv_$v --out "$RESULTS"
      done
      for v in xla pallas; do
        JSPEC_ROPE_KV=$v small_curve curve_small_rope_kv_$v serving_curve_smollm2_rope_kv_$v
      done ;;
    decode_splits)
      # The decode kernel's split-K count (JSPEC_DECODE_SPLITS): from the shape, against one split
      # (no merge of partials after the kernel), bs 1, both shapes, profiled.
      for v in auto 1; do
        env_splits=(); [ $v = auto ] || env_splits=(JSPEC_DECODE_SPLITS=$v)
        step decode_small_splits_$v 90 env "${env_splits[@]}" $PY -m benchmarks.bench_decode --small --quick --no-stacked \
          --batches 1 --profile --verify-tokens 0 --tag small_splits_$v --out "$RESULTS"
        step decode_splits_$v 150 env "${env_splits[@]}" $PY -m benchmarks.bench_decode --quick --no-stacked \
          --batches 1 --profile --verify-tokens 0 --tag splits_$v --out "$RESULTS"
      done ;;
    launch_cmdbuf)
      # The host's launch of SmolLM2's decode step on each attention backend, with XLA's command
      # buffers (CUDA graphs) on and off: does a Mosaic GPU kernel split the step's graphs?
      for b in pallas mosaic; do
        for flags in on off; do
          XLA_FLAGS="$([ $flags = off ] && echo --xla_gpu_enable_command_buffer=)" step launch_${b}_cmdbuf_$flags 150 \
            $PY -m benchmarks.bench_host_launch --methods none --attention-backend $b --tokens 128 \
            --name bench_host_launch_${b}_cmdbuf_$flags --out "$RESULTS/launch_cmdbuf"
        done
      done ;;
    launch_trace)
      # SmolLM2's loop at bs 1 traced on each attention backend: the host's self time per XLA
      # runtime event in a launch (thunks, command-buffer updates) and the kernels per step.
      for b in pallas mosaic; do
        step launch_trace_$b 150 $PY -m benchmarks.bench_host_launch --methods none --attention-backend $b \
          --tokens 128 --trace --name bench_host_launch_trace_$b --out "$RESULTS"
      done ;;
    call_cost)
      # The host's cost of one kernel call per Pallas backend: N add-and-norms in one program
      # (benchmarks/bench_call_cost.py), 4,096 wide as the 8B's and 576 as SmolLM2's.
      step call_cost 150 $PY -m benchmarks.bench_call_cost --out "$RESULTS"
      step call_cost_small 150 $PY -m benchmarks.bench_call_cost --width 576 --out "$RESULTS/small" ;;
    call_cost_moving)
      # Both chains with an operand at a new address every call, as a step's carry moves
      # between steps: XLA updates its command buffers each launch (a Mosaic call is captured
      # again, a Triton kernel node has its pointers swapped).
      step call_cost_moving 200 $PY -m benchmarks.bench_call_cost --moving --out "$RESULTS"
      step call_cost_decode_moving 200 $PY -m benchmarks.bench_call_cost --kernel paged_decode --moving --out "$RESULTS" ;;
    verify_tiles_small)
      # The SmolLM2 shape's verify (16, 8 and 4 tokens at B=1, 16 at B=16) over the extend
      # kernel's query-block heights and splits (bench_kernels --verify-small).
      step verify_tiles_small 200 $PY -m benchmarks.bench_kernels --verify-small --out "$RESULTS" ;;
    launch_va_remap)
      # XLA's command buffers with their buffers at fixed addresses, so that a launch need not
      # update its graphs: the VMM allocator with VA remapping (an update mode that skips the
      # temporaries' nodes, or the profiled ones), the temporaries in an allocator of their own
      # (one fixed address), an exclusive lock on the GPU (cheaper update bookkeeping).
      # SmolLM2's bs-1 launch and the moving add-and-norm chain under each setting, the
      # generated tokens checked against the default's (VA_VARIANTS: which run).
      remap="--xla_gpu_enable_command_buffer_va_remapping=true --xla_gpu_command_buffer_update_mode"
      declare -A va_allocator=([default]=default [vmm]=vmm [vmm_remap]=vmm [vmm_remap_profiled]=vmm
        [temp_color]=default [exclusive_lock]=default [temp_color_lock]=default)
      declare -A va_flags=([default]="" [vmm]="" [vmm_remap]="$remap=SKIP_TEMP"
        [vmm_remap_profiled]="$remap=SKIP_PROFILED" [temp_color]="--xla_gpu_temp_buffer_use_separate_color=true"
        [exclusive_lock]="--xla_gpu_require_exclusive_lock=true"
        [temp_color_lock]="--xla_gpu_temp_buffer_use_separate_color=true --xla_gpu_require_exclusive_lock=true")
      for v in ${VA_VARIANTS:-default vmm vmm_remap vmm_remap_profiled temp_color exclusive_lock temp_color_lock}; do
        va=(env XLA_PYTHON_CLIENT_ALLOCATOR=${va_allocator[$v]} XLA_FLAGS="${va_flags[$v]}")
        step launch_va_$v 150 "${va[@]}" $PY -m benchmarks.bench_host_launch --methods none --attention-backend pallas \
          --tokens 128 --name bench_host_launch_va_$v --out "$RESULTS"
        step call_cost_va_$v 150 "${va[@]}" $PY -m benchmarks.bench_call_cost --moving --backends xla,pallas \
          --out "$RESULTS/va_$v"
      done
      $PY -m benchmarks.va_remap_table "$RESULTS" ;;
    call_cost_decode)
      # The same fit with the paged decode attention as the chained call (a pool of N layers).
      step call_cost_decode 200 $PY -m benchmarks.bench_call_cost --kernel paged_decode --out "$RESULTS" ;;
    host_launch) step host_launch 180 $PY -m benchmarks.bench_host_launch --tokens 128 --name bench_host_launch_gpu --out "$RESULTS" ;;
    overlap) step overlap 140 $PY -m benchmarks.bench_overlap --batches 1 --out "$RESULTS" --name bench_overlap_bs1 ;;
    adaptive_costs)
      step adaptive_costs 240 $PY -m benchmarks.bench_adaptive --costs-only "$RESULTS/adaptive_costs_gpu.json" ;;
    startup_8b)
      step startup_8b 240 $PY -m benchmarks.bench_startup --runs 1 --name bench_startup_8b --out "$RESULTS" \
        --server-args "--model-path benchmarks/shapes/llama-3.1-8b --load-format dummy" ;;
    layer_loop)
      step layer_loop ${LAYER_LOOP_LIMIT:-240} env BENCH_BATCHES=${LAYER_LOOP_BATCHES:-1,16,64} $PY -m benchmarks.bench_layer_loop \
        --variants ${LAYER_LOOP_VARIANTS:-per_layer,stacked_unrolled,scan} \
        --name bench_layer_loop_bs64 --out "$RESULTS" ;;
    structured) step structured ${STRUCTURED_LIMIT:-480} $PY -m benchmarks.bench_structured --batches 1,16,64 --out "$RESULTS" ;;
    program_memory)
      step program_memory 150 $PY -m benchmarks.program_memory --max-total-tokens 100000 --out "$RESULTS" ;;
    pool_scaling)
      step pool_scaling_small 90 $PY -m benchmarks.program_memory --model-path benchmarks/shapes/smollm2-135m \
        --time-pools ${SMALL_POOLS:-100000,4000000}
      step pool_scaling_8b 120 $PY -m benchmarks.program_memory --time-pools ${POOLS_8B:-100000,700000} ;;
    adaptive_memory)
      # Every draft shape's largest decode of an adaptive EAGLE-3 8B server, compiled and run over
      # a full-size pool: which program takes a pool leaf more (benchmarks/NOTES.md).
      make_8b_head
      step adaptive_memory 240 $PY -m benchmarks.program_memory --largest-only --max-total-tokens ${ADAPTIVE_POOL:-250000} \
        --max-running-requests 64 --speculative-args "EAGLE3 $head 3 1 4 adaptive" --name program_memory_adaptive \
        --out "$RESULTS" ;;
    pool_no_reserve)
      # The default 8B servers with the pool the device plan would give without its reserve of
      # one pool leaf (1.5x the planned pool; sizes for an H100, NO_RESERVE_TOKENS on others):
      # if both serve, the reserve can go (benchmarks/NOTES.md, "The KV pool on the GPU").
      make_8b_head
      eagle="--speculative-algorithm EAGLE3 --speculative-draft-model-path $head --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
      # NO_RESERVE_VARIANTS: which servers run (default both). The sizes are the plan's without the
      # reserve on an H100 80GB; on a card of more memory (an H200) they scale with its memory.
      mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
      if [ "${mib:-0}" -gt 100000 ]; then plain_tokens=850000 spec_tokens=800000; else plain_tokens=433000 spec_tokens=408000; fi
      declare -A no_reserve=([plain]="--max-total-tokens ${NO_RESERVE_TOKENS:-$plain_tokens}"
        [adaptive]="$eagle --speculative-adaptive --max-total-tokens ${NO_RESERVE_SPEC_TOKENS:-$spec_tokens}")
      no_reserve_args=()
      for v in ${NO_RESERVE_VARIANTS:-plain adaptive}; do no_reserve_args+=(--variant "$v=${no_reserve[$v]}"); done
      step pool_no_reserve ${NO_RESERVE_LIMIT:-420} $PY -m benchmarks.serving_curve --server-args "$SHAPE_8B" \
        --input-lens 128 --concurrency 64,256 --min-prompts 4 "${no_reserve_args[@]}" \
        --out "$RESULTS" --name serving_pool_no_reserve ;;
    tree_move)
      # The tree verify's KV move updates the target pool in place on the GPU too (no pool-sized copy).
      step tree_move 180 $PY -m benchmarks.gpu_tests --engine-only --limit-s 160 --name gpu_tests_tree_move \
        --tests 'tests/speculative/test_spec_eagle.py::test_iteration_updates_the_target_pool_in_place[4-8]' \
        --out "$RESULTS" ;;
    memory_flags)
      # Which XLA flags keep a large pool's programs free of a pool-sized temporary: each variant
      # compiles the largest programs over a pool of $FLAG_POOL tokens; the first clean one is kept
      # in $RESULTS/xla_flags for the steps after.
      : >"$RESULTS/xla_flags"
      for v in "" "--xla_gpu_enable_latency_hiding_scheduler=false" "--xla_gpu_memory_limit_slop_factor=1000" \
               "--xla_gpu_enable_latency_hiding_scheduler=false --xla_gpu_memory_limit_slop_factor=1000"; do
        name=memflags_$(echo "${v:-default}" | tr -c 'a-z0-9' _ | cut -c1-60)
        XLA_FLAGS="$v" step "$name" 90 $PY -m benchmarks.program_memory --largest-only \
          --max-total-tokens ${FLAG_POOL:-300000} --name "$name" --out "$RESULTS"
        if grep -q "run: ok" "$RESULTS/logs/$name.log" && ! awk '/temp GiB/{f=1;next} f&&NF>=5&&$(NF-3)+$(NF-2)>1.0{bad=1} END{exit !bad}' "$RESULTS/logs/$name.log"; then
          echo "clean: '$v'"; echo "$v" >"$RESULTS/xla_flags"; break
        fi
      done ;;
    curve_8b_quick)
      step curve_8b_quick 150 $PY -m benchmarks.serving_curve --server-args "$SHAPE_8B" --input-lens 128 \
        --concurrency 1,64 --min-prompts 4 --output-len 64 --run-timeout 40 --out "$RESULTS" --name curve_8b_quick ;;
    curve_8b)
      XLA_FLAGS="$(cat "$RESULTS/xla_flags" 2>/dev/null)" step curve_8b ${CURVE_LIMIT:-330} $PY -m benchmarks.serving_curve \
        --server-args "$SHAPE_8B" --input-lens 128 ${CURVE_ARGS:-} --out "$RESULTS" --name serving_curve_8b ;;
    first_step_memory)
      # The step as served, then with XLA's command buffers (CUDA graphs) off: a leaf the first
      # step does not take by donation shows as not donated and as a leaf-sized jump in the peak.
      step first_step_memory 120 $PY -m benchmarks.first_step_memory --max-total-tokens ${FIRST_STEP_POOL:-100000} \
        --out "$RESULTS"
      XLA_FLAGS="--xla_gpu_enable_command_buffer=" step first_step_memory_no_command_buffer 120 $PY -m \
        benchmarks.first_step_memory --max-total-tokens ${FIRST_STEP_POOL:-100000} \
        --name first_step_memory_no_command_buffer --out "$RESULTS" ;;
    curve_8b_spec)
      # Speculation while serving: a random EAGLE-3 head (nothing accepted: the method's cost),
      # NGRAM and adaptive EAGLE-3, beside the plain server.
      make_8b_head
      eagle="--speculative-algorithm EAGLE3 --speculative-draft-model-path $head --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
      # SPEC_VARIANTS: which of them run (default all four).
      declare -A spec=([default]="" [eagle3]="$eagle" [ngram]="--speculative-algorithm NGRAM"
        [eagle3_adaptive]="$eagle --speculative-adaptive")
      spec_args=()
      for v in ${SPEC_VARIANTS:-default eagle3 ngram eagle3_adaptive}; do spec_args+=(--variant "$v=${spec[$v]}"); done
      step curve_8b_spec ${SPEC_LIMIT:-590} $PY -m benchmarks.serving_curve --server-args "$SHAPE_8B" --input-lens 128 \
        "${spec_args[@]}" ${CURVE_ARGS:-} --out "$RESULTS" --name serving_curve_8b_spec ;;
    curve_8b_mosaic_norm)
      # The 8B server on the Mosaic attention with its add-and-norm on Mosaic GPU (the default
      # there) and on XLA's fusions: two Mosaic calls fewer a layer against a few microseconds of
      # device time (bench_call_cost's question, served), each a cold start under its own key.
      for v in mosaic xla; do
        JSPEC_ADD_RMS_NORM=$v step curve_8b_mosaic_norm_$v 300 $PY -m benchmarks.serving_curve \
          --server-args "$SHAPE_8B --attention-backend mosaic" --input-lens 128 --concurrency 1,64 \
          --out "$RESULTS" --name serving_curve_8b_mosaic_norm_$v
      done ;;
    curve_8b_mosaic)
      # The engine on the Mosaic GPU kernels beside the Triton ones: the default 8B server's curve
      # with and without --attention-backend mosaic (issue: the default is whichever is faster).
      # Python hides DeprecationWarnings raised outside __main__, so a plain server's log never
      # shows the Triton backend's; the servers here show them, to count which programs use it.
      PYTHONWARNINGS=default::DeprecationWarning step curve_8b_mosaic ${MOSAIC_LIMIT:-590} $PY -m benchmarks.serving_curve --server-args "$SHAPE_8B" --input-lens 128 \
        --concurrency ${MOSAIC_C:-1,16,64} --variant default= --variant "mosaic=--attention-backend mosaic" \
        --out "$RESULTS" --name serving_curve_8b_mosaic
      # The Triton backend's deprecation warning, counted in each server's log (none expected
      # under the Mosaic attention: its add-and-norm is Mosaic GPU's too, RoPE XLA's).
      for v in default mosaic; do
        echo "$v server log: $(grep -c "Pallas Triton backend is deprecated" "$RESULTS/serving_curve_8b_mosaic_$v.log" 2>/dev/null) deprecation warnings"
        grep -h -m1 "layer kernels" "$RESULTS/serving_curve_8b_mosaic_$v.log"
      done ;;
    curve_small_variants|curve_8b_variants)
      # Host-side variants of the default server, side by side (names in $HOST_VARIANTS): the
      # engine loop on a thread of the HTTP process (the old layout); the layers unrolled over
      # their stacked weights (one launch argument per weight kind); smaller prefill chunks (a
      # step that also decodes costs less above a decode step: ITL p99); mixed steps without the
      # default bound on their cost, or with a looser one; streams sent four tokens a chunk; the
      # command buffers' allocations at fixed addresses (launch_va_remap, served).
      shape=$SHAPE_SMALL; [ $s = curve_8b_variants ] && shape=$SHAPE_8B
      declare -A flags=([default]="" [in_thread]="--engine-in-thread" \
        [unrolled_stack]="--layer-loop unrolled_stack" [chunk256]="--chunked-prefill-size 256" \
        [unbounded]="--mixed-chunk-slowdown 0" [slowdown1_5]="--mixed-chunk-slowdown 1.5" [slowdown1_75]="--mixed-chunk-slowdown 1.75" [slowdown2]="--mixed-chunk-slowdown 2" [slowdown3]="--mixed-chunk-slowdown 3" \
        [stream4]="--stream-interval 4" \
        [va_remap]="XLA_PYTHON_CLIENT_ALLOCATOR=vmm 'XLA_FLAGS=--xla_gpu_enable_command_buffer_va_remapping=true --xla_gpu_command_buffer_update_mode=SKIP_TEMP'" \
        [temp_color]="XLA_FLAGS=--xla_gpu_temp_buffer_use_separate_color=true" \
        [xla_nk]="JSPEC_SKINNY_MATMUL=xla_nk")
      variant_args=()
      for v in ${HOST_VARIANTS:-default in_thread chunk256}; do
        variant_args+=(--variant "$v=${flags[$v]}")
      done
      step $s ${VARIANTS_LIMIT:-420} $PY -m benchmarks.serving_curve --server-args "$shape" --input-lens 128 \
        --concurrency ${VARIANTS_C:-1,64,256} --min-prompts 4 "${variant_args[@]}" \
        --out "$RESULTS" --name serving_curve_${s#curve_} ;;
    curve_8b_long)
      step curve_8b_long 300 $PY -m benchmarks.serving_curve --server-args "$SHAPE_8B" --input-lens 1024 \
        --out "$RESULTS" --name serving_curve_8b_1024 ;;
    curve_small_add_norm)
      # The SmolLM2 server with XLA's add-and-norm ops, then with the kernel (the GPU default).
      for v in xla pallas; do
        JSPEC_ADD_RMS_NORM=$v small_curve curve_small_add_norm_$v serving_curve_smollm2_add_norm_$v
      done ;;
    hlo_small)
      # The SmolLM2 step's optimized HLO at bs 1, to read which ops each small fusion of its
      # profile holds (the three multiply fusions a layer, the convert).
      step hlo_small 90 $PY -m benchmarks.bench_decode --small --quick --no-stacked --batches 1 --hlo \
        --profile --verify-tokens 0 --tag small_hlo --out "$RESULTS" ;;
    reduce_flags)
      # XLA emits a one-row dot as a multiply and a Triton reduction; for three of the SmolLM2
      # layer's four projections it writes the float32 product to memory between the two (the
      # hlo_small HLO). The step under XLA flags that route reductions elsewhere, both shapes,
      # then the SmolLM2 server with the fastest small step's flags beside the default.
      declare -A rflags=([default]="" [no_block_rewriter]="--xla_gpu_experimental_enable_fusion_block_level_rewriter=false"
        [no_heroless]="--xla_gpu_experimental_enable_triton_heroless_priority_fusion=false"
        [no_triton_fusions]="--xla_gpu_experimental_enable_fusion_block_level_rewriter=false --xla_gpu_experimental_enable_triton_heroless_priority_fusion=false")
      best=default best_ms=1e9
      for v in ${REDUCE_VARIANTS:-default no_block_rewriter no_heroless no_triton_fusions}; do
        XLA_FLAGS="${rflags[$v]}" step reduce_small_$v 90 $PY -m benchmarks.bench_decode --small --quick --no-stacked \
          --batches 1,16 --profile --verify-tokens 0 --tag reduce_small_$v --out "$RESULTS"
        ms=$($PY -c "import json,sys; r=json.load(open(sys.argv[1]))['rows']; print(min(x['step_ms'] for x in r if x['batch']==1))" \
          "$RESULTS/bench_decode_reduce_small_$v.json" 2>/dev/null || echo 1e9)
        awk -v a="$ms" -v b="$best_ms" 'BEGIN{exit !(a<b)}' && best=$v best_ms=$ms
        XLA_FLAGS="${rflags[$v]}" step reduce_8b_$v 120 $PY -m benchmarks.bench_decode --quick --no-stacked \
          --batches 1,16 --verify-tokens 0 --tag reduce_8b_$v --out "$RESULTS"
      done
      echo "fastest SmolLM2 bs 1 step: $best ($best_ms ms)"
      if [ "$best" != default ]; then
        small_curve curve_small_reduce_default serving_curve_smollm2_reduce_default
        XLA_FLAGS="${rflags[$best]}" small_curve curve_small_reduce_$best serving_curve_smollm2_reduce_$best
      fi ;;
    two_rows)
      # The SmolLM2 step at bs 1, 2 and 4 (at 16 rows XLA's GEMM path runs the projections in
      # ~13 us a layer against ~20 us for the one-row multiply-and-reduce), then bs 1 with each
      # one-row projection padded to two rows (JSPEC_SKINNY_MATMUL=xla_padded), both shapes; then
      # the SmolLM2 server both ways.
      step rows_small 90 $PY -m benchmarks.bench_decode --small --quick --no-stacked --batches 1,2,4 --profile \
        --verify-tokens 0 --tag rows_small --out "$RESULTS"
      JSPEC_SKINNY_MATMUL=xla_padded step padded_small 90 $PY -m benchmarks.bench_decode --small --quick --no-stacked \
        --batches 1 --profile --verify-tokens 0 --tag padded_small --out "$RESULTS"
      for v in xla xla_padded; do
        JSPEC_SKINNY_MATMUL=$v step rows_8b_$v 120 $PY -m benchmarks.bench_decode --quick --no-stacked \
          --batches 1 --verify-tokens 0 --tag rows_8b_$v --out "$RESULTS"
      done
      for v in xla xla_padded; do
        JSPEC_SKINNY_MATMUL=$v small_curve curve_small_$v serving_curve_smollm2_skinny_$v
      done ;;
    served_rope_kv)
      # The SmolLM2 pair of served_switches alone: the RoPE and K / V write kernel, then XLA's ops.
      for v in pallas xla; do
        JSPEC_ROPE_KV=$v small_curve curve_small_rope_kv_$v serving_curve_smollm2_rope_kv_$v
      done ;;
    served_switches)
      # Kernel switches served side by side, each variant its own cold start (stored programs are
      # keyed on the JSPEC_ variables): the SmolLM2 server with the RoPE and K / V write kernel,
      # then XLA's ops (the kernel first: a fresh machine's first server starts slowest); the 8B server with XLA's one-row dots, then the default (auto: its large
      # weights' one-row products padded to two rows), at c 1 and 16.
      for v in pallas xla; do
        JSPEC_ROPE_KV=$v small_curve curve_small_rope_kv_$v serving_curve_smollm2_rope_kv_$v
      done
      for v in xla auto; do
        JSPEC_SKINNY_MATMUL=$v step curve_8b_skinny_$v 200 $PY -m benchmarks.serving_curve --server-args "$SHAPE_8B" \
          --input-lens 128 --concurrency 1,16 --min-prompts 8 --output-len 128 --out "$RESULTS" \
          --name serving_curve_8b_skinny_$v
      done
      # Each server's own account of its layers' kernels (engine/build.layer_kernels).
      grep -m1 "layer kernels" "$RESULTS"/serving_curve_*rope_kv_*_default.log "$RESULTS"/serving_curve_8b_skinny_*_default.log ;;
    logit_bias)
      # The penalties' pass with the sparse logit_bias against the penalties alone and a dense
      # per-slot bias, at decode rows and over a verify tree (benchmarks/bench_logit_bias.py).
      step logit_bias 120 $PY -m benchmarks.bench_logit_bias --out "$RESULTS" ;;
    one_row)
      # One-row projections six ways in a chain of SmolLM2's layers without attention, profiled,
      # then the 8B's (benchmarks/bench_one_row.py).
      step one_row_small 150 $PY -m benchmarks.bench_one_row --out "$RESULTS"
      step one_row_8b 150 $PY -m benchmarks.bench_one_row --shape llama-3.1-8b --forms xla,xla_nk,padded,pallas,mosaic \
        --out "$RESULTS/8b" ;;
    curve_small_repeat)
      # The default SmolLM2 server started twice in one call: the mixed step's token budget comes
      # from steps timed at start-up, so two starts should log the same budget and serve alike.
      small_curve curve_small_repeat serving_curve_smollm2_repeat --variant first= --variant second= ;;
    curve_small)
      XLA_FLAGS="$(cat "$RESULTS/xla_flags" 2>/dev/null)" step curve_small ${SMALL_LIMIT:-120} $PY -m benchmarks.serving_curve \
        --server-args "$SHAPE_SMALL" --input-lens 128 --concurrency ${SMALL_C:-1,64} --min-prompts 8 --out "$RESULTS" \
        --name serving_curve_smollm2 ;;
    *) echo "unknown step $s" >&2 ;;
  esac
done
echo
echo "step                   rc    time"
printf '%s\n' "${summary[@]}"
