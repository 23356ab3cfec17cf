"""DSpark drafter (``docs/spec/model-v41.md`` §3.8; DeepInfer ``DFlash``): DeepInfer's ``_ref`` twins, shapes, and
independent checks of the draft formulas on the random tiny-v41 model.

Compile budget (2-core CPU): one target forward (collect=True, ~12 s) shared by every test through the module
fixture, and a handful of draft-block compiles (~4 s each); every draft call below goes through ``_draft`` with the
same static arguments so the compiled function is reused.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from deepinfer_refs import load_ref, require_refs
from dinfer_jax.models import abstract_params, load_config, random_model
from dinfer_jax.models import dspark as ds
from dinfer_jax.models.fake_quant import q8_fake
from provision import require_module

torch = require_module("torch")

OPS = "deepinfer/model_executor/layers/tilelang_ops/"
S = 24
LENGTHS = (24, 9)  # anchors a = 23 (full window) and a = 8 (< W − 1: start of a sequence)


@pytest.fixture(scope="module")
def tiny() -> SimpleNamespace:
    cfg = load_config("tiny-v41")
    model = random_model(cfg, seed=0)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, S))
    pd = ds.draft_after_prefix(model, None, ids, lengths=LENGTHS, collect=True)
    return SimpleNamespace(cfg=cfg, model=model, ids=ids, pd=pd, params=model.params)


def _draft(t: SimpleNamespace, keys=None, anchor=None, golden=None, block_tokens=None, cfg=None, sample_fn=None):
    """draft_block_jit with fixed static arguments (one compile per (cfg, sample_fn)); block tokens explicit."""
    cfg = cfg or t.cfg
    golden = t.pd.golden if golden is None else golden
    if block_tokens is None:
        block_tokens = ds.block_input_ids(cfg, golden)
    return ds.draft_block_jit(t.params, cfg, t.pd.main_keys if keys is None else keys,
                              t.pd.anchor_pos if anchor is None else anchor, golden, dtype="float32",
                              temperature=1.0, sample_fn=sample_fn, block_tokens=block_tokens, moe_impl="ragged")


def _const_sampler(logits, step):  # module-level so that its compile is cached across tests
    del step
    return jnp.full(logits.shape[:1], 5, jnp.int32)


# --- (a) DeepInfer references ---------------------------------------------------------------------------------------


def test_target_features_match_dflash_input_store_ref(tiny):
    """forward_v41's dspark_features vs DeepInfer's ``dflash_input_store_ref`` (fp32 mean over the hc streams, copied
    into the output dtype) on the trunk entering each target layer. ``hidden_states[l]`` is the trunk *before*
    layer l's Engram gate, so this needs target layers without Engram (true for tiny-v41: 9–11 vs 1, 4).
    fp32 model: our mean and torch's mean of 4 fp32 values may sum in a different order → ≤ 1 ulp (rtol 1e-6)."""
    require_refs()
    store = load_ref(OPS + "dflash.py", "dflash_input_store_ref")
    cfg, inter = tiny.cfg, tiny.pd.target.intermediates
    assert not set(cfg.dspark_target_layer_ids) & set(cfg.engram_layer_ids)
    hs = np.asarray(inter["hidden_states"])  # [L+1,B,S,n,D]
    feats = np.asarray(inter["dspark_features"])
    D = cfg.hidden_size
    assert feats.shape == (2, S, len(cfg.dspark_target_layer_ids) * D)
    for j, layer in enumerate(cfg.dspark_target_layer_ids):
        streams = torch.from_numpy(np.array(hs[layer]).reshape(2 * S, cfg.hc_mult, D))
        out = torch.empty(2 * S, D, dtype=torch.float32)
        store(streams, out)
        np.testing.assert_allclose(feats[..., j * D:(j + 1) * D].reshape(2 * S, D), out.numpy(), rtol=1e-6,
                                   atol=1e-7)


@pytest.mark.parametrize("n_embed,rank", [(64, 8), (512, 256)])
def test_confidence_head_matches_ref(n_embed, rank):
    """confidence_head vs ``confidence_head_fused_ref`` fed the way ``DFlash`` feeds it: the bf16 weight
    (``proj.weight.to(bfloat16)``) as ``[D+r, 1]`` and T clamped to ≥ SAMPLING_EPS (``ConfidenceHead.__init__``).
    Rows are scaled up to 1e3 and T goes down to 1e−9 so that z/T crosses the ±60 clamp (where an unclamped fp32
    sigmoid would give exactly 0). Both are fp32 dots of the same fp32 values in a different summation order:
    atol 1e-6 on probabilities."""
    require_refs()
    ref = load_ref(OPS + "dflash.py", "confidence_head_fused_ref")
    eps = load_ref("deepinfer/sampling_params.py", "SAMPLING_EPS")
    assert eps == ds.SAMPLING_EPS
    rng = np.random.default_rng(n_embed)
    N = 37
    scale = 10.0 ** rng.uniform(-2, 3, (N, 1))
    h = (rng.standard_normal((N, n_embed)) * scale).astype(ml_dtypes.bfloat16)
    e = rng.standard_normal((N, rank)).astype(ml_dtypes.bfloat16)
    w = (rng.standard_normal((1, n_embed + rank)) * 0.05).astype(np.float32)  # fp32 checkpoint parameter
    w_di = torch.from_numpy(w).to(torch.bfloat16).reshape(-1, 1).contiguous()
    fn = jax.jit(ds.confidence_head, static_argnames="temperature")
    z = np.concatenate([h, e], -1).astype(np.float64) @ w_di.float().numpy()[:, 0].astype(np.float64)
    saw_clamp = False
    for T in (1.0, 0.85, 1e-9):
        ours = np.asarray(fn(jnp.asarray(h), jnp.asarray(e), jnp.asarray(w), temperature=T))
        theirs = ref(torch.from_numpy(h.astype(np.float32)).to(torch.bfloat16), w_di, max(T, eps),
                     torch.from_numpy(e.astype(np.float32)).to(torch.bfloat16)).numpy()
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6)
        low = z / max(T, eps) < -61  # clamped to −60: sigmoid = 1/(1 + e^60) ≈ 8.8e−27, not 0
        np.testing.assert_allclose(ours[low], 1 / (1 + np.exp(60.0)), rtol=1e-5)
        saw_clamp |= bool(low.any())
    assert saw_clamp


def test_block_positions_match_fused_dflash_get_input_ref():
    """Positions of the draft rows and of the shared key list vs ``get_fused_dflash_get_input_ref`` with an SWA ring
    big enough that ring slot = position (state offset 0), so its ``kv_index`` holds positions (−1 = none)."""
    require_refs()
    ref = load_ref(OPS + "get_kv_index.py", "get_fused_dflash_get_input_ref")
    W, blk, ring = 16, 5, 4096
    # Flat target tokens of 4 requests: decode rows at 23, 8, 0 and a 3-token verify run 20..22 of which 2 extra
    # tokens were accepted (last_valid_offset 2 → a = 22).
    positions = torch.tensor([23, 8, 0, 20, 21, 22], dtype=torch.int32)
    ftp = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    lvo = torch.tensor([0, 0, 0, 2], dtype=torch.int32)
    _, pos_out, _, _, _, kv_index = ref(positions.clone(), positions, ftp, lvo, ring, blk, W)
    anchors = jnp.array([23, 8, 0, 22])
    rows, keys = ds.block_positions(anchors, W, blk)
    np.testing.assert_array_equal(np.asarray(rows).reshape(-1), pos_out.numpy())
    kv = kv_index.numpy().reshape(4, blk, -1)
    assert (kv == kv[:, :1]).all()  # one key list shared by the block's rows
    np.testing.assert_array_equal(kv[:, 0, :W + blk], np.asarray(keys))
    assert (kv[:, 0, W + blk:] == -1).all()  # padding up to a multiple of 64


# --- (b) shapes -----------------------------------------------------------------------------------------------------


def test_tiny_shapes_and_prefix_draft(tiny):
    cfg, pd = tiny.cfg, tiny.pd
    d, blk, V = pd.draft, cfg.dspark_block_size, cfg.vocab_size
    assert d.logits.shape == (2, blk, V) and d.logits.dtype == jnp.float32
    assert d.confidences.shape == (2, blk) and d.confidences.dtype == jnp.float32
    assert d.tokens.shape == (2, blk) and d.tokens.dtype == jnp.int32
    assert d.hidden.shape == (2, blk, cfg.hidden_size)
    assert pd.main_keys.shape == (cfg.n_mtp_layers, 2, S, cfg.head_dim)
    np.testing.assert_array_equal(pd.anchor_pos, np.array(LENGTHS) - 1)
    logits = np.asarray(pd.target.logits)
    np.testing.assert_array_equal(pd.golden, logits[[0, 1], np.array(LENGTHS) - 1].argmax(-1))
    assert np.isfinite(np.asarray(d.logits)).all() and np.isfinite(np.asarray(d.confidences)).all()
    # The default block input [golden, noise × 4] is what _draft passes explicitly (and the same draft comes out).
    again = _draft(tiny)
    for x, y in zip(d, again, strict=True):
        np.testing.assert_array_equal(x, y)


def test_flash_shapes_eval_shape():
    """The DeepSeek-V4.1-Flash preset traced abstractly (no allocation)."""
    cfg = load_config("deepseek-v4.1-flash")
    ap = abstract_params(cfg, jnp.bfloat16)
    D, V, blk = cfg.hidden_size, cfg.vocab_size, cfg.dspark_block_size
    assert (D, V, blk, cfg.sliding_window, cfg.n_mtp_layers) == (5120, 129280, 5, 128, 3)
    assert ap["mtp"][0]["main_proj"].shape == (D, 3 * D)
    assert ap["mtp"][-1]["markov_embed"].shape == (V, 256) and ap["mtp"][-1]["confidence_proj"].shape == (1, D + 256)
    assert ap["mtp"][0]["ffn"]["experts"]["w1"].shape[0] == 128
    B, P = 2, 200
    feats = jax.ShapeDtypeStruct((B, P, 3 * D), jnp.bfloat16)
    keys = jax.eval_shape(lambda p, f: ds.main_keys(p, cfg, f, jnp.arange(P), "bfloat16"), ap, feats)
    assert keys.shape == (3, B, P, cfg.head_dim) and keys.dtype == jnp.bfloat16
    out = jax.eval_shape(lambda p, k, a, g: ds.draft_block(p, cfg, k, a, g, dtype="bfloat16"), ap, keys,
                         jax.ShapeDtypeStruct((B,), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32))
    assert out.logits.shape == (B, blk, V) and out.logits.dtype == jnp.float32
    assert out.confidences.shape == (B, blk) and out.confidences.dtype == jnp.float32
    assert out.tokens.shape == (B, blk) and out.tokens.dtype == jnp.int32
    assert out.hidden.shape == (B, blk, D) and out.hidden.dtype == jnp.bfloat16


# --- (c) independent checks of the draft formulas -------------------------------------------------------------------


def _np_rope_main(x: np.ndarray, pos: np.ndarray, r: int, theta: float) -> np.ndarray:
    inv = 1.0 / theta ** (np.arange(0, r, 2) / r)
    ang = pos[:, None] * inv[None, :]
    c, s = np.cos(ang), np.sin(ang)
    y = x.copy()
    x0, x1 = x[..., -r::2], x[..., -r + 1::2]
    y[..., -r::2] = x0 * c - x1 * s
    y[..., -r + 1::2] = x0 * s + x1 * c
    return y


def _np_rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def test_main_keys_formula_and_q8(tiny):
    """main_keys vs a float64 numpy recomputation with the *main* RoPE (rope_theta, no YaRN) before quantisation
    (fp32 vs fp64: 1e-4 relative to the key scale), and the Q8 keys are exactly Q8 of those (DeepInfer's
    ``update_main_cache`` casts them to e4m3 with UE8M0 per-32 scales like every SWA key)."""
    cfg, p = tiny.cfg, tiny.params
    feats = tiny.pd.target.intermediates["dspark_features"]
    noq = ds.main_keys_jit(p, cfg.replace(kv_fake_quant=False), feats, jnp.arange(S), dtype="float32")
    F = np.asarray(feats, np.float64)
    g = lambda x: np.asarray(x, np.float64)  # noqa: E731
    m = _np_rms(F @ g(p["mtp"][0]["main_proj"]).T, g(p["mtp"][0]["main_norm"]), cfg.norm_eps)
    for i, blk in enumerate(p["mtp"]):
        k = _np_rms(m @ g(blk["attn"]["wkv"]).T, g(blk["attn"]["kv_norm"]), cfg.norm_eps)
        k = _np_rope_main(k, np.arange(S, dtype=np.float64), cfg.rope_head_dim, cfg.rope_theta)
        np.testing.assert_allclose(np.asarray(noq[i]), k, rtol=0, atol=1e-4 * np.abs(k).max())
    assert cfg.kv_fake_quant
    np.testing.assert_array_equal(tiny.pd.main_keys, q8_fake(noq, 32))


def _np_heads(p, cfg, h, golden, tokens, temps):
    """float64 numpy heads given the hidden h and the drawn tokens (Markov input = previous token, golden first)."""
    last = {k: np.asarray(v, np.float64) for k, v in p["mtp"][-1].items() if k in
            ("norm", "markov_embed", "markov_head", "confidence_proj")}
    w_conf = np.asarray(jnp.asarray(p["mtp"][-1]["confidence_proj"]).astype(jnp.bfloat16), np.float64)[0]
    h = np.asarray(h, np.float64)
    base = _np_rms(h, last["norm"], cfg.norm_eps) @ np.asarray(p["head"], np.float64).T
    prev = np.concatenate([np.asarray(golden)[:, None], np.asarray(tokens)[:, :-1]], 1)  # t_{i−1}
    e = last["markov_embed"][prev]  # [B,blk,r]
    logits = base + e @ last["markov_head"].T
    z = np.concatenate([h, e], -1) @ w_conf / np.asarray(temps)[None, :]
    return logits, 1.0 / (1.0 + np.exp(-np.clip(z, -60, 60)))


def test_markov_recurrence_and_confidence(tiny):
    """Greedy and a constant sampler: h does not depend on sampling; logits / confidences equal a float64 numpy
    recomputation from h with e_i = markov_embed[t_{i−1}], t_{−1} = golden (the sampled token, not the argmax, feeds
    the next row); confidences read the un-normalised h. fp32 vs fp64 → atol 1e-5 × max|logit|, 1e-6 on
    probabilities. Per-step temperatures go through dspark_heads directly."""
    cfg, p, pd = tiny.cfg, tiny.params, tiny.pd
    g, c = pd.draft, _draft(tiny, sample_fn=_const_sampler)
    np.testing.assert_array_equal(g.hidden, c.hidden)
    np.testing.assert_array_equal(g.tokens, np.asarray(g.logits).argmax(-1))
    assert (np.asarray(c.tokens) == 5).all()
    assert not np.array_equal(g.logits[:, 1:], c.logits[:, 1:])  # the Markov term follows the drawn tokens
    np.testing.assert_array_equal(g.logits[:, 0], c.logits[:, 0])  # row 0 reads golden either way
    for out in (g, c):
        lg, cf = _np_heads(p, cfg, out.hidden, pd.golden, out.tokens, [1.0] * cfg.dspark_block_size)
        np.testing.assert_allclose(out.logits, lg, rtol=0, atol=1e-5 * np.abs(lg).max())
        np.testing.assert_allclose(out.confidences, cf, rtol=0, atol=1e-6)
    temps = (1.0, 0.5, 0.25, 2.0, 1e-3)
    heads = jax.jit(ds.dspark_heads, static_argnames=("cfg", "temperature", "sample_fn"))
    lg2, cf2, tk2 = heads(p, cfg, g.hidden, pd.golden, temperature=temps)
    np.testing.assert_array_equal(lg2, g.logits)
    np.testing.assert_array_equal(tk2, g.tokens)
    _, cf = _np_heads(p, cfg, g.hidden, pd.golden, g.tokens, temps)
    np.testing.assert_allclose(cf2, cf, rtol=0, atol=1e-6)


def test_block_is_bidirectional(tiny):
    """Changing only the last row's input token changes row 0's hidden (every row sees every draft key); changing
    golden changes everything."""
    cfg, pd = tiny.cfg, tiny.pd
    base = pd.draft
    tok = ds.block_input_ids(cfg, pd.golden)
    np.testing.assert_array_equal(tok[:, 1:], cfg.dspark_noise_token_id)
    moved = _draft(tiny, block_tokens=tok.at[:, -1].set(3))
    diff = np.abs(np.asarray(moved.hidden) - np.asarray(base.hidden)).max(-1)  # [B,blk]
    assert (diff > 1e-6).all(), diff


def test_window_of_main_keys(tiny):
    """The drafter reads main keys at positions a−W+1 … a only: perturbing features older than a−W+1 (request 0,
    a = 23) or newer than a (request 1, a = 8) leaves the draft bitwise unchanged; perturbing a, a−W+1 (request 0)
    or position 0 (request 1, inside its short window) changes it. A compressed or unwindowed path would see the old
    positions, so this also shows the draft layers use no compressed KV."""
    cfg, p, pd = tiny.cfg, tiny.params, tiny.pd
    W = cfg.sliding_window
    feats = np.asarray(pd.target.intermediates["dspark_features"])

    def draft_with(b: int, positions) -> np.ndarray:
        f = feats.copy()
        f[b, positions] += 3.0
        keys = ds.main_keys_jit(p, cfg, jnp.asarray(f), jnp.arange(S), dtype="float32")
        out = _draft(tiny, keys=keys)
        return np.asarray(out.hidden), np.asarray(out.logits)

    ref_h = np.asarray(pd.draft.hidden)
    a0, a1 = LENGTHS[0] - 1, LENGTHS[1] - 1
    h, lg = draft_with(0, list(range(a0 - W + 1)))
    np.testing.assert_array_equal(h, ref_h)
    np.testing.assert_array_equal(lg, pd.draft.logits)
    h, _ = draft_with(1, list(range(a1 + 1, S)))
    np.testing.assert_array_equal(h, ref_h)
    for b, pos in ((0, [a0]), (0, [a0 - W + 1]), (1, [0])):
        h, _ = draft_with(b, pos)
        assert np.abs(h[b] - ref_h[b]).max() > 1e-6, (b, pos)
        np.testing.assert_array_equal(h[1 - b], ref_h[1 - b])  # requests are independent


def test_draft_layers_use_main_rope_only(tiny):
    """Changing the compressed layers' RoPE (theta and YaRN) changes nothing in the drafter; changing the main
    rope_theta changes the draft even with the same main keys (queries and draft keys use the main RoPE). The draft
    blocks carry no compressor / indexer parameters."""
    cfg, p, pd = tiny.cfg, tiny.params, tiny.pd
    for blk in p["mtp"]:
        assert set(blk["attn"]) == {"wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "wo_a", "wo_b", "attn_sink"}
    other_c = cfg.replace(compress_rope_theta=777.0, yarn=None)
    keys = ds.main_keys_jit(p, other_c, pd.target.intermediates["dspark_features"], jnp.arange(S), dtype="float32")
    np.testing.assert_array_equal(keys, pd.main_keys)
    np.testing.assert_array_equal(_draft(tiny, cfg=other_c).hidden, pd.draft.hidden)
    moved = _draft(tiny, cfg=cfg.replace(rope_theta=777.0))
    assert np.abs(np.asarray(moved.hidden) - np.asarray(pd.draft.hidden)).max() > 1e-6
