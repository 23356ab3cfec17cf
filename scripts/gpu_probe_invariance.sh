#!/bin/bash
# Batch invariance on the GPU (docs/batch_invariance.md): model-step probes with the optimised programs dumped
# under $OUT, then the engine test if the one-layer step is invariant.
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda,cpu
python3 -m pip install -q --no-deps .wheels/llguidance-*.whl 2>&1 | tail -1
probe() {  # steps, timeout
  timeout "$2" python3 scripts/probe_invariance.py --no-ops --invariant-only --steps "$1" --dump "$OUT/hlo" 2>&1 \
    | grep -v "^WARNING\|^I0000\|^W0000" | tee -a "$OUT/probe.txt" | tail -6
}
probe "tiny-v4, 1 sliding layer" 150
if grep -q "step: tiny-v4, 1 sliding layer .*same" "$OUT/probe.txt"; then
  probe "tiny-v4;tiny-v41" 200
  timeout 420 python3 -m pytest -q -x tests/test_batch_invariance.py -k "not bad_settings" > "$OUT/engine_test.txt" 2>&1
  grep -v cuda_timer "$OUT/engine_test.txt" | grep "^E \|passed\|failed" | head -20   # the whole log stays in $OUT
fi
