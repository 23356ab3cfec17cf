"""Batch-invariant serving (``LLM(batch_invariant=True)``, ``docs/batch_invariance.md``).

A request's logits must be bitwise the same alone, in batches of 2–64 with random other requests, at any row, and
whatever the chunking of its prompt. The engine returns the whole vocabulary's logprobs at temperature 1 (a fixed
function of the logits: ``log_softmax``), and seeded draws, so equal logprob vectors and tokens at every generated
position are what is compared, bit for bit. The step-level test also checks that the default path is *not*
invariant on the same inputs (so the comparison can fail), and the engine's values are checked against the
full-sequence forward (the invariant path computes the same model, to fp32 rounding).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax import LLM, SamplingParams
from dinfer_jax.engine.kv_cache import init_cache
from dinfer_jax.engine.model_step import model_step
from dinfer_jax.engine.runner import Buckets, step_statics
from dinfer_jax.models import load_config, random_model, run
from dinfer_jax.models.invariant import CPU_INVARIANT_OPTIONS, DEFAULT_TILE, token_tiled
from dinfer_jax.models.layer_plan import stack_params
from dinfer_jax.models.step_state import CacheConfig, StepInput

GEN = 3
N_REQ = 20


def _vectors(out) -> list[tuple[int, float, tuple[tuple[int, float], ...]]]:
    """Per generated position: the token, its logprob and the whole vocabulary's (token, logprob) pairs, in token
    order."""
    return [(d["token"], d["logprob"], tuple(sorted(d["top"]))) for d in out.logprobs]


@pytest.fixture(scope="module")
def v41():
    return random_model(load_config("tiny-v41"), seed=3, include_mtp=False)


def test_engine_logits_are_batch_invariant(v41):
    cfg = v41.config
    V = cfg.vocab_size
    rng = np.random.default_rng(11)
    lengths = rng.integers(3, 150, N_REQ + 44)
    prompts = [[int(t) for t in rng.integers(4, V, int(n))] for n in lengths]
    params = [SamplingParams(temperature=1.0, max_tokens=GEN, ignore_eos=True, logprobs=V, seq_seed=1000 + i)
              for i in range(len(prompts))]
    # decode alone ([1, 1]) and at 64 rows; prefill budgets of 64 and 100 tokens per step (shared by up to 4 rows,
    # so a prompt's chunks depend on its companions), 8 and 16 pages of 16 tokens
    llm = LLM(v41, max_num_seqs=64, max_model_len=256, max_num_batched_tokens=100, progress=False, max_logprobs=V,
              block_size=16, buckets=Buckets(decode_batch=(1, 64), prefill_batch=(4,), prefill_len=(32, 128),
                                             pages=(8, 16)),
              batch_invariant=True)
    compiled = llm.metrics()["compilations"]

    def gen(ids: list[int], chunk: int) -> dict[int, list]:
        llm.configure(max_num_batched_tokens=chunk)
        outs = llm.generate([prompts[i] for i in ids], [params[i] for i in ids], use_tqdm=False)
        return {i: _vectors(o) for i, o in zip(ids, outs, strict=True)}

    alone = {}
    for i in range(N_REQ):
        alone.update(gen([i], 64 if i % 2 else 100))
    runs = []
    order = rng.permutation(len(prompts))                     # all 64 rows, the 20 at random positions
    runs.append(gen([int(i) for i in order], 64))
    runs.append(gen([int(i) for i in order[::-1]], 100))
    for size, mine in ((2, 1), (2, 2), (7, 3), (7, 5), (40, 12)):   # random companions, random positions
        ids = [int(i) for i in rng.choice(N_REQ, size=mine, replace=False)]
        others = rng.choice(np.arange(N_REQ, len(prompts)), size=size - mine, replace=False)
        ids = [int(i) for i in rng.permutation(ids + [int(o) for o in others])]
        runs.append(gen(ids, int(rng.choice([64, 100]))))
    assert llm.metrics()["compilations"] == compiled, "compiled outside warm-up"
    checked = 0
    for run_out in runs:
        for i, vec in run_out.items():
            if i < N_REQ:
                assert vec == alone[i], f"request {i} (prompt {len(prompts[i])}) differs from its run alone"
                checked += 1
    assert checked == 2 * N_REQ + 1 + 2 + 3 + 5 + 12

    # the invariant path computes the model: first-token logprobs against the full forward's (fp32, a few ulps of
    # the logits' scale: blockwise vs one-pass softmax sums, tiled vs whole GEMMs)
    # one causal forward over the 4 prompts right-padded to a common length (one compile, not one per length):
    # position len-1 of a row sees only that row's prompt
    S = max(len(prompts[i]) for i in range(4))
    batch = np.asarray([prompts[i] + [prompts[i][-1]] * (S - len(prompts[i])) for i in range(4)])
    full = np.asarray(run(v41, batch).logits, np.float64)
    for i in range(4):
        logits = full[i, len(prompts[i]) - 1]
        want = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        got = np.array([lp for _, lp in alone[i][0][2]])
        assert np.max(np.abs(got - want)) < 1e-4 * max(1.0, np.abs(want).max())


def _step_rows(name: str, tile: int, shapes, overrides: dict | None = None,
               on_compiled=None) -> list[tuple[np.ndarray, np.ndarray]]:
    """One prompt's logits and streams through ``model_step`` (fresh cache) alone and inside other batches.
    ``shapes``: ``(rows B, tokens per row Q, the prompt's row, pages per row, other rows' tokens)`` each;
    ``overrides``: config fields replaced (e.g. fewer layers); ``on_compiled(B, Q, compiled)`` sees each shape's
    compiled program (``scripts/probe_invariance.py`` dumps its text)."""
    cfg = dataclasses.replace(load_config(name), **(overrides or {}))
    model = random_model(cfg, seed=3, include_mtp=False)
    cfg = model.config
    params = stack_params(cfg, model.params)
    cc = CacheConfig(num_slots=10, num_blocks=48, block_size=16)
    statics, engram = step_statics(model, "auto", "device", tile)
    statics.pop("attention")
    opts = CPU_INVARIANT_OPTIONS if tile and jax.default_backend() == "cpu" else None
    step = jax.jit(functools.partial(model_step, **statics, return_carry=True), compiler_options=opts)
    rng = np.random.default_rng(0)
    prompt = rng.integers(4, cfg.vocab_size, 14)
    out = []
    for B, Q, row, P, other in shapes:
        toks = np.zeros((B, Q), np.int32)
        n, slot, last = np.zeros(B, np.int32), np.zeros(B, np.int32), np.zeros(B, np.int32)
        pages = np.zeros((B, P), np.int32)
        for b in range(B):
            t = prompt if b == row else rng.integers(4, cfg.vocab_size, other)
            toks[b, :len(t)], n[b], slot[b], last[b] = t, len(t), b + 1, len(t) - 1
            pages[b] = np.arange(1 + b * P, 1 + (b + 1) * P)
        inp = StepInput(*(jnp.asarray(a) for a in (toks, np.zeros(B, np.int32), n, slot, pages, last)))
        cache = init_cache(cfg, cc, model.dtype)
        compiled = step.lower(params, cache, inp, engram=engram).compile()
        if on_compiled is not None:
            on_compiled(B, Q, compiled)
        logits, _, carry = compiled(params, cache, inp, engram=engram)
        out.append((np.asarray(logits[row]), np.asarray(carry["streams"][row, :len(prompt)])))
    return out


@pytest.mark.parametrize("name", ["tiny-v4"])
def test_step_is_invariant_and_the_default_step_is_not(name):
    """V4 (hash, CSA, HCA layers) at the step: one prompt alone (``[1, 16]``, 2 pages) and at other rows of
    ``[4, 32]`` (4 pages) and ``[8, 16]`` batches."""
    shapes = [(1, 16, 0, 2, 0), (4, 32, 2, 4, 30), (8, 16, 7, 4, 16)]
    rows = _step_rows(name, DEFAULT_TILE, shapes)
    for logits, streams in rows[1:]:
        assert np.array_equal(logits, rows[0][0]) and np.array_equal(streams, rows[0][1])
    default = _step_rows(name, 0, shapes)
    assert any(not np.array_equal(lg, default[0][0]) for lg, _ in default[1:]), (
        "the default step gave identical bits at every batch shape: this comparison could not detect a difference")
    scale = np.abs(default[0][0]).max()
    assert np.abs(rows[0][0] - default[0][0]).max() < 1e-5 * scale   # same model, fp32 rounding apart


def test_token_tiled_rows_and_padding():
    """``token_tiled`` feeds fixed tiles, restores the leading shape and drops padding rows."""
    x = jnp.arange(2 * 7 * 3, dtype=jnp.float32).reshape(2, 7, 3)
    seen = []

    def fn(t):
        seen.append(t.shape)
        return t * 2.0, t.sum(-1)

    y, s = token_tiled(fn, x, lead=2, tile=4)
    assert seen == [(4, 3)]
    np.testing.assert_array_equal(y, x * 2.0)
    np.testing.assert_array_equal(s, x.sum(-1))
    with pytest.raises(ValueError, match="leading shapes"):
        token_tiled(fn, x, x[:1], lead=2, tile=4)


def test_bad_settings_are_refused(v41):
    with pytest.raises(ValueError, match="batch_invariant must be True or False"):
        LLM(v41, batch_invariant=16, warmup=False, progress=False)
    with pytest.raises(ValueError, match="one-device engine"):
        LLM(v41, batch_invariant=True, dp_size=2, warmup=False, progress=False)


def test_moe_called_outside_a_segment_tiles_itself():
    """``moe`` traced batch-invariantly outside a layer's per-token segment runs its experts over token tiles: a
    row's output has the same bits in a 40-row call and alone, and equals the dense experts within fp32 rounding."""
    from dinfer_jax.models.invariant import batch_invariant
    from dinfer_jax.models.moe import moe

    cfg = load_config("tiny-v4")
    ffn = random_model(cfg, seed=3, include_mtp=False).params["layers"][5]["ffn"]

    def invariant(x):
        with batch_invariant(DEFAULT_TILE):
            return moe(ffn, x, None, cfg=cfg, hash_routed=False)[0]

    x = jax.random.normal(jax.random.key(0), (1, 40, cfg.hidden_size), jnp.float32)
    many = np.asarray(jax.jit(invariant)(x))
    alone = np.asarray(jax.jit(invariant)(x[:, -1:]))
    assert np.array_equal(alone[0, 0], many[0, -1])
    dense = np.asarray(moe(ffn, x, None, cfg=cfg, hash_routed=False, impl="dense")[0])
    assert np.abs(many - dense).max() <= 1e-5 * np.abs(dense).max()   # same sums, other tiling: fp32 rounding


def test_tiled_sampler_equals_the_plain_sampler_row_for_row():
    """The batch-invariant sampler program (rows in fixed tiles) gives every row the plain sampler's token and
    logprobs: filtered and unfiltered rows, greedy rows, a token mask, a non-finite row and padding rows."""
    from dinfer_jax.engine.records import NONFINITE_TOKEN
    from dinfer_jax.engine.runner import _device_sample
    from dinfer_jax.sampling import SamplingTensors

    V, n, b = 72, 21, 40
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((b, V)).astype(np.float32) * 3
    logits[4, 9] = np.nan
    params = [SamplingParams(temperature=[1.0, 0.7, 0.0][i % 3], top_p=[1.0, 0.8][i % 2], top_k=[-1, 5, 20][i % 3],
                             min_p=[0.0, 0.05][i % 2], logprobs=8) for i in range(n)]
    samp = SamplingTensors.from_params(params, list(range(100, 100 + n)), list(range(30, 30 + n)), pad_to=b)
    mask = np.full((b, 3), -1, np.int32)
    mask[2, 0] = 0x0F0F0F0F                        # a structured-output row: half its first 32 tokens allowed
    plain = _device_sample(jnp.asarray(logits), samp, jnp.asarray(mask), max_rows=48)
    tiled = _device_sample(jnp.asarray(logits), samp, jnp.asarray(mask), max_rows=48, batch_invariant=DEFAULT_TILE)
    for a, c in zip(jax.tree.leaves(plain), jax.tree.leaves(tiled), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    toks = np.asarray(tiled[0])
    assert toks[4] == NONFINITE_TOKEN and not toks[n:].any()        # the NaN row flagged; padding rows give 0
    assert toks[2] >= 32 or (0x0F0F0F0F >> int(toks[2])) & 1      # the masked row drew an allowed token
