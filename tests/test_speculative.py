"""Speculative decoding in the engine (issue 11): ``LLM(..., speculative="mtp")`` with a tiny random V4 model and
``speculative="dspark"`` with a tiny random V4.1 model.

Greedy speculative output must equal the non-speculative engine's token for token (sync and async loops, chunked
prefill, prompts crossing the SWA window of 8 and the ratio-4 / ratio-16 compression groups), whatever the
drafter proposes: rejected drafts must leave no trace in the rings, pages, Engram history or drafter state.
Drafters:

* ``random``: the model's own random MTP block (std 0.1): drafts are almost always rejected (rollback path).
* ``friendly``: target layers' outputs scaled down and an MTP block that reproduces the target's "bigram" part,
  so that many drafts are accepted and accepted runs (and stop tokens inside them) are exercised.
* ``dspark``: tiny random V4.1 (SWA window 16, compression ratios 1 and 2, Engram) with its random DSpark
  drafter; its engines (reference included) run with ``batch_invariant=True``. This random model's greedy
  continuations hold near-ties in discrete choices (expert routing, the indexer's top-k): on 2026-12-07 the
  70-token prompt of ``seed=4`` at generated position 10 gave token 37 in the full forward and 24 in a ``[4, 2]``
  verify step or a ``[1, 1]`` decode step of the *non-speculative* default engine (1e-6 relative weight noise flips
  the full forward too, despite a 0.3 logit margin), so in the default mode token equality across differently
  shaped programs depends on the host's rounding. Batch-invariant steps compute each token's logits bitwise alike
  at any width, so the comparison is exact by construction.
* ``default``: the bundled trained V4.1 model with its self-distilled DSpark drafter (``scripts/train_drafter.py``),
  on text prompts.

Also: seeded sampling with speculation is reproducible and the same under sync and async loops; metrics are
consistent; nothing compiles after warm-up; bad input behaves as without speculation.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax import LLM, SamplingParams
from dinfer_jax.engine.runner import Buckets
from dinfer_jax.models import load_config, random_model

GEN = 20
LENGTHS = [5, 23, 41, 70]
K = 3
# confidence-scheduled verification: the decode widths compiled per drafter (1 + K must be among them)
WIDTHS = {"friendly": "all", "dspark": (2, 1 + K)}


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(4, vocab, size=n)] for n in lengths]


def _scale_block(block: dict, f: float) -> dict:
    block = dict(block)
    attn = dict(block["attn"])
    attn["wo_b"] = attn["wo_b"] * f
    ffn = dict(block["ffn"])
    ffn["experts"] = {**ffn["experts"], "w2": ffn["experts"]["w2"] * f}
    ffn["shared_experts"] = {**ffn["shared_experts"], "w2": ffn["shared_experts"]["w2"] * f}
    block["attn"], block["ffn"] = attn, ffn
    return block


def _friendly(model, a: float):
    """Target blocks' outputs × a; an MTP block that maps the next token through the target's head exactly as the
    target maps its current token when a = 0 (so its drafts match a mostly-bigram target)."""
    p = dict(model.params)
    p["layers"] = [_scale_block(b, a) for b in p["layers"]]
    m = _scale_block(p["mtp"][0], 0.0)
    d = m["e_proj"].shape[0]
    m.update(e_proj=jnp.eye(d, dtype=m["e_proj"].dtype), h_proj=jnp.zeros_like(m["h_proj"]),
             enorm=jnp.ones_like(m["enorm"]), hc_head=p["hc_head"], norm=p["norm"])
    p["mtp"] = [m]
    return dataclasses.replace(model, params=jax.tree_util.tree_map(lambda x: x, p))


def _buckets() -> Buckets:
    return Buckets(decode_batch=(4,), prefill_batch=(4,), prefill_len=(32,))


def _llm(model, **kw) -> LLM:
    return LLM(model, max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32, buckets=_buckets(),
               progress=False, **kw)


@pytest.fixture(scope="module")
def build():
    """Engines built once per module: ``build(name) -> (name, reference LLM, speculative LLM)``."""
    built: dict[str, tuple] = {}
    models: dict[str, object] = {}

    def model(name: str):
        if name not in models:
            if name == "default":
                models[name] = "default"
            elif name == "dspark":
                models[name] = random_model(load_config("tiny-v41"), seed=3, std=0.1, include_mtp=True)
            else:
                base = random_model(load_config("tiny-v4"), seed=3, std=0.1, include_mtp=True)
                models[name] = base if name == "random" else _friendly(base, 0.05)
        return models[name]

    def make(name: str) -> tuple:
        """``name``: a drafter (module docstring), or ``<drafter>+widths``: its engine with confidence-scheduled
        verification over ``WIDTHS[drafter]`` (the reference engine is the drafter's)."""
        if name not in built:
            base, _, widths = name.partition("+")
            method = "dspark" if base in ("dspark", "default") else "mtp"
            # the tiny V4.1's engines run batch-invariant: its greedy continuations hold near-ties (module docstring)
            inv = dict(batch_invariant=True) if base == "dspark" else {}
            ref = make(base)[1] if widths else _llm(model(base), **inv)
            extra = dict(speculative_widths=WIDTHS[base]) if widths else {}
            built[name] = name, ref, _llm(model(base), speculative=method, num_speculative_tokens=K, **extra, **inv)
        return built[name]

    return make


@pytest.fixture(params=["random", "friendly", "dspark", "default"])
def engines(request, build):
    return build(request.param)


@pytest.fixture
def friendly(build):
    """The MTP engine whose drafts are often accepted (seeded sampling and bad input need only one drafter)."""
    return build("friendly")


def _text_prompts(llm: LLM) -> list[list[int]]:
    """The default model's prompts: growing prefixes of examples/prompts.txt (about 6 to 70 tokens, so the longest
    crosses its 64-token SWA window)."""
    lines = [ln.strip() for ln in open(Path(__file__).resolve().parents[1] / "examples" / "prompts.txt") if ln.strip()]
    return [llm.tokenizer.encode(" ".join(lines[:j])).ids for j in (1, 3, 6, 10)]


def test_greedy_speculative_equals_non_speculative(engines):
    name, ref_llm, spec = engines
    prompts = _text_prompts(spec) if name == "default" else _prompts(spec.config.vocab_size, LENGTHS)
    greedy = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True)
    compiled = spec.metrics()["compilations"]
    assert spec.runner.compiled_shapes == {(*s, i < len(spec.buckets.decode_batch) * len(spec.buckets.pages))
                                           for i, s in enumerate(spec.buckets.shapes())}, "warm-up missed a shape"
    want = [o.token_ids for o in ref_llm.generate(prompts, greedy, use_tqdm=False)]
    for async_ in (False, True):
        spec.configure(async_scheduling=async_)
        chained = spec.metrics()["spec_chained_rows"]
        outs = spec.generate(prompts, greedy, use_tqdm=False)
        for i, o in enumerate(outs):
            assert o.finish_reason == "length" and len(o.token_ids) == GEN
            assert o.token_ids == want[i], f"{name} async={async_}: prompt {i} (len {len(prompts[i])}) diverges"
        chained = spec.metrics()["spec_chained_rows"] - chained
        # the asynchronous loop schedules a request's next row behind its verify row in flight; the sync one never
        assert (chained > 0) if async_ else (chained == 0), (async_, chained)
    m = spec.metrics()
    assert m["compilations"] == compiled, "compiled outside warm-up"
    assert m["spec_verify_steps"] > 0 and 0 <= m["spec_accepted_tokens"] <= m["spec_draft_tokens"]
    assert m["spec_draft_tokens"] <= K * m["spec_verify_steps"]
    assert m["mean_acceptance_length"] == pytest.approx(1 + m["spec_accepted_tokens"] / m["spec_verify_steps"])
    assert m["mean_acceptance_length"] >= 1.0
    if name in ("friendly", "default"):
        assert m["spec_accepted_tokens"] > 0, f"the {name} drafter should get drafts accepted"


@pytest.fixture(params=["friendly", "dspark"])
def widths_engines(request, build):
    """``(name, reference LLM, fixed-width speculative LLM, confidence-scheduled speculative LLM)``."""
    name, ref_llm, fixed = build(request.param)
    return name, ref_llm, fixed, build(request.param + "+widths")[2]


def _delta(after: dict, before: dict) -> tuple[int, int, int, dict[int, int]]:
    """Drafts verified, drafts accepted, verify rows and decode steps per width between two ``metrics()``."""
    widths = {w: n - before["spec_step_widths"].get(w, 0) for w, n in after["spec_step_widths"].items()}
    return (after["spec_draft_tokens"] - before["spec_draft_tokens"],
            after["spec_accepted_tokens"] - before["spec_accepted_tokens"],
            after["spec_verify_steps"] - before["spec_verify_steps"], {w: n for w, n in widths.items() if n})


def test_confidence_scheduled_verification_keeps_greedy_output(widths_engines):
    """Issue 11 item 4: with several decode widths compiled, greedy output still equals the non-speculative
    engine's in both loops, whatever width the steps take. Three step-time curves: the one measured at warm-up;
    a flat one (verifying is free: every step must take the narrowest width holding all drafts, so the engine
    verifies exactly what the fixed-width engine verifies, draft for draft); a steep one (verifying never pays:
    every step takes the narrowest compiled width)."""
    name, ref_llm, fixed, spec = widths_engines
    prompts = _prompts(spec.config.vocab_size, LENGTHS, seed=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True)
    widths = spec.buckets.widths()
    assert len(widths) > 1 and widths[-1] == 1 + K
    n_decode = len(spec.buckets.decode_shapes())
    assert n_decode == len(widths) * len(spec.buckets.decode_batch) * len(spec.buckets.pages)
    assert spec.runner.compiled_shapes == {(*s, i < n_decode) for i, s in enumerate(spec.buckets.shapes())}
    measured = dict(spec.runner.decode_step_ms)
    assert set(measured) == set(spec.buckets.decode_shapes()) and all(ms > 0 for ms in measured.values())
    compiled = spec.metrics()["compilations"]
    want = [o.token_ids for o in ref_llm.generate(prompts, greedy, use_tqdm=False)]
    curves = {"measured": measured, "flat": dict.fromkeys(measured, 1.0),
              "steep": {s: 1.0 + 100.0 * (s[1] - 1) for s in measured}}
    try:
        for curve, times in curves.items():
            spec.runner.decode_step_ms = times
            for async_ in (False, True):
                spec.configure(async_scheduling=async_)
                before = spec.metrics()
                outs = spec.generate(prompts, greedy, use_tqdm=False)
                assert [o.token_ids for o in outs] == want, f"{name} {curve} async={async_} diverges"
                drafts, accepted, rows, by_width = _delta(spec.metrics(), before)
                assert sum(by_width.values()) > 0 and set(by_width) <= set(widths), by_width
                if curve == "steep":
                    assert set(by_width) == {widths[0]}, by_width
                    assert drafts <= (widths[0] - 1) * rows, (drafts, rows)
                if curve == "flat":
                    fixed.configure(async_scheduling=async_)
                    before_fixed = fixed.metrics()
                    assert [o.token_ids for o in fixed.generate(prompts, greedy, use_tqdm=False)] == want
                    assert (drafts, accepted, rows) == _delta(fixed.metrics(), before_fixed)[:3], (name, async_)
    finally:
        spec.runner.decode_step_ms = measured
    assert spec.metrics()["compilations"] == compiled, "compiled outside warm-up"


def test_online_step_time_correction_moves_the_width_and_keeps_greedy_output(build):
    """``speculative_time_correction`` (DeepInfer's online slope): with the step-time curve set far below the
    steps' real time (1 µs per step, flat), the uncorrected choice is always the widest width; the engine times
    its decode steps, the slope becomes positive, and once it applies the next run takes the narrow width
    (random DSpark drafter: confidences near 0.5, so a draft returns less than its share of a step). Greedy
    output equals the non-speculative engine's throughout, in both loops."""
    _, ref_llm, spec = build("dspark+widths")
    prompts = _prompts(spec.config.vocab_size, LENGTHS, seed=6)
    greedy = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True)
    want = [o.token_ids for o in ref_llm.generate(prompts, greedy, use_tqdm=False)]
    measured = dict(spec.runner.decode_step_ms)
    widths = spec.buckets.widths()
    with pytest.raises(ValueError, match="speculative_time_correction"):
        build("dspark")[2].configure(speculative_time_correction=True)   # one width: nothing to correct
    try:
        spec.runner.decode_step_ms = dict.fromkeys(measured, 1e-3)
        spec.configure(speculative_time_correction=True, async_scheduling=False)
        before = spec.metrics()
        assert before["spec_timed_steps"] == 0 and before["spec_step_time_slope_ms"] == 0.0
        assert [o.token_ids for o in spec.generate(prompts, greedy, use_tqdm=False)] == want
        first = spec.metrics()
        assert first["spec_timed_steps"] > 10 and first["spec_step_time_slope_ms"] > 0.0, first
        for async_ in (False, True):
            spec.configure(async_scheduling=async_)
            before = spec.metrics()
            assert [o.token_ids for o in spec.generate(prompts, greedy, use_tqdm=False)] == want
            by_width = _delta(spec.metrics(), before)[3]
            assert set(by_width) == {widths[0]}, (async_, by_width)
    finally:
        spec.runner.decode_step_ms = measured
        spec.configure(speculative_time_correction=False, async_scheduling=False)
    assert spec.metrics()["spec_timed_steps"] == 0


def test_confidence_scheduled_seeded_sampling_is_reproducible(build):
    """Seeded sampling with confidence-scheduled verification gives the same tokens run after run (same batch,
    same loop): the width choice reads only the step-time curve and the drafts' published confidences."""
    _, _, spec = build("friendly+widths")
    prompts = _prompts(spec.config.vocab_size, LENGTHS, seed=5)
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=GEN, ignore_eos=True, seq_seed=200 + i)
              for i in range(len(prompts))]
    for async_ in (False, True):
        spec.configure(async_scheduling=async_)
        runs = [[o.token_ids for o in spec.generate(prompts, params, use_tqdm=False)] for _ in range(2)]
        assert runs[0] == runs[1] and all(len(t) == GEN for t in runs[0])


def test_speculative_widths_bad_values(friendly):
    model = friendly[2].model
    with pytest.raises(ValueError, match="speculative_widths"):
        LLM(model, speculative="mtp", num_speculative_tokens=3, speculative_widths=(1, 2), warmup=False,
            progress=False)
    with pytest.raises(ValueError, match="speculative_widths needs speculative"):
        LLM(model, speculative_widths="all", warmup=False, progress=False)


def test_stop_token_inside_accepted_run_and_logprobs(engines):
    name, ref_llm, spec = engines
    prompts = _prompts(spec.config.vocab_size, LENGTHS, seed=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True)
    full = [o.token_ids for o in ref_llm.generate(prompts, greedy, use_tqdm=False)]
    stops = [toks[GEN // 2] for toks in full]
    params = [SamplingParams(temperature=0.0, max_tokens=GEN, ignore_eos=True, stop_token_ids=[s], logprobs=2)
              for s in stops]
    want = ref_llm.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason == "stop"
        assert len(g.logprobs) == len(g.token_ids)
        assert [e["token"] for e in g.logprobs] == g.token_ids
        assert all(len(e["top"]) == 2 for e in g.logprobs)


def test_seeded_sampling_reproducible_sync_and_async(friendly):
    _, _, spec = friendly
    prompts = _prompts(spec.config.vocab_size, LENGTHS, seed=2)
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=GEN, ignore_eos=True, seq_seed=100 + i)
              for i in range(len(prompts))]
    runs = []
    for async_ in (False, True, False):
        spec.configure(async_scheduling=async_)
        runs.append([o.token_ids for o in spec.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1] == runs[2]
    assert all(len(t) == GEN for t in runs[0])


def test_bad_input_behaves_as_without_speculation(friendly):
    _, _, spec = friendly
    outs = spec.generate([[1, 2, 3], ["x"], [], [5] * 200, [7, 8]],
                         SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert outs[0].finish_reason in ("length", "stop") and outs[4].finish_reason in ("length", "stop")
    assert [o.finish_reason for o in outs[1:4]] == ["error"] * 3
    model = spec.model
    with pytest.raises(ValueError, match="speculative"):
        LLM(model, speculative="eagle", warmup=False, progress=False)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(model, speculative="mtp", num_speculative_tokens=0, warmup=False, progress=False)
    with pytest.raises(ValueError, match="dspark"):
        LLM(model, speculative="dspark", warmup=False, progress=False)
    no_mtp = dataclasses.replace(model, params={**model.params, "mtp": []})
    with pytest.raises(ValueError, match="MTP parameters"):
        LLM(no_mtp, speculative="mtp", warmup=False, progress=False)


def test_scheduler_runs_reserve_blocks_truncate_at_eos_and_clamp_drafts():
    """Host bookkeeping alone (no device): a verify row reserves blocks for its drafts, process_step appends a run
    token by token, drops what follows an EOS, advances the committed length by the accepted drafts, and draft
    counts shrink near max_tokens."""
    from dinfer_jax.engine.block_manager import BlockManager, StateSlots
    from dinfer_jax.engine.scheduler import Scheduler, SchedulerConfig

    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, block_size=4,
                          num_speculative_tokens=3)
    sched = Scheduler(cfg, BlockManager(32, 4), StateSlots(3), vocab_size=100)
    a = sched.add_request("a", [1, 2, 3], SamplingParams(max_tokens=6), eos_token_ids=[99])
    b = sched.add_request("b", [4, 5, 6, 7], SamplingParams(max_tokens=20), eos_token_ids=[99])
    step = sched.schedule()
    assert step.kind == "prefill"
    sched.process_step(step, [10, 20])
    assert a.has_drafts and b.has_drafts
    step = sched.schedule()
    assert step.kind == "decode" and [r.num_drafts for r in step.rows] == [3, 3]
    assert [r.num_tokens for r in step.rows] == [4, 4]
    assert len(a.block_ids) == 2 and len(b.block_ids) == 2  # positions 3..6 and 4..7 reserved
    sched.process_step(step, [[11, 12], [21, 99, 22, 23]])
    assert a.output_token_ids == [10, 11, 12] and a.num_computed_tokens == a.num_tokens - 1
    assert b.output_token_ids == [20, 21, 99] and b.finish_reason == "stop"
    assert step.rows[1].accepted_tokens == [21, 99]
    step = sched.schedule()  # a: 3 outputs of 6 → at most 2 drafts
    assert [r.num_drafts for r in step.rows] == [2]
    sched.process_step(step, [[13, 14, 15]])
    assert a.output_token_ids == [10, 11, 12, 13, 14, 15] and a.finish_reason == "length"
    with pytest.raises(ValueError, match="list of ints"):
        c = sched.add_request("c", [1, 2], SamplingParams(max_tokens=9))
        sched.process_step(sched.schedule(), [5])
        bad = sched.schedule()
        sched.process_step(bad, [7])
    assert c.num_computed_tokens >= 2


def test_scheduler_chains_a_row_behind_a_verify_row_in_flight():
    """Host bookkeeping of the asynchronous loop (no device): with a verify row in flight in the step just
    scheduled, the request's next row is chained (start = what the host knows, blocks for the furthest position
    the device may move it to); processing the verify row moves its start by the accepted drafts and cuts its
    drafts to the room left, as a row scheduled afterwards would get; no chaining behind an older step."""
    from dinfer_jax.engine.block_manager import BlockManager, StateSlots
    from dinfer_jax.engine.scheduler import Scheduler, SchedulerConfig

    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, block_size=4,
                          num_speculative_tokens=3)
    sched = Scheduler(cfg, BlockManager(32, 4), StateSlots(3), vocab_size=100)
    a = sched.add_request("a", [1, 2, 3], SamplingParams(max_tokens=9), eos_token_ids=[99])
    pre = sched.schedule()
    chained_pre = sched.schedule()              # behind the prefill row (no drafts to accept: not chained)
    assert chained_pre.rows[0].input_src == (pre.step_id, 0) and not chained_pre.rows[0].chained
    assert chained_pre.rows[0].num_drafts == 3  # the prefill step's drafter publishes for the slot
    assert sched.schedule() is None             # two rows in flight: no third
    sched.process_step(pre, [10])
    v1 = chained_pre                            # verify row at position 3 with 3 drafts, in flight
    row = sched.schedule().rows[0]              # chained behind v1
    assert row.chained and row.start_pos == 4 and row.draft_room == 9 - 2 - 1 and row.num_drafts == 3
    assert row.slack == 3 and len(a.block_ids) == -(-(4 + 1 + 3 + 3) // 4)   # reach: position 10
    sched.process_step(v1, [[11, 12, 13]])      # 2 drafts accepted
    assert not row.chained and row.start_pos == 6 and a.num_computed_tokens == 7
    assert row.num_drafts == 3 and row.num_tokens == 4   # room 6 - 2 = 4 ≥ 3 drafts
    nxt = sched.schedule().rows[0]              # outputs 4 known + 1 in flight: room 9 - 5 - 1 = 3
    assert nxt.chained and nxt.draft_room == 3 and nxt.num_drafts == 3 and nxt.slack == 0
    sched.process_step(sched._inflight[0], [[14, 15, 16, 17]])   # row accepts all 3: shift 3, room 3 - 3 = 0
    assert nxt.start_pos == 10 and nxt.num_drafts == 0 and nxt.num_tokens == 1
    assert a.output_token_ids == [10, 11, 12, 13, 14, 15, 16, 17]
    sched.process_step(sched._inflight[0], [18])
    assert a.finish_reason == "length" and a.output_token_ids[-1] == 18 and len(a.output_token_ids) == 9
