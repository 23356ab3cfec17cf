#!/bin/bash
# The next H200 session's runs, one stage per device call (each fits the 600 s limit); run from the repository root
# with $OUT set and the llguidance wheel carried (.wheels). The plan, newest first (items marked done keep what they
# found; the stages themselves follow the plan):
#   00000000000. STAGE=sweep-and-step (any card; SWEEP_S=190), then STAGE=linear-sweep (whole) if the budget
#      allows: the eighth session of 2026-12-07 ran verify-step on an H100 (grouped wo_a test passed -> default on;
#      the two-pass top-n was slower -> lax.top_k back; step 6.69 ms, 63% of the H100 roofline) and then got no
#      machine for its prepared calls (eight refused starts). Left to measure: (1) the greedy step with lax.top_k
#      back (expected ~6.40 ms of kernels on an H100); (2) scripts/probe_linear_f32.py — the fp32 projections
#      (~0.29 ms a step: cuBLAS FFMA GEMMs, a per-step concatenate of five merged weights, weight transposes) as
#      the model runs them against load-time layouts; if a laid-out form wins, store the fp32 projection weights
#      that way at load; (3) the FP8 kernel's sweep at 64 tokens (block sizes, stages, two CTAs per SM, K split;
#      0.53 ms a step at 24-34% of copy) -> per-shape decode rows in pallas_kernels/linear/tuning.py, after
#      tests/test_linear_kernel_gpu.py passes with its two ctas_per_sm=2 cases. Then the MoE glue (below);
#   0000000000. (done, eighth session of 2026-12-07, on an H100: serving_h200.md) STAGE=verify-step (any card first, then an H200 for issue 9's figure): the seventh session of
#      2026-12-07 mapped the decode step's kernels to model code (hlo_kernel_map.py, on an H100: serving_h200.md)
#      and changed three things on the CPU only: wo_a through the FP8 kernel's new grouped form (was a per-step
#      bf16 dequantisation, 0.32 ms of 6.67), the top-5 logprobs as two short top-k passes (XLA's TopK kernel took
#      0.13 ms), the expert layout's searchsorted as one comparison (75 tiny launches). The GPU tests of the
#      grouped kernel and of top_n, then the step's kernel map against the table in serving_h200.md, with the
#      grouped kernel switched on (DINFER_JAX_GROUPED_FP8_KERNEL=1; off by default until its GPU test has passed:
#      if it passes, make it the default in dinfer_jax/models/linear_impl.py and drop the switch). Next after
#      it: the expert kernels' glue (~0.1 ms per MoE layer: the padded [4096, 4224] gather, the combine's strided
#      column gather of the down kernel's fp32 output, the layout) into the kernels' producer and epilogue; the
#      FP8 kernel's scale bytes laid out at load (0.06 ms, 29 launches a step); the split-K fp32 weights stored
#      split (0.11 ms of per-step concatenates and transposes);
#   000000000. (done, seventh session of 2026-12-07, on an H100: serving_h200.md) STAGE=step-kernels (an H200): the sixth session of 2026-12-07 found command buffers buy nothing on
#      the H200 (6.63 / 6.64 ms against 6.46 / 6.94 greedy / sampled) and the batch-64 step device-bound (42-45% of
#      roofline): the per-kernel device time of one decode step, greedy and sampled, to find the ~2.5 ms that are
#      neither experts nor FP8 linears (issue 9's >= 50% needs ~0.6 ms of it); then STAGE=spec-kernels (the
#      speculative step at temperature 1 was 24.1 against 19.5 ms greedy on the H200, though its draws are ~1.3 ms:
#      which kernels make the other ~3 ms);
#   00000000. (done, sixth session of 2026-12-07, on an H200: no gain, serving_h200.md; spec-dispatch 24.1 against
#      19.5 ms greedy; twolevel: tests passed, draw 0.14 ms at 64 rows; the rule at 256 / 384 queries)
#      STAGE=cmdbuf (any card, twice if the budget allows): the fifth session of 2026-12-07 found the V4-Flash
#      slice's batch-64 decode pace host-bound on an H100 (the model program's launch 5.0-6.5 ms of a 7.4-8.9 ms pace,
#      0.8 ms a step waiting for the device) and the sampled step now as fast as greedy (prefix="two_level"): command
#      buffers for the model's loops and conditionals, greedy and sampled; then STAGE=spec-dispatch (the speculative
#      step at temperature 1 was 30.7 against 20.8 ms greedy on an H100, sixth session of 2026-12-06: its verification
#      draws twice over 64 x 5 rows and its drafter over 64 rows per draft, ~10 ms of draws with jnp.cumsum by the
#      draw table of the fifth session of 2026-12-07, ~2 ms with two_level); then STAGE=twolevel on an H200 (the draw's
#      device time there) and the rest of the rule stage's benches at 256 / 384 queries (cut by its time limit);
#   0000000. (done, fifth session of 2026-12-07, on an H100: the model_pooled GPU test 4 passed, kernel rule 64-128
#      queries, gathering forms at 96 / 384, prefill-attention 1.50x over XLA with shared_qk; "auto" keeps XLA for
#      prefill: the serving slice's prefill was not faster through the kernel) STAGE=rule (any card; an H200 for its
#      figures): the model's new rules above 66 queries (fourth session
#      of 2026-12-07, measured on an H100 only: the kernel 59-91% of copy with shared_qk against split_cta's 47-53%;
#      the gathering kernel's shared_qk form for bf16 pools 66% against 50% at 384 queries) — the model-path GPU test
#      with its new 96-query case (never run), both rules at 64-384 queries, and the v41_fp4 gathering forms there
#      (whether v41_fp4 pools should follow); then bench_kernels.py prefill-attention (prefill chunks through the
#      kernel now take shared_qk: their 1.25x over XLA was measured with split_cta) and, if it gained, STAGE=prefill-kernel
#      (whether "auto" should hand prefill chunks to the kernel); then on an H200 STAGE=prefix2 and STAGE=draw (below);
#   000000. (done, fourth session of 2026-12-07, on an H100: attention_h200.md) STAGE=seesaw: exact, the slowest
#      organisation (43 us at 64 queries; two bf16 stages alternate with compute); the GPU regression 102 + 33 passed.
#      Was: (an H200 for issue 9's figure; any card to find out whether it runs): organisation seesaw
#      (FlashMLA's schedule, built on CPU in the third session of 2026-12-07, never run): interpreter, GPU cases, timings;
#      then STAGE=tests and STAGE=rows-kernel as a regression check (split_cta's and shared_qk's output stores became
#      shared helpers the same session, checked only by lowering on CPU);
#   00000. (done, third session of 2026-12-07, on an H100; attention_h200.md / serving_h200.md) L2 prefetch of the KV
#      steps ahead of the stages lost 1-8 points at every distance (removed); organisation split_exchange (the two CTAs
#      of a token as a cluster exchanging partial logits through DSMEM, commit e02c203) was exact but 34-40 us
#      against split_cta's 24 at 64 queries (removed); STAGE=prefix2's byte products won up to 96 rows and became the
#      accelerator default there. On an H200: STAGE=prefix2 again (the crossover is the H100's), then STAGE=draw
#      for the sampled decode pace of the V4-Flash slice with the byte default (7.16 ms with jnp.cumsum, second session);
#   0000. STAGE=prefix2 (any card): the integer limbs' prefix sums as bf16 byte products on tensor cores
#      (prefix="bytes", sampling/_scan.cumsum_u16; built on CPU in the second session of 2026-12-07, after CUPTI
#      showed half of the certified draw's 0.86 ms at batch 64 is one reduce_window): exactness on the GPU, then
#      bench_draw.py with --kernels (the xla and bytes forms by kernel). If bytes wins, make it the accelerator default;
#   000. (done: serving_h200.md and attention_h200.md, second session of 2026-12-07, on an H200) STAGE=prefix —
#      block-product prefix sums exact on the GPU but slower (default back to jnp.cumsum); the draw by kernel
#      (bench_draw.py --kernels): half of its 0.86 ms device time at batch 64 is one reduce_window; STAGE=h200-attn
#      and a variant sweep: 52-57% of copy at 64 queries, shared_qk 71% at 128 (issue 9's 60% still unmet). Next
#      for both, once built on CPU: byte-split bf16 block products for the integer limbs; shared_qk with l_split=2
#      merged inside the kernel;
#   00. (done: serving_h200.md, first session of 2026-12-07) STAGE=draw (any card; eighth session of 2026-12-06): the 233 ms interval was the draw's exact scan (STAGE=stall
#      found no long kernel and no collection; the fallback through binade passes over all 64 rows cut it to 17.9 ms
#      on an H200) — the binade tests on the GPU, bench_draw.py (the compacted fallback, binade_rows), and the
#      sampled and greedy decode pace on one machine (docs/perf/serving_h200.md, eighth session);
#   01. on an H200: tests/test_decode_attention_rows_gpu.py -k model_pooled with the H200 rule (64-row bf16 steps),
#      then the ways left to reach issue 9's 60% (the kernel alone is at 57%; the DSMEM logit exchange does not
#      lower under jax 0.11.2: attention_h200.md, fifth session of 2026-12-06);
#   0. on an H200: STAGE=h200-attn — issue 9's 60% is an H200 figure (split_cta was 48-55% there): the kernel with
#      early release (the model's rule above 8 queries; +5% on the H100) against split_cta, its GPU tests, and the
#      model's attention path at batch 64, 32K context (its "kernel alone" column now uses the model's rule);
#   0b. STAGE=row-gather (any card) — can a kernel fetch gathered rows (one copy per row, or register loads) as fast as XLA's gather?
#      (scripts/probe_row_gather.py; decides how the decode-attention kernel should gather through the page table);
#   1. STAGE=compile-depth (measured on an H100, second session of 2026-12-06: serving_h200.md) — issue 8's "8 layers <= 1.3x 2 layers" measured as the engine compiles (FP8 linear
#      kernel, Triton GEMMs off, decode without autotuning): scripts/bench_compile.py --engine-defaults (any card);
#   2. STAGE=h200-sampler — the sampler's filters alone and the batch-64 V4-Flash 4-layer slice's sampled decode
#      step with and without top-k (issue 8 follow-up; the stage also exercises bench_kernels' saver(echo=True));
#   3. STAGE=topk-model on an H200 (the group top-k against lax.top_k, measured on an H100 so far);
#   4. STAGE=mesh when nvidia-h200-x2 is lent, STAGE=lab4 on nvidia-h200-x4 (issues 10, 14). Stages:
#   STAGE=first   one call for a session that may get only one: the split_cluster GPU tests, their
#                 timing against split_cta at 1, 16 and 64 queries, and the V4.1 engine case with kernel lowerings
#                 reused (greedy tokens = full-forward argmax), and the indexer's top-k: lax.top_k against the
#                 group-maxima selection (scripts/bench_topk.py) — each part with its own time limit;
#   STAGE=engram  issue 13: V4.1 4-layer slice, Engram tables on the device and read from pinned host memory by the
#                 gather kernel, in one call (same machine, same process order), with the CUPTI busy share;
#   STAGE=linear  issue 8: V4-Flash 4-layer slice with the FP8 linear kernel limited to decode calls (<= 64 tokens;
#                 pallas_kernels/linear/tuning.py) — cold warm-up and decode against docs/perf/linear_kernel_h200.md;
#   STAGE=spec    issue 11: one speculative step against one plain step on a real-dimension slice with its drafter,
#                 and the k = 4 step at every decode width (the curve confidence-scheduled verification reads);
#   STAGE=index-engine  issue 9, first thing next session: the indexer's defaults changed to 128-byte TMA boxes and
#                 128-row tiles after its last full GPU test — the whole tests/test_indexer_kernel_gpu.py (engine
#                 cases included) with them;
#   STAGE=tests   the GPU-marked kernel tests as a regression check, and the step's page pools not copied on the GPU;
#   STAGE=attn    issue 9: the decode-attention GPU tests with the model's organisation rule
#                 (pallas_kernels/attention/tuning.py), the kernel's variants at 1-64 queries, and the indexer's
#                 fp32 vs bf16 products and top-k (scripts/bench_indexer.py);
#   STAGE=index   issue 9: the indexer kernel's GPU tests (kernel vs reference, the V4.1 engine with it) and the
#                 indexer benchmark with the kernel columns (scripts/bench_indexer.py);
#   STAGE=steps   the step's page pools not copied on the GPU (tests/test_step_pool_copies.py), then the V4.1-Flash
#                 4-layer slice's decode step at batch 1 and 64 after the one-row pool-write fix;
#   STAGE=prefill issue 9: per-query windows (prefill chunks cost Q·W window products, not Q·(R+Q)) and the gathered
#                 top-k for long chunks: the pool-copy check, the kernel-vs-XLA test with per-query windows, one
#                 prefill chunk's attention per variant (bench_kernels.py prefill-attention), and the V4.1 4-layer
#                 slice's prefill tokens/s and batch-64 decode step;
#   STAGE=prefill-kernel  issue 9: a 4-layer slice (PRESET=deepseek-v4.1-flash, the default, or deepseek-v4-flash)
#                 with Model.attention_impl="pallas" (the decode kernel also attends prefill chunks' gathered rows;
#                 1.25x faster than XLA per chunk in bench_kernels.py prefill-attention) against the default:
#                 prefill tok/s, warm-up, decode (V4.1 runs need --engram-vocab on the 128 GB host);
#   STAGE=warmup  issue 8: the 4-layer V4-Flash slice with this session's defaults (FP8 linear kernel for decode,
#                 Triton kept for V4's decode; pipelined warm-up), then V4.1 twice (its prefill tok/s spread), each a
#                 cold warm-up with the per-program lowering/compile table;
#   STAGE=compile-kinds  issue 8: decode + prefill compile time of one-kind V4-Flash slices (layer 0 sliding, 2 CSA,
#                 3 HCA; probe_compile.py --layer-sets), with and without GEMM autotuning: which kind makes V4's
#                 first programs take ~60 s to compile (V4.1's: ~24 s);
#   STAGE=index-sweep  the indexer kernel's tests without the engine cases, and its tile rows x stages x splits
#                 sweep at V4.1-Flash batch 64, 128K context;
#   STAGE=mesh    issue 10, on nvidia-h200-x2: the two-GPU engines' tokens against one GPU (tests/test_mesh_gpu.py),
#                 then scripts/bench_mesh.py on a V4-Flash slice (LAYERS, default 2): EP2, DP2 and DP2+EP2 against
#                 one GPU, tokens and decode tokens/s;
#   STAGE=lab4    issue 14, on nvidia-h200-x4: the lab layout DP2/CP2/EP4 and DP4/EP4 against one GPU on a
#                 V4.1-Flash slice (LAYERS, default 4) with long prompts (CP prefill): groups, tokens, prefill and
#                 decode tokens/s (scripts/bench_mesh.py);
#   STAGE=v4-untuned  issue 8: decode programs that need no GEMM autotuning (fp32 projections in split-K form, mHC
#                 mixes as elementwise sums): the fp32-projection GPU tests, then the V4-Flash 4-layer slice with
#                 Triton GEMMs and autotuning off for decode, prefill as VARIANT says (triton: the defaults;
#                 cublas: Triton GEMMs off for prefill too), with decode and prefill kernel breakdowns;
#   STAGE=lowering  issue 8: where the Python time of lowering the 4-layer V4-Flash slice's 8 step programs goes
#                 (scripts/probe_lowering.py; the lowerings bound the cold warm-up);
#   STAGE=warmup-threads  issue 8: the 4-layer V4-Flash slice's cold warm-up with 4 and 8 compile threads (16 in
#                 the other rows): lowering (41-45 s in the warm-up) is the critical path and shares the host's 16
#                 cores with the concurrent XLA compiles — does it run faster with fewer of them?
#   STAGE=warmup-reuse  issue 8: kernel lowerings reused across programs (DINFER_JAX_REUSE_KERNEL_LOWERINGS=1,
#                 pallas_kernels/lowering_reuse.py), after the two fixes of 2026-12-05 (second session: the switch
#                 reaches the engine's step; the runner's state is committed so serving finds the warm-up's
#                 compiles): the V4.1 engine case with reuse on (greedy tokens = full-forward argmax), then the
#                 4-layer slice of PRESET (default V4-Flash) cold, reuse on then off (SKIP_TESTS=1: only the runs);
#   STAGE=cluster issue 9: the decode-attention kernel's "split_cluster" organisation (split_cta's two CTAs of a
#                 token as one cluster, Q and KV tiles multicast: half the L2 reads): its GPU tests, then the kernel at 1, 16 and 64
#                 queries against split_cta;
#   STAGE=topk-model  issue 9: the top-k variants (lax.top_k, group 4 / 8, the model's rule) at decode and chunk
#                 shapes, then bench_kernels.py attention at batch 64 and 32K / 128K (the indexer column includes the
#                 model's top-k);
#   STAGE=topk-reuse  issue 9 / 8: the top-k benchmark alone (T s, default 250; long rows unmeasured so far), then
#                 the V4.1 engine case with lowering reuse on (300 s);
#   STAGE=pingpong  issue 9: the decode-attention kernel's "pingpong" organisation (two consumer warpgroups on
#                 alternate KV blocks): its GPU tests, then the kernel variants at 1, 16 and 64 queries;
#   STAGE=v4-autotune  issue 8: the V4-Flash 4-layer slice with GEMM autotuning off (compile time is mostly
#                 autotuning: serving_h200.md, fourth session of 2026-12-04) — warm-up and speed against the default.
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_MEM_FRACTION=.95
python3 -m pip install -q --no-deps .wheels/llguidance-*.whl 2>&1 | tail -1
quiet() { grep -v "^W1\|WARNING\|stack_frame"; }
C="--lean-buckets --kv-gib 8 --compile-threads 16 --max-tokens 128"
case "${STAGE:?set STAGE to sweep-and-step, linear-sweep, verify-step, step-kernels, spec-kernels, rule, twolevel, seesaw, prefix2, prefix, draw, stall, paced, cmdbuf, spec-dispatch, sampler-probe, sampler-async, rows-depth, rows-first, gather-serving, rows-kernel, engram, linear, spec, tests, steps, prefill, prefill-kernel, warmup, compile-kinds, attn, index, index-sweep, index-engine, v4-untuned, lowering, warmup-threads, warmup-reuse, cluster, first, early, h200-attn, row-gather, compile-depth, h200-sampler, sampler, topk-model, topk-reuse, pingpong, mesh, lab4 or v4-autotune}" in
  engram)
    cd scripts && timeout 570 python3 bench_serving.py --preset deepseek-v4.1-flash --layers 4 --engram-vocab 1000000 \
      --engram-tables device host-direct $C --breakdown --out "$OUT/engram" 2>&1 | quiet | grep "^|" ;;
  linear)
    cd scripts && timeout 570 python3 bench_serving.py --preset deepseek-v4-flash --layers 4 $C --linear-impl pallas \
      --out "$OUT/linear" 2>&1 | quiet | grep "^|" ;;
  spec)
    timeout 570 python3 scripts/probe_spec_step.py --preset deepseek-v4-flash --layers 4 --batch 64 --widths 2>&1 \
      | quiet | tail -30 ;;
  tests)
    timeout 380 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sampling_gpu.py tests/test_head_gpu.py \
      tests/test_decode_attention_gpu.py tests/test_mhc_kernel_gpu.py tests/test_linear_kernel_gpu.py \
      tests/test_engram_gather_gpu.py tests/test_indexer_kernel_gpu.py 2>&1 | grep "^E \|passed\|failed" | head -30
    # not gpu-marked: the compiled step must not copy page pools on the GPU either (found on CPU, 2026-12-04)
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_step_pool_copies.py 2>&1 \
      | grep "^E \|passed\|failed" | head -10 ;;
  steps)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_step_pool_copies.py 2>&1 \
      | grep "^E \|passed\|failed" | head -10
    cd scripts && for b in 1 64; do timeout 215 python3 bench_serving.py --preset deepseek-v4.1-flash --layers 4 \
      --engram-vocab 1000000 --batch $b $C --out "$OUT/steps_b$b" 2>&1 | quiet | grep "^|"; done ;;
  prefill)
    timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_step_pool_copies.py 2>&1 \
      | grep "^E \|passed\|failed" | head -10
    timeout 110 python3 -m pytest -q -m gpu -p no:cacheprovider -s tests/test_decode_attention_gpu.py \
      -k model_attend_selected 2>&1 | grep "^E \|passed\|failed\|bound" | head -10
    timeout 140 python3 scripts/bench_kernels.py prefill-attention --out "$OUT/prefill_attn" 2>&1 | quiet \
      | grep "^|\|peak"
    cd scripts && timeout 220 python3 bench_serving.py --preset deepseek-v4.1-flash --layers 4 --engram-vocab 1000000 \
      --batch 64 $C \
      --out "$OUT/serve_b64" 2>&1 | quiet | grep "^|" ;;
  prefill-kernel)   # one call per preset: PRESET=deepseek-v4.1-flash (default) or deepseek-v4-flash
    P=${PRESET:-deepseek-v4.1-flash}; E=""; [ "$P" = deepseek-v4.1-flash ] && E="--engram-vocab 1000000"
    cd scripts && for impl in pallas auto; do timeout 280 python3 bench_serving.py --preset $P --layers 4 $E \
      --batch 64 $C --attention-impl $impl --out "$OUT/${P}_$impl" 2>&1 | quiet | grep "^|"; \
      echo "$P attention_impl=$impl"; done ;;
  warmup)
    cd scripts && timeout 200 python3 bench_serving.py --preset deepseek-v4-flash --layers 4 --batch 64 $C \
      --out "$OUT/v4" 2>&1 | quiet | grep "^|\|^warm-up"
    for i in 1 2; do timeout 180 python3 bench_serving.py --preset deepseek-v4.1-flash --layers 4 --batch 64 \
      --engram-vocab 1000000 $C --out "$OUT/v41_$i" 2>&1 | quiet | grep "^|\|^warm-up"; done ;;
  compile-kinds)
    for flags in "" "--xla_gpu_autotune_level=0"; do XLA_FLAGS="$flags" timeout 280 python3 scripts/probe_compile.py \
      --preset deepseek-v4-flash --layer-sets 0 2 3 --no-sinkhorn 2>&1 | quiet | grep "layers\|bucket"; done ;;
  attn)
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_attention_gpu.py 2>&1 \
      | grep "^E \|passed\|failed" | head -20
    timeout 150 python3 scripts/bench_kernels.py attention-kernel --batches 1 4 8 16 64 --out "$OUT/attn_kernel" \
      2>&1 | quiet | grep "^|\|copy bandwidth"
    timeout 220 python3 scripts/bench_kernels.py indexer --out "$OUT/indexer" 2>&1 | quiet | grep "^|" ;;
  index)
    timeout 290 python3 -m pytest -q -m gpu -p no:cacheprovider -s tests/test_indexer_kernel_gpu.py 2>&1 \
      | grep "^E \|passed\|failed\|max err\|Error" | head -40
    timeout 270 python3 scripts/bench_kernels.py indexer --out "$OUT/indexer" 2>&1 | quiet | grep "^|" ;;
  index-sweep)
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -s tests/test_indexer_kernel_gpu.py -k "not engine" \
      2>&1 | grep "^E \|passed\|failed\|max err\|Error" | head -40
    timeout 200 python3 scripts/bench_kernels.py indexer-sweep --out "$OUT/indexer" 2>&1 | quiet | grep "^|" ;;
  index-engine)
    timeout 560 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_indexer_kernel_gpu.py 2>&1 \
      | grep "^E \|passed\|failed\|Error" | head -30 ;;
  v4-untuned)
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_head_gpu.py 2>&1 \
      | grep "^E \|passed\|failed" | head -10
    D="--decode-compiler-option xla_gpu_enable_triton_gemm=false --decode-compiler-option xla_gpu_autotune_level=0"
    P=""; [ "${VARIANT:-triton}" = cublas ] && P="--compiler-option xla_gpu_enable_triton_gemm=false"
    cd scripts && timeout 440 python3 bench_serving.py --preset deepseek-v4-flash --layers 4 --batch 64 $C $D $P \
      --breakdown --out "$OUT/v4_untuned_${VARIANT:-triton}" 2>&1 | tee "$OUT/v4_untuned.log" | quiet \
      | grep "^|\|^warm-up\|^  \|device time" | head -120 ;;
  lowering)
    timeout 400 python3 scripts/probe_lowering.py --preset deepseek-v4-flash --layers 4 --top 45 2>&1 \
      | tee "$OUT/lowering.log" | quiet | grep -v "^$" | head -120 ;;
  warmup-threads)
    cd scripts && for t in 4 8; do timeout 280 python3 bench_serving.py --preset deepseek-v4-flash --layers 4 \
      --batch 64 --lean-buckets --kv-gib 8 --compile-threads $t --max-tokens 32 --out "$OUT/v4_threads$t" 2>&1 \
      | quiet | grep "^|\|^warm-up"; done ;;
  warmup-reuse)
    # PRESET (default deepseek-v4-flash, fits an H100; deepseek-v4.1-flash needs the H200): reuse on, then off, each
    # a fresh process with a cold compilation cache; the warm-up table's "done at" and the total must both drop
    P=${PRESET:-deepseek-v4-flash}; E=""; [ "$P" = deepseek-v4.1-flash ] && E="--engram-vocab 1000000"
    [ "${SKIP_TESTS:-0}" = 1 ] || DINFER_JAX_REUSE_KERNEL_LOWERINGS=1 timeout 200 python3 -m pytest -q -m gpu \
      -p no:cacheprovider "tests/test_indexer_kernel_gpu.py::test_engine_greedy_with_the_kernel_equals_full_forward_argmax" \
      2>&1 | grep "^E \|passed\|failed" | head -20
    cd scripts && for r in ${REUSE:-1 0}; do DINFER_JAX_REUSE_KERNEL_LOWERINGS=$r timeout ${T:-200} python3 bench_serving.py \
      --preset $P --layers 4 --batch 64 $E $C --out "$OUT/${P}_reuse$r" 2>&1 | quiet \
      | grep "^|\|^warm-up\|Error"; done ;;
  cluster)
    [ "${SKIP_TESTS:-0}" = 1 ] || timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/test_decode_attention_gpu.py -k "cluster" 2>&1 | grep "^E \|passed\|failed\|Error" | head -30
    timeout 300 python3 scripts/bench_kernels.py attention-kernel --batches 1 16 64 --variants split_cta \
      split_cluster "model rule" --out "$OUT/attn_kernel" 2>&1 | quiet \
      | grep "^|\|copy\|peak" ;;
  first)
    timeout 140 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_attention_gpu.py \
      -k "cluster" 2>&1 | grep "^E \|passed\|failed\|Error" | head -20
    timeout 190 python3 scripts/bench_kernels.py attention-kernel --batches 1 16 64 --variants split_cta \
      split_cluster "model rule" --out "$OUT/attn_kernel" 2>&1 | quiet \
      | grep "^|\|copy\|peak"
    DINFER_JAX_REUSE_KERNEL_LOWERINGS=1 timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider \
      "tests/test_indexer_kernel_gpu.py::test_engine_greedy_with_the_kernel_equals_full_forward_argmax" \
      2>&1 | grep "^E \|passed\|failed" | head -20
    timeout 100 python3 scripts/bench_kernels.py topk --out "$OUT/topk" 2>&1 | quiet | grep "^|\|copy\|Error" ;;
  sampler)
    timeout 170 python3 scripts/bench_kernels.py sampler --out "$OUT/sampler_kernel" 2>&1 | quiet | grep "^|\|copy\|Error"
    cd scripts && for f in "--top-k 50" ""; do timeout 165 python3 bench_serving.py --preset \
      deepseek-v4-flash --layers 4 --batch 64 $C --temperature 1.0 $f --out "$OUT/sampler${f// /_}" 2>&1 | quiet \
      | grep "^| 4 \|Error" | sed "s/^/[$f] /"; done ;;
  early)
    # the split_cta kernel with more KV bytes in flight (32-row tiles x 4 stages; the other CTAs' column chunks
    # released after the QK product), then the sampler's filters alone
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_attention_gpu.py \
      -k "bkv32 or early" 2>&1 | grep "^E \|passed\|failed\|Error" | head -20
    timeout 200 python3 scripts/bench_kernels.py attention-kernel --batches 1 16 64 --variants split_cta \
      "split_cta early" "split_cta bkv=32 stages=4" "split_cta bkv=32 stages=4 early" --out "$OUT/attn_kernel" 2>&1 \
      | quiet | grep "^|\|copy\|Error"
    timeout 170 python3 scripts/bench_kernels.py sampler --out "$OUT/sampler_kernel" 2>&1 | quiet \
      | grep "^|\|copy\|Error" ;;
  h200-attn)
    # issue 9 on an H200 in one call: the kernel with early release (the model's rule at 64 queries) against
    # split_cta at 1 / 16 / 64 queries, the GPU tests of early release and of the model's path, then the model's
    # attention path at batch 64 and 32K context (its "kernel alone" column uses the model's rule)
    timeout 130 python3 scripts/bench_kernels.py attention-kernel --batches 1 16 64 --variants split_cta \
      "split_cta early" "model rule" --out "$OUT/attn_kernel" 2>&1 | quiet | grep "^|\|copy\|Error"
    timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_attention_gpu.py \
      -k "early or model" 2>&1 | grep "^E \|passed\|failed\|Error" | head -20
    timeout ${T:-180} python3 scripts/bench_kernels.py attention --contexts ${CONTEXTS:-32768} --batches 64 \
      --out "$OUT/attention" 2>&1 | quiet | grep "^|\|copy\|Error" ;;
  rows-depth)
    # issue 9: the gathering kernel's 32-row steps (more copies in flight): GPU cases, then the depth variants
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_attention_rows_gpu.py \
      -k "bkv32 or sharedqk or equals_kernel" 2>&1 | tee "$OUT/rows_depth_tests.txt" | grep "^E \|passed\|failed" \
      | head -20
    timeout 240 python3 scripts/bench_kernels.py attention-rows --batches 1 16 64 --out "$OUT/attn_rows" 2>&1 \
      | quiet | grep "^|\|copy\|Error" ;;
  rows-depth2)
    # issue 9, after rows-depth ran out of time at one query (2026-12-06, third session): 64 queries with the depth
    # variants only, then one query with shared_qk's gathering form
    V64=("XLA pool[rows] + kernel" "gathered in kernel, early release" "gathered in kernel, early, 32-row steps × 3"
         "gathered in kernel, early, 32-row steps × 4" "v41_fp4: XLA gather + decode + kernel"
         "v41_fp4: gathered + decoded in kernel" "v41_fp4: gathered + decoded, 32-row steps × 4"
         "v41_fp4: staged a step ahead, 32-row steps × 4")
    timeout 250 python3 scripts/bench_kernels.py attention-rows --batches 64 --row-variants "${V64[@]}" \
      --out "$OUT/attn_rows64" 2>&1 | quiet | grep "^|\|copy\|Error"
    timeout 150 python3 scripts/bench_kernels.py attention-rows --batches 1 --row-variants \
      "shared_qk rule: XLA pool[rows] + kernel" "shared_qk rule: gathered in kernel" \
      "shared_qk rule, v41_fp4: XLA gather + decode + kernel" "shared_qk rule, v41_fp4: gathered + decoded in kernel" \
      --out "$OUT/attn_rows1" 2>&1 | quiet | grep "^|\|copy\|Error" ;;
  rows-first)
    # one call for a session that may get only one: the gathering kernel's GPU tests, its time against XLA's gather +
    # the kernel, then issue 9's H200 kernel figure (split_cta vs early release vs the model's rule)
    timeout 220 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_attention_rows_gpu.py 2>&1 \
      | tee "$OUT/rows_tests.txt" | grep "^E \|passed\|failed\|Error" | head -20
    timeout 150 python3 scripts/bench_kernels.py attention-rows --batches 1 16 64 --out "$OUT/attn_rows" 2>&1 \
      | quiet | grep "^|\|copy\|Error"
    timeout 130 python3 scripts/bench_kernels.py attention-kernel --batches 1 16 64 --variants split_cta \
      "split_cta early" "model rule" --out "$OUT/attn_kernel" 2>&1 | quiet | grep "^|\|copy\|Error" ;;
  gather-serving)   # one call per preset: PRESET=deepseek-v4-flash (default) or deepseek-v4.1-flash
    # issue 9: the 4-layer slice's batch-64 decode step with the decode kernel reading the selected rows from the
    # cache itself (attention_impl=pallas_gather: V4's bf16 pool / V4.1's v41_fp4 rows) against the default path
    # (ENGRAM_VOCAB=100000 KV_GIB=4 on an H100: V4.1's slice with 1M-row tables and 8 GiB of KV pages ran out of its
    # 78 GiB on 2026-12-06)
    P=${PRESET:-deepseek-v4-flash}; E=""; [ "$P" = deepseek-v4.1-flash ] && E="--engram-vocab ${ENGRAM_VOCAB:-1000000}"
    # ("auto" fetches the rows in the kernel for decode since 2026-12-06; "pallas" is XLA's gather + the kernel for
    # decode, as "auto" was before — and the kernel for prefill chunks too, so compare decode columns only)
    cd scripts && for impl in auto pallas; do timeout 270 python3 bench_serving.py --preset $P --layers 4 $E \
      --batch 64 $C --kv-gib ${KV_GIB:-8} --attention-impl $impl --out "$OUT/${P}_$impl" 2>&1 | quiet | grep "^|\|Error"; \
      echo "$P attention_impl=$impl"; done ;;
  rows-kernel)
    # issue 9: the decode-attention kernel gathering its rows by index itself (cp.async into the swizzled tiles,
    # sparse_decode_attention_rows): its GPU tests (bit-equal to the kernel on pool[rows]), then its time against
    # XLA's gather + the kernel and the kernel alone at 1 / 16 / 64 queries, and the row-gather probe
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_attention_rows_gpu.py -x 2>&1 \
      | grep "^E \|passed\|failed\|Error" | head -20
    timeout 150 python3 scripts/bench_kernels.py attention-rows --batches 1 16 64 --out "$OUT/attn_rows" 2>&1 \
      | quiet | grep "^|\|copy\|Error"
    timeout 150 python3 scripts/probe_row_gather.py 2>&1 | quiet | grep "^|\|jax\|Error" ;;
  row-gather)
    # issue 9, before building the gather into the decode-attention kernel: rows fetched by index into shared
    # memory, one async copy per row (2 / 3 stages, with and without Pallas's auto barriers) or register loads,
    # against XLA's pool[idx] at the decode shape (64 queries x 640 rows x 512 bf16; scripts/probe_row_gather.py)
    timeout 200 python3 scripts/probe_row_gather.py 2>&1 | quiet | grep "^|\|jax\|Error" ;;
  compile-depth)
    # issue 8's "8 layers <= 1.3x 2 layers": the serving step compiled as LLM compiles it (FP8 linear kernel, Triton
    # GEMMs off, decode without autotuning; --engine-defaults), abstract weights: the decode bucket [64, 1] at 2, 4
    # and 8 layers, then a 64-token bucket [4, 64] at 2 and 8
    timeout 300 python3 scripts/bench_compile.py --preset deepseek-v4-flash --layers 2 4 8 --dtype bfloat16 \
      --weights native --batch 64 --q 1 --engine-defaults --step-only 2>&1 | quiet | grep "^|\|ratio\|preset\|Error"
    timeout 240 python3 scripts/bench_compile.py --preset deepseek-v4-flash --layers 2 8 --dtype bfloat16 \
      --weights native --batch 4 --q 64 --engine-defaults --step-only 2>&1 | quiet | grep "^|\|ratio\|preset\|Error" ;;
  spec-kernels)
    # issue 11: the k = 4 speculative step's kernels at temperature 1 against greedy (sixth session of 2026-12-07:
    # 24.1 against 19.5 ms on the H200, ~1.3 ms of it the two-level draws)
    timeout 400 python3 scripts/probe_spec_step.py --preset deepseek-v4-flash --layers 4 --batch 64 --kernels 2>&1 \
      | quiet > "$OUT/spec_kernels.txt"; grep "^|\|^wall\|^jax\|Error\|^grown\|^largest" "$OUT/spec_kernels.txt" \
      | head -40 ;;
  sweep-and-step)
    # one call when device time is short, most needed first: the greedy step's kernel map, the fp32-projection
    # probe, the FP8 sweep cut at SWEEP_S (default 190) s (rows are saved as they come, largest weights first),
    # then the FP8 kernel's GPU tests (two CTAs per SM are new)
    T="0" STAGE=step-kernels bash "$0" | grep -v "^| [a-z_0-9]*fusion\|^| input\|^| loop\|^| wrapped"
    timeout 70 python3 scripts/probe_linear_f32.py 2>&1 | quiet > "$OUT/linear_f32.txt"; grep "^|\|Error\|jax" \
      "$OUT/linear_f32.txt"
    timeout ${SWEEP_S:-190} python3 scripts/bench_kernels.py linear-sweep --tokens 64 --out "$OUT/linear_sweep" \
      2>&1 | quiet > "$OUT/linear_sweep.txt"; grep "Error" "$OUT/linear_sweep.txt" | head -5
    timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_linear_kernel_gpu.py 2>&1 | quiet \
      | grep "^E \|passed\|failed" | head -20 ;;
  linear-sweep)
    # issue 9: the FP8 linear kernel at the V4 decode shapes (64 tokens): its GPU tests (two CTAs per SM are new),
    # then the fp32 projections' forms (scripts/probe_linear_f32.py), then block sizes, pipeline depth, CTAs per SM
    # and K split, each over weight copies that do not fit in L2
    timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_linear_kernel_gpu.py 2>&1 | quiet \
      | grep "^E \|passed\|failed" | head -20
    timeout 90 python3 scripts/probe_linear_f32.py 2>&1 | quiet > "$OUT/linear_f32.txt"; grep "^|\|Error\|jax" \
      "$OUT/linear_f32.txt"
    timeout 370 python3 scripts/bench_kernels.py linear-sweep --tokens 64 --out "$OUT/linear_sweep" 2>&1 | quiet \
      > "$OUT/linear_sweep.txt"; grep "^|\|copy_GBps\|Error" "$OUT/linear_sweep.txt" | tail -150 ;;
  verify-step)
    # the seventh session's changes on the GPU (see the plan above): their tests, then the greedy step's kernel map
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -s tests/test_linear_kernel_gpu.py \
      tests/test_sampling_gpu.py 2>&1 | quiet > "$OUT/tests.txt"; grep "^E \|passed\|failed\|top-5" "$OUT/tests.txt"
    DINFER_JAX_GROUPED_FP8_KERNEL=1 T="0" STAGE=step-kernels bash "$0" ;;
  step-kernels)
    # issue 9: where the batch-64 decode step's device time goes (the step is device-bound: sixth session of
    # 2026-12-07): --breakdown's per-kernel table of one decode step with launches per step (how much of the step
    # is many short kernels), greedy then sampled, whole in $OUT; the greedy run dumps XLA's optimized HLO so
    # scripts/hlo_kernel_map.py can name the jax operation and source line of each kernel ($OUT/kernel_map_t*.md)
    cd scripts && for T in ${T:-0 1.0}; do rm -rf /tmp/hlo_dump; timeout 230 env XLA_FLAGS="--xla_dump_to=/tmp/hlo_dump \
      --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*_device_.*" python3 bench_serving.py \
      --preset deepseek-v4-flash --layers 4 --batch 64 $C --temperature $T --breakdown --out "$OUT/kernels_t$T" 2>&1 \
      | quiet > "$OUT/kernels_t$T.txt"; \
      grep "^| 4 \|Error\|^decode step launches" "$OUT/kernels_t$T.txt" | sed "s/^/[t=$T] /"; \
      python3 hlo_kernel_map.py /tmp/hlo_dump "$OUT/kernels_t$T/bench_serving.json" --top 120 --holds "s32[64,1]" \
      > "$OUT/kernel_map_t$T.md" 2>&1; head -45 "$OUT/kernel_map_t$T.md" | cut -c1-230; done ;;
  cmdbuf)
    # issue 9 / 8: the decode pace looked host-bound on the H100 (fifth session of 2026-12-07: launch of the model
    # program 5.0-6.5 ms of an 7.4-8.9 ms pace, 0.8 ms waiting for the device; on the H200 in the sixth session
    # command buffers bought nothing: the launch waits on a busy device): the decode programs compiled with
    # conditionals and loops in command buffers (as the engine would set them: LLM decode_compiler_options, GEMM
    # autotuning off kept) against the defaults, greedy and sampled (the draw is ~0.2 ms at batch 64 with
    # prefix="two_level"), one process each, interleaved so a drifting machine shows; T (default "0 1.0") and RUN_S
    # (default 145) narrow it
    CB="--decode-compiler-option xla_gpu_autotune_level=0 --decode-compiler-option \
xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"
    cd scripts && for T in ${T:-0 1.0}; do for D in "" "$CB"; do L=${D:+cmdbuf}; \
      timeout ${RUN_S:-145} python3 bench_serving.py --preset deepseek-v4-flash --layers 4 --batch 64 $C \
      --temperature $T $D --out "$OUT/cmdbuf_t$T${D:+_on}" 2>&1 | quiet | grep "^| 4 \|Error" \
      | sed "s/^/[t=$T ${L:-defaults}] /"; done; done ;;
  stall)
    # issue 8: the one ~233 ms decode-pace interval of every sampled run (seventh session of 2026-12-06): Python's
    # collector (frozen here; collections in the timed window reported) or device work (the timed run again in a
    # CUPTI window: kernels by device time with launch counts)
    cd scripts && timeout 250 python3 bench_serving.py --preset deepseek-v4-flash --layers 4 --batch 64 $C \
      --temperature 1.0 --gc freeze --timed-kernels --out "$OUT/stall" 2>&1 | quiet \
      | grep "^| 4 \|Error\|^host ms\|^decode pace\|^longest\|^gc\|^kernels\|^  " ;;
  prefix)
    # issue 8: the certified draw's prefix sums as block products (dinfer_jax/sampling/_scan.py; first session of
    # 2026-12-07: the certified draw alone took 1.63 ms of the sampled batch-64 step): exactness on the GPU (fp32
    # products at HIGHEST must be exact on integers), the draw against jnp.cumsum's form, the sampled and greedy pace
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_prefix_scan.py tests/test_binade_cdf.py 2>&1 \
      | grep "^E \|passed\|failed" | head -10
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sampling_gpu.py 2>&1 \
      | grep "^E \|passed\|failed" | head -10
    timeout 150 python3 scripts/bench_draw.py --batches 1 64 256 --out "$OUT/draw" 2>&1 | quiet | grep "^|"
    cd scripts && for T in 1.0 0; do timeout 150 python3 bench_serving.py --preset deepseek-v4-flash --layers 4 \
        --batch 64 $C --temperature $T --gc freeze --out "$OUT/prefix_paced_$T" 2>&1 | quiet \
        | grep "^| 4 \|Error\|^decode pace\|^longest" | sed "s/^/[T=$T] /"; done ;;
  rule)
    # the rules above NUM_SMS / 2 queries (pallas_kernels/attention/tuning.py; fourth session of 2026-12-07)
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_attention_rows_gpu.py -k model_pooled \
      2>&1 | grep "^E \|passed\|failed" | head -10
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_attention_gpu.py -k model_attend \
      2>&1 | grep "^E \|passed\|failed" | head -10
    timeout 150 python3 scripts/bench_kernels.py attention-kernel --batches 64 67 96 128 256 384 --variants \
      "split_cta early" split_cluster shared_qk "model rule" --out "$OUT/attn_rule" 2>&1 | quiet | grep "^|\|copy"
    timeout 140 python3 scripts/bench_kernels.py attention-rows --batches 96 384 --row-variants \
      "gathered in kernel, early release" "gathered in kernel, early, 32-row steps × 3" "shared_qk rule: gathered in kernel" \
      "v41_fp4: gathered + decoded in kernel" "shared_qk rule, v41_fp4: gathered + decoded in kernel" \
      --out "$OUT/rows_rule" 2>&1 | quiet | grep "^|\|copy\|Error" ;;
  seesaw)
    # issue 9 (built on CPU in the third session of 2026-12-07, never run): organisation seesaw (FlashMLA's schedule,
    # decode_seesaw_sm90.py). First the Mosaic GPU interpreter (jax 0.11.2 on this host's CPUs: a deadlock or a
    # race shows here, not as a hung GPU), then the GPU cases with a time limit, then the kernel against the others
    JAX_PLATFORMS=cpu timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_decode_attention_cpu.py \
      -k "(interpreter or race) and seesaw" 2>&1 | grep "^E \|passed\|failed" | head -20
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_decode_attention_gpu.py -k seesaw 2>&1 \
      | grep "^E \|passed\|failed\|Timeout" | head -20
    timeout 200 python3 scripts/bench_kernels.py attention-kernel --batches 1 64 128 --variants "split_cta early" \
      split_cluster shared_qk "shared_qk l_split=2" seesaw "seesaw l_split=2" "model rule" --out "$OUT/attn_seesaw" \
      2>&1 | quiet | grep "^|\|copy\|Error" ;;
  twolevel)
    # the certified draw locating its block by block totals (prefix="two_level", fifth session of 2026-12-07):
    # exactness on the GPU, then its device time by kernel against xla / bytes at 1-256 rows
    # (the test lines also go to $OUT: the bench's tables push them out of a call's output tail)
    { timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_prefix_scan.py 2>&1 | grep "^E \|passed\|failed" \
      | head -10
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sampling_gpu.py 2>&1 \
      | grep "^E \|passed\|failed" | head -10; } | tee "$OUT/twolevel_tests.txt"
    cd scripts && timeout 250 python3 -c "import bench_draw as b; print(b.kernel_breakdown([1, 16, 64, 128, 384], \
      129280, top=4, prefixes=('xla', 'bytes', 'two_level')))" 2>&1 | quiet | grep "^batch\|^|" | tee "$OUT/twolevel.md" ;;
  prefix2)
    # issue 8: the certified draw's integer prefix sums as bf16 byte products (second session of 2026-12-07)
    timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_prefix_scan.py 2>&1 | grep "^E \|passed\|failed" \
      | head -10
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sampling_gpu.py 2>&1 \
      | grep "^E \|passed\|failed" | head -10
    timeout 300 python3 scripts/bench_draw.py --batches 1 64 256 --kernels --out "$OUT/draw" 2>&1 | quiet \
      | grep "^|\|^batch" ;;
  draw)
    # issue 8: the draw's exact fallback through binade passes (eighth session of 2026-12-06: the stall was the
    # 16K-step exact scan): its tests on the GPU, the exact paths timed (scripts/bench_draw.py), then the sampled
    # and greedy decode pace of the V4-Flash 4-layer slice on the same machine
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_binade_cdf.py 2>&1 | tail -2
    timeout 150 python3 scripts/bench_draw.py --batches 1 64 256 --out "$OUT/draw" 2>&1 | quiet | grep "^|"
    cd scripts && for T in 1.0 0; do timeout 170 python3 bench_serving.py --preset deepseek-v4-flash --layers 4 \
        --batch 64 $C --temperature $T --gc freeze --out "$OUT/draw_paced_$T" 2>&1 | quiet \
        | grep "^| 4 \|Error\|^decode pace\|^longest" | sed "s/^/[T=$T] /"; done ;;
  paced)
    # issues 8 / 9: bench_serving's decode-only step time (the engine's decode pace: time between consecutive decode
    # steps' tokens, prefills excluded) on the V4-Flash 4-layer slice at batch 64 — greedy, temperature 1 (the
    # ~2.7 ms sampled-step gap, so far a difference of prefill-dominated generate times), then greedy with
    # conditionals and loops in command buffers (STAGE=cmdbuf's question), one process each
    cd scripts && for R in "defaults|--temperature 0|" "defaults|--temperature 1.0|" \
        "cmdbuf|--temperature 0|--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE"; do IFS="|" read N T F <<< "$R"
      XLA_FLAGS="$F" timeout 170 python3 bench_serving.py --preset deepseek-v4-flash --layers 4 --batch 64 $C $T \
        --out "$OUT/paced_${N}${T// /_}" 2>&1 | quiet | grep "^| 4 \|Error\|^host ms\|^decode pace" | sed "s/^/[$N $T] /"; done ;;
  sampler-probe)
    # issue 8: the sampler's variants after ~8 ms of device work, dispatch vs done, under XLA's defaults and the
    # engine's GPU_SAMPLER_OPTIONS, including the engine's draw variant on rows without filters (use_filters=True:
    # the sorts skipped under a conditional) — is that conditional what costs the no-filter sampled step 2.6 ms?
    timeout 300 python3 scripts/probe_cond_sync.py --option-sets 2>&1 | quiet | tail -30 ;;
  spec-dispatch)
    # issue 11: does the speculative step (model + verification + MTP drafts in one program) block the host? Its
    # dispatch against completion with the decode programs' default options and with GPU_SAMPLER_OPTIONS added
    timeout 400 python3 scripts/probe_spec_step.py --preset deepseek-v4-flash --layers 4 --batch 64 --dispatch 2>&1 \
      | quiet | grep "^|\|^jax\|Error" ;;
  sampler-async)
    # issue 8: the sampler program compiled with runner.GPU_SAMPLER_OPTIONS (conditionals in command buffers, XLA's
    # sorts): its GPU tests, then the batch-64 V4-Flash 4-layer slice greedy, sampled, sampled with top-k 50
    [ -n "${SKIP_TESTS:-}" ] || timeout 200 python3 -m pytest -m gpu -q -x tests/test_sampling_gpu.py 2>&1 | quiet \
      | tail -3
    cd scripts && for f in "--temperature 0" "--temperature 1.0" "--temperature 1.0 --top-k 50"; do timeout 150 \
      python3 bench_serving.py --preset deepseek-v4-flash --layers 4 --batch 64 $C $f ${BREAKDOWN:+--breakdown} \
      --out "$OUT/s${f// /_}" 2>&1 \
      | quiet | grep "^| 4 \|Error" | sed "s/^/[$f] /"; done ;;
  h200-sampler)
    # issue 8 on an H200 in one call: the sampler's filters alone (full sorts against 1,024 candidates), then the
    # batch-64 V4-Flash 4-layer slice sampling at temperature 1 with top-k 50 and without filters
    timeout 150 python3 scripts/bench_kernels.py sampler --sampler-batches 1 64 256 --out "$OUT/sampler_kernel" 2>&1 \
      | quiet | grep "^|\|copy\|Error"
    cd scripts && for f in "--top-k 50" ""; do timeout 190 python3 bench_serving.py --preset \
      deepseek-v4-flash --layers 4 --batch 64 $C --temperature 1.0 $f --out "$OUT/sampler${f// /_}" 2>&1 | quiet \
      | grep "^| 4 \|Error" | sed "s/^/[$f] /"; done ;;
  topk-model)
    timeout 200 python3 scripts/bench_kernels.py topk --topk-variants "group 4" "group 8" --out "$OUT/topk" 2>&1 \
      | quiet | grep "^|\|copy\|Error"
    timeout 300 python3 scripts/bench_kernels.py attention --contexts 32768 131072 --batches 64 \
      --out "$OUT/attention" 2>&1 | quiet | grep "^|\|copy\|Error" ;;
  topk-reuse)
    # the top-k bench alone first (rows printed as they finish), then the V4.1 engine case with lowering reuse on
    timeout ${T:-250} python3 scripts/bench_kernels.py topk --out "$OUT/topk" 2>&1 | quiet | grep "^|\|copy\|Error"
    DINFER_JAX_REUSE_KERNEL_LOWERINGS=1 timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider \
      "tests/test_indexer_kernel_gpu.py::test_engine_greedy_with_the_kernel_equals_full_forward_argmax" \
      2>&1 | grep "^E \|passed\|failed" | head -20 ;;
  pingpong)
    [ "${SKIP_TESTS:-0}" = 1 ] || timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/test_decode_attention_gpu.py -k "ping" 2>&1 | grep "^E \|passed\|failed\|Error" | head -30
    timeout 300 python3 scripts/bench_kernels.py attention-kernel --batches 1 16 64 --variants split_cta \
      "pingpong bkv=32 stages=4" "pingpong bkv=64 stages=2" "pingpong bkv=32 stages=2" "model rule" \
      --out "$OUT/attn_kernel" 2>&1 | quiet | grep "^|\|copy\|peak" ;;
  v4-autotune)
    cd scripts && timeout 300 python3 bench_serving.py --preset deepseek-v4-flash --layers 4 --batch 64 $C \
      --compiler-option xla_gpu_autotune_level=0 --out "$OUT/v4_noautotune" 2>&1 | quiet | grep "^|\|^warm-up" ;;
  lab4)
    timeout 560 python3 scripts/bench_mesh.py --preset deepseek-v4.1-flash --layers "${LAYERS:-4}" \
      --engram-vocab 1000000 --batch 16 --long-prompts 4 --long-len 4096 --layouts 2,2,4 4,1,4 --out "$OUT/lab4" \
      2>&1 | tee "$OUT/lab4.log" | quiet | grep "^|\|^model\|^jax\|^layout\|Error\|Fatal" ;;
  mesh)
    # the kernel split over EP ranks already passed on the H200 (2026-12-04); the engines crashed jax 0.11.2's
    # Shardy partitioner before runner.pad_rows (docs/dp_engines.md)
    timeout 230 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_mesh_gpu.py 2>&1 | tee "$OUT/mesh_tests.log" \
      | grep "^E \|passed\|failed\|Fatal" | head -30
    timeout 340 python3 scripts/bench_mesh.py --preset deepseek-v4-flash --layers "${LAYERS:-2}" \
      --layouts 1,1,2 2,1,1 2,1,2 --out "$OUT/mesh" 2>&1 | tee "$OUT/mesh.log" | quiet | grep "^|\|^model\|^jax\|Error\|Fatal" ;;
  *) echo "unknown STAGE=$STAGE"; exit 2 ;;
esac
