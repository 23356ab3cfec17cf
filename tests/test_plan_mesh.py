"""Mesh planner arithmetic (``sharding.plan``, ``scripts/plan_mesh.py``) on a tiny V4.1 preset, against
hand-computed byte counts."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest

from dinfer_jax.engine.kv_cache import bytes_per_block_and_slot
from dinfer_jax.models import load_config
from dinfer_jax.models.config import QuantConfig
from dinfer_jax.models.params import abstract_params
from dinfer_jax.models.qweights import tree_nbytes
from sharding import DEFAULT_RULES, ShardingRules, mesh_shape
from sharding.plan import engram_host_bytes, kv_bytes_per_device, plan, valid_layouts, weight_bytes_per_device

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cfg():
    # tiny-v41: D=64, 8 routed experts of I=32 in 12 layers, 3 DSpark blocks of 4 experts; released-style storage:
    # FP8 linears with 32×32 blocks, MXFP4 routed experts.
    return load_config("tiny-v41").replace(quantization=QuantConfig((32, 32), "ue8m0", "fp4"))


def test_valid_layouts_brute_force():
    for n in (1, 2, 6, 8, 12, 16):
        want = []
        for dp, cp, ep in itertools.product(range(1, n + 1), repeat=3):
            if dp * cp == n and n % ep == 0:
                try:
                    mesh_shape(dp, cp, ep)  # the mesh builder's own judge of validity
                except ValueError:
                    continue
                want.append((dp, cp, ep))
        assert valid_layouts(n) == want, n
    assert (2, 4, 8) in valid_layouts(8) and (3, 2, 3) not in valid_layouts(6)


def test_weight_bytes_hand_computed(cfg):
    # One MXFP4 expert matrix [o, i]: o·i/2 code bytes + o·(i/32) E8M0 scale bytes.
    def fp4(o, i):
        return o * i // 2 + o * (i // 32)

    per_expert = fp4(32, 64) + fp4(64, 32) + fp4(32, 64)  # w1 [I, D], w2 [D, I], w3 [I, D]
    assert per_expert == 3 * 1088  # 1024 code + 64 scale bytes each
    backbone_experts = 12 * 8 * per_expert  # 313344
    draft_experts = 3 * 4 * per_expert  # 39168
    total = tree_nbytes(abstract_params(cfg, weights="native"))
    rest = total - backbone_experts - draft_experts  # replicated on every device under the default rules
    for dp, cp, ep in valid_layouts(8):
        # the 4 draft experts split over ep ≤ 4 and stay whole at ep = 8 (4 experts cannot split 8 ways)
        draft = draft_experts // ep if 4 % ep == 0 else draft_experts
        assert weight_bytes_per_device(cfg, dp, cp, ep) == rest + backbone_experts // ep + draft, (dp, cp, ep)
    assert weight_bytes_per_device(cfg, 1, 1, 1, include_mtp=False) == total - tree_nbytes(
        abstract_params(cfg, weights="native")["mtp"])
    # Other rules: "embed" over the DP group as well; every weight with a D dimension then splits it over dp.
    rules = ShardingRules.from_dict({**DEFAULT_RULES, "embed": "dp"})
    assert weight_bytes_per_device(cfg, 2, 4, 4, rules) < weight_bytes_per_device(cfg, 2, 4, 4)


def test_kv_bytes_hand_computed(cfg):
    # bytes per token: V4.1 FP4 KV rows of d=64 (32 + 4 B) and FP4 index keys of di=32 (16 + 1 B) on the KV-source
    # layers 2, 4 (ratio 2) and 6 (ratio 1): 2·(36+17)/2 + (36+17)/1 = 106 B.
    _, per_slot = bytes_per_block_and_slot(cfg, 128, jnp.bfloat16)  # the port's ring bytes per sequence
    # 3 sequences of 300 tokens: 3 pages each + the null page; 3 slots + the null slot.
    assert kv_bytes_per_device(cfg, 300, 3) == (3 * 3 + 1) * 128 * 106 + 4 * per_slot
    assert kv_bytes_per_device(cfg, 0, 0) == 128 * 106 + per_slot
    flash = load_config("deepseek-v4.1-flash")  # 890 B per token (DeepInfer's figure), one page + the null page
    _, flash_slot = bytes_per_block_and_slot(flash, 128, jnp.bfloat16)
    assert kv_bytes_per_device(flash, 128, 1) == 2 * 128 * 890 + 2 * flash_slot
    with pytest.raises(ValueError, match="context"):
        kv_bytes_per_device(cfg, -1, 1)


def test_engram_and_plan(cfg):
    assert engram_host_bytes(cfg) == (420 + 508) * (32 + 1)  # FP8 rows of 32 + one E8M0 scale per 32 columns
    assert engram_host_bytes(load_config("tiny-v4")) == 0
    rows = plan(cfg, 8, hbm_bytes=10**12, context=300, batch=5)
    assert [(r.dp, r.cp, r.ep) for r in rows] == valid_layouts(8)
    for r in rows:
        assert r.seqs_per_engine == -(-5 // r.dp)
        assert r.kv_bytes == kv_bytes_per_device(cfg, 300, r.seqs_per_engine)
        assert r.weight_bytes == weight_bytes_per_device(cfg, r.dp, r.cp, r.ep)
        assert r.fits
    budget = weight_bytes_per_device(cfg, 8, 1, 8) + kv_bytes_per_device(cfg, 300, 1)
    tight = plan(cfg, 8, hbm_bytes=budget, context=300, batch=5)
    assert [r.fits for r in tight] == [r.device_bytes <= budget for r in tight]
    assert any(r.fits for r in tight) and not all(r.fits for r in tight)


def test_script_runs():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "plan_mesh.py"), "--model", "tiny-v41",
                          "--devices", "4", "--hbm-gb", "0.0003", "--context", "256", "--batch", "2"],
                         capture_output=True, text=True, check=True, env={"PYTHONPATH": str(ROOT),
                                                                          "JAX_PLATFORMS": "cpu", "PATH": ""}).stdout
    assert "| dp | cp | ep |" in out and out.count("\n| ") == len(valid_layouts(4)) + 1
    assert "layouts fit" in out
