#!/bin/bash
# Where a tiny model's GPU compile time goes (docs/perf/compile_time_gpu.md). The tiny V4 serving step (6 layers)
# through scripts/probe_compile.py, several processes at once (16 cores; each time carries some contention):
#   MODE=xla-flags  decode [8, 1] + prefill [1, 32], default and batch-invariant, under autotuning / loop-unrolling /
#                   command-buffer flags (logs $OUT/compile_*.txt)
#   MODE=timers     decode [8, 1] alone with XLA's pass timers, then under ptxas -O0 and cheap-LLVM flags
#   MODE=sinkhorn   decode [8, 1] with 20 mHC Sinkhorn rounds (the model's) and with 1, and the Sinkhorn forms'
#                   compile / run times (8 sites)
#   MODE=fusion     decode [8, 1] and the Sinkhorn forms under the GPU fusion pass's experimental flags
#   MODE=kernel     the Mosaic GPU Sinkhorn kernel's GPU tests, then decode [8, 1] with it and with XLA's form,
#                   default and batch-invariant, and the forms' compile / run times with the kernel among them
#   MODE=serve      scripts/bench_serving.py on a 4-layer real-dimension V4-Flash slice (cold warm-up, prefill, batch-64
#                   decode) once per Sinkhorn form in IMPLS (default "pallas jnp"), one after the other
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_PREALLOCATE=false
cd scripts
DEC="--preset tiny-v4 --layers 6 --batch 8 --prefill 0 --block 16 --weights dense"
run() { timeout "${LIMIT:-300}" python3 probe_compile.py "$@"; }
case "${MODE:?set MODE}" in
  xla-flags)
    declare -A FLAGS=([default]="" [autotune0]="--xla_gpu_autotune_level=0"
      [no_unroll]="--xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_NO_UNROLL"
      [no_cmdbuf]="--xla_gpu_enable_command_buffer="
      [autotune0_no_triton]="--xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false")
    for name in "${!FLAGS[@]}"; do for tile in 0 16; do
      XLA_FLAGS="${FLAGS[$name]}" run --preset tiny-v4 --layers 6 --batch 8 --prefill 32 --block 16 --no-sinkhorn \
        --weights dense --batch-invariant $tile > "$OUT/compile_${name}_tile${tile}.txt" 2>&1 &
    done; done ;;
  timers)
    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=gpu_compiler=1,nvptx_compiler=1,hlo_pass_pipeline=1 \
      XLA_FLAGS=--xla_enable_scoped_logging_timers=true run $DEC --no-sinkhorn > "$OUT/timers_default.txt" 2>&1
    grep "HLO pass: priority-fusion time: [0-9.]* s \|RunHloPasses for\|RunBackend for jit" "$OUT/timers_default.txt"
    XLA_FLAGS=--xla_gpu_disable_gpuasm_optimizations=true run $DEC --no-sinkhorn > "$OUT/timers_ptxas_O0.txt" 2>&1 &
    XLA_FLAGS=--xla_llvm_disable_expensive_passes=true run $DEC --no-sinkhorn > "$OUT/timers_llvm_cheap.txt" 2>&1 & ;;
  sinkhorn)
    run $DEC --no-sinkhorn > "$OUT/sinkhorn_step_iters20.txt" 2>&1 &
    run $DEC --no-sinkhorn --override hc_sinkhorn_iters=1 > "$OUT/sinkhorn_step_iters1.txt" 2>&1 &
    run $DEC --no-sinkhorn --override hc_sinkhorn_iters=1 --batch-invariant 16 > "$OUT/sinkhorn_step_iters1_tile16.txt" 2>&1 &
    run $DEC --layers 1 > "$OUT/sinkhorn_forms.txt" 2>&1 & ;;
  fusion)
    declare -A FLAGS=([default]=""
      [heroless_off]="--xla_gpu_experimental_enable_triton_heroless_priority_fusion=false"
      [heroless_on]="--xla_gpu_experimental_enable_triton_heroless_priority_fusion=true"
      [block_rewriter_off]="--xla_gpu_experimental_enable_fusion_block_level_rewriter=false"
      [tiling_prop_off]="--xla_gpu_experimental_enable_tiling_propagation=false"
      [same_shape_mof_off]="--xla_gpu_experimental_enable_same_shape_multi_output_fusion=false")
    for name in "${!FLAGS[@]}"; do XLA_FLAGS="${FLAGS[$name]}" run $DEC > "$OUT/fusion_$name.txt" 2>&1 & done ;;
  kernel)
    (cd .. && timeout 200 python3 -m pytest -m gpu -q -x tests/test_mhc_kernel_gpu.py 2>&1 | tail -4)
    for impl in jnp pallas; do for tile in 0 16; do
      run $DEC --no-sinkhorn --mhc-impl $impl --batch-invariant $tile > "$OUT/kernel_step_${impl}_tile$tile.txt" 2>&1 &
    done; done
    run $DEC --layers 1 > "$OUT/kernel_forms.txt" 2>&1 & ;;
  serve)
    for impl in ${IMPLS:-pallas jnp}; do
      env -u XLA_PYTHON_CLIENT_PREALLOCATE XLA_PYTHON_CLIENT_MEM_FRACTION=.95 timeout "${LIMIT:-300}" python3 \
        bench_serving.py --preset deepseek-v4-flash --layers 4 --lean-buckets --kv-gib 8 --compile-threads 16 \
        --max-tokens 128 --mhc-impl "$impl" > "$OUT/serve_$impl.txt" 2>&1
      tail -12 "$OUT/serve_$impl.txt"
    done ;;
  *) echo "MODE must be xla-flags, timers, sinkhorn, fusion, kernel or serve" >&2; exit 2 ;;
esac
wait
for f in "$OUT"/*.txt; do echo "== $(basename "$f")"; grep "sinkhorn x8\|bucket\|Error\|Unknown" "$f" | tail -8; done
