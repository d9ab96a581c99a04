# XLA flag variants the *_xla_flags.sh benchmarks compare (sourced, not run). Command buffers
# put a program's kernels into CUDA graphs: one launch for many kernels, which matters for
# the device's launch gaps (bench_decode_xla_flags.sh) and for the host's time per
# iteration, where XLA otherwise launches every kernel from the host thread
# (bench_overlap_xla_flags.sh).
declare -A FLAGS=(
  [default]=""
  [no_cmdbuf]="--xla_gpu_enable_command_buffer="
  [cmdbuf_all]="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION --xla_gpu_graph_min_graph_size=1"
  [cmdbuf_loops]="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"
  [pallas_gemv]=""
)
# Variants that change jspec rather than XLA: the skinny projections through Pallas (jspec/layers/matmul.py).
declare -A SKINNY=([pallas_gemv]=pallas)

# Runs "${@:2}" under variant $1: its XLA flags on top of the caller's, and its jspec switches.
run_variant() {
  local v=$1 flags
  shift
  echo "== $v: XLA_FLAGS=${FLAGS[$v]}" >&2
  # XLA reads a value that does not start with "--" as a file name: no stray space when empty.
  flags="${XLA_FLAGS:-} ${FLAGS[$v]}"; flags="${flags# }"; flags="${flags% }"
  XLA_FLAGS="$flags" JSPEC_SKINNY_MATMUL=${SKINNY[$v]:-xla} "$@"
}
