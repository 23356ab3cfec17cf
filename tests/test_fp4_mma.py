"""The ``fp4_mma`` layout (MXFP4 experts rearranged for the Hopper kernel's registers) on CPU.

What is checked here, against references independent of the layout code: the rearrangement is a lossless
permutation (round trip, byte count); the kernel's register arithmetic — modelled on the host by
``fp4_mma.decode_word`` / ``scale_multiplier`` with the same shifts and masks — gives, at the (row, column) the WGMMA
register layout assigns to each thread, exactly the value the OCP e2m1 / UE8M0 definitions give for the released
bytes; models holding experts in this layout compute bit-identical logits on the CPU path and save in the released
layout. The kernel itself runs on the H200 (tests/test_moe_kernel_gpu.py, ``-k mma``) and is lowered for CUDA here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dinfer_jax.models.qweights import (
    QuantizedWeight,
    abstract_quantized,
    dequantize,
    is_quantized,
    kernel_layout,
    released_layout,
    to_kernel_layout,
    tree_nbytes,
)
from helpers import e2m1_value
from pallas_kernels.moe import fp4_mma, reference


def _released(rng, lead, n, k):
    data = rng.integers(0, 256, (*lead, n, k // 2), dtype=np.uint8)
    sbits = rng.integers(100, 129, (*lead, n, k // 32), dtype=np.uint8)   # S ≤ 128: the kernel's documented range
    return data, sbits


def test_round_trip_is_identity_with_stacked_axes():
    rng = np.random.default_rng(0)
    data, sbits = _released(rng, (2, 3), 128, 192)
    packed, scale = fp4_mma.pack(jnp.asarray(data), jnp.asarray(sbits))
    assert packed.shape == (2, 3, 2, 12, 128) and scale.shape == (2, 3, 2, 3, 32)
    assert packed.nbytes + scale.nbytes == data.nbytes + sbits.nbytes
    back_data, back_s = fp4_mma.unpack(packed, scale)
    np.testing.assert_array_equal(np.asarray(back_data), data)
    np.testing.assert_array_equal(np.asarray(back_s), sbits)


def test_widths_must_be_multiples_of_64():
    with pytest.raises(ValueError, match="multiples of 64"):
        fp4_mma.pack(jnp.zeros((96, 32), jnp.uint8), jnp.zeros((96, 2), jnp.uint8))


def _bf16(bits: int) -> float:
    return float(np.array([bits & 0xFFFF], np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)[0])


def test_register_decode_gives_the_released_values():
    """Every thread's registers, decoded with the kernel's integer steps and multiplied by its bf16 scale pair,
    equal e2m1(code) · 2^(S−127) of the released bytes at the WGMMA layout's (row, column) for that register:
    thread t = 32w + 4g + c holds rows 16w + g (+8) and columns 2c, 2c+1 (+8) of each 16-column chunk."""
    rng = np.random.default_rng(1)
    n, k = 128, 128
    data, sbits = _released(rng, (), n, k)
    data[0, :8] = np.arange(16, dtype=np.uint8).reshape(8, 2) @ np.array([1, 16], np.uint8)  # all 16 codes
    table = np.array([e2m1_value(v) for v in range(16)])
    want = np.empty((n, k))
    want[:, 0::2], want[:, 1::2] = table[data & 15], table[data >> 4]
    want *= np.exp2(sbits.astype(np.float64) - 127).repeat(32, axis=1)

    words, swords = (np.asarray(a).view(np.uint32) for a in fp4_mma.pack(jnp.asarray(data), jnp.asarray(sbits)))
    got = np.full((n, k), np.nan)
    for rb in range(n // 64):
        for kb in range(k // 64):
            for t in range(128):
                w, lane = divmod(t, 32)
                g, c = divmod(lane, 4)
                sw = int(swords[rb, kb, 8 * w + g])
                for kc in range(4):
                    regs = fp4_mma.decode_word(int(words[rb, 4 * kb + w, 4 * lane + kc]))
                    for r, reg in enumerate(regs):
                        q0, q1 = r % 2, r // 2
                        mul = fp4_mma.scale_multiplier(sw, q0 + 2 * (kc // 2))
                        for h in range(2):
                            row = 64 * rb + 16 * w + g + 8 * q0
                            col = 64 * kb + 16 * kc + 8 * q1 + 2 * c + h
                            # bf16 product of two bf16 numbers whose significands are ≤ 2 bits: exact in float64
                            got[row, col] = _bf16(reg >> (16 * h)) * _bf16(mul >> (16 * h))
    np.testing.assert_array_equal(got, want)


def _mxfp4(rng, lead, n, k) -> QuantizedWeight:
    data, sbits = _released(rng, lead, n, k)
    return QuantizedWeight(jnp.asarray(data), jnp.asarray(sbits).view(jnp.float8_e8m0fnu), "fp4", (1, 32))


def test_quantized_weight_in_kernel_layout_dequantizes_identically():
    w = _mxfp4(np.random.default_rng(2), (4,), 128, 256)
    m = kernel_layout(w)
    assert (m.fmt, m.shape, m.nbytes) == ("fp4_mma", w.shape, w.nbytes)
    np.testing.assert_array_equal(np.asarray(dequantize(m)), np.asarray(dequantize(w)))
    np.testing.assert_array_equal(np.asarray(dequantize(m[1])), np.asarray(dequantize(w[1])))   # one expert
    back = released_layout(m)
    np.testing.assert_array_equal(np.asarray(back.data), np.asarray(w.data))
    assert abstract_quantized(w.shape, "fp4_mma", (1, 32)).data.shape == m.data.shape
    with pytest.raises(ValueError, match="fp4_mma weight must be"):
        QuantizedWeight(m.data[..., :64], m.scale, "fp4_mma", (1, 32))


def test_kernel_layout_is_applied_to_routed_experts_only():
    rng = np.random.default_rng(3)
    tree = {"layers": [{"ffn": {"experts": {"w1": _mxfp4(rng, (4,), 128, 256), "w2": _mxfp4(rng, (4,), 256, 64)},
                                "shared": {"w1": _mxfp4(rng, (), 128, 256)}}}]}
    out = to_kernel_layout(tree)
    ffn = out["layers"][0]["ffn"]
    assert ffn["experts"]["w1"].fmt == "fp4_mma"
    assert ffn["experts"]["w2"].fmt == "fp4"        # input width 64: the kernel's 256-wide K steps do not divide it
    assert ffn["shared"]["w1"].fmt == "fp4"         # not a routed expert
    assert tree_nbytes(out) == tree_nbytes(tree)


def _kernel_sized_cfg():
    from dinfer_jax.models import load_config
    from dinfer_jax.models.config import QuantConfig

    cfg = load_config("tiny-v4").replace(quantization=QuantConfig((128, 128), "ue8m0", "fp4"))
    return cfg.replace(hidden_size=256, moe_inter_dim=256)


def test_model_in_kernel_layout_gives_identical_logits_and_saves_released(tmp_path):
    from dinfer_jax.loading.orbax_io import restore_params, save_params
    from dinfer_jax.models import Model, forward_logits, random_model

    cfg = _kernel_sized_cfg()
    m = random_model(cfg, seed=5, include_mtp=False, weights="native", dtype="bfloat16")
    conv = Model(cfg, to_kernel_layout(m.params), m.dtype)
    fmts = {q.fmt for q in jax.tree_util.tree_leaves(conv.params, is_leaf=is_quantized) if is_quantized(q)}
    assert "fp4_mma" in fmts
    assert conv.param_bytes == m.param_bytes
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 12))
    np.testing.assert_array_equal(np.asarray(forward_logits(conv, ids)), np.asarray(forward_logits(m, ids)))
    save_params(tmp_path / "ckpt", cfg, conv.params, conv.dtype)
    _, restored, _ = restore_params(tmp_path / "ckpt")
    leaves = jax.tree_util.tree_leaves(restored, is_leaf=is_quantized)
    assert {q.fmt for q in leaves if is_quantized(q)} == {"fp8", "fp4"}


@pytest.mark.parametrize("assignments", [16 * 6, 8192 * 6])
def test_kernel_lowers_for_cuda_with_mma_weights(assignments):
    """The warp-specialised kernel reading fp4_mma weights (the table's tiles) lowers for CUDA on this CPU machine."""
    from pallas_kernels.moe.kernel_sm90 import experts_sm90
    from pallas_kernels.moe.tuning import configs_for

    g, d, i, k = 16, 1024, 512, 6
    n = assignments // k
    s = jax.ShapeDtypeStruct

    def w(o, inn):
        return reference.ExpertWeight(s((g, o // 64, inn // 16, 128), jnp.int32),
                                      s((g, o // 64, inn // 64, 32), jnp.int32), "fp4_mma")

    up, down = configs_for(assignments, hidden=d, inter=i)
    traced = jax.jit(experts_sm90, static_argnames=("swiglu_limit", "up_config", "down_config")).trace(
        s((n, d), jnp.bfloat16), s((n, k), jnp.int32), s((n, k), jnp.float32), w(i, d), w(i, d), w(d, i),
        swiglu_limit=10.0, up_config=up, down_config=down)
    assert traced.lower(lowering_platforms=("cuda",)).as_text().count("mosaic_gpu") >= 2


def test_loader_puts_experts_in_kernel_layout_as_it_stacks(tmp_path):
    """``load_model`` on a GPU applies the expert kernel's layout to each routed-expert weight as the loader places
    it (``_expert_kernel_leaf``), before stacking into scan layout: the result equals loading, stacking and then
    converting the whole tree (``to_kernel_layout``) bit for bit, with only routed experts in ``fp4_mma``."""
    from dinfer_jax.loading import load_params
    from dinfer_jax.loading.writer import write_release_checkpoint
    from dinfer_jax.models import _expert_kernel_leaf, random_model
    from dinfer_jax.models.layer_plan import stack_params

    cfg = _kernel_sized_cfg()
    write_release_checkpoint(cfg, random_model(cfg, seed=3, include_mtp=False).params, tmp_path, shard_bytes=1 << 20)
    got = load_params(tmp_path, cfg, dtype="bfloat16", weights="native", stacked=True, transform=_expert_kernel_leaf)
    want = to_kernel_layout(stack_params(cfg, load_params(tmp_path, cfg, dtype="bfloat16", weights="native")))
    got_q = jax.tree_util.tree_leaves(got, is_leaf=is_quantized)
    want_q = jax.tree_util.tree_leaves(want, is_leaf=is_quantized)
    assert [q.fmt for q in got_q if is_quantized(q)] == [q.fmt for q in want_q if is_quantized(q)]
    assert "fp4_mma" in {q.fmt for q in got_q if is_quantized(q)}
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))
