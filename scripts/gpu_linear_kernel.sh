#!/bin/bash
# The FP8 linear kernel's first GPU run (pallas_kernels/linear; docs/architecture.md §3): correctness against the
# reference, then the kernel against XLA's autotuned GEMM fusions (time and compile time), then a 4-layer V4-Flash
# slice served with it (warm-up, prefill, decode) next to XLA's linears. Each stage only if the one before passed.
# Run from the repository root on the device machine with $OUT set; LIMIT (s) bounds each serving run.
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_MEM_FRACTION=.95
python3 -m pip install -q --no-deps .wheels/llguidance-*.whl 2>&1 | tail -1
timeout 200 python3 -m pytest -q -m gpu tests/test_linear_kernel_gpu.py -p no:cacheprovider > "$OUT/test.txt" 2>&1
grep "^E \|passed\|failed" "$OUT/test.txt" | head -20
grep -q " passed" "$OUT/test.txt" && ! grep -q " failed" "$OUT/test.txt" || exit 1
timeout 200 python3 scripts/bench_kernels.py linear --tokens 1 16 64 256 8192 --out "$OUT" 2>&1 \
  | grep -v "^W1\|WARNING" | tail -60
cd scripts || exit 1
C="--preset deepseek-v4-flash --layers 4 --lean-buckets --kv-gib 8 --compile-threads 16 --max-tokens 128"
for impl in pallas xla; do
  timeout "${LIMIT:-280}" python3 bench_serving.py $C --linear-impl $impl --out "$OUT/serve_$impl" 2>&1 \
    | grep -v "^W1\|WARNING\|stack_frame" | grep "^|" | tail -3
done
