"""Shared helpers of the test suite: reference-model builders and error metrics."""

from __future__ import annotations

import json
import math
import re
import struct
from fractions import Fraction
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from provision import INSTALL_HINT, missing, require_module


def require_reference() -> ModuleType:
    """Import torch + transformers 5.24.0 and return torch; a missing or other version is reported by
    :func:`provision.missing` (a skip locally, a failure under ``CI``).

    Other transformers versions differ in V4 numerics (5.17 casts RMSNorm differently), so they are no reference.
    """
    from dinfer_jax.reference.transformers_v4 import REFERENCE_TRANSFORMERS

    torch = require_module("torch")
    transformers = require_module("transformers")
    if transformers.__version__ != REFERENCE_TRANSFORMERS:
        missing(f"the reference transformers {REFERENCE_TRANSFORMERS} (found {transformers.__version__})", INSTALL_HINT)
    return torch


def rel_err(ours: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(max |error|, mean |error|) divided by the reference's scale max |ref|."""
    scale = float(np.abs(ref).max())
    err = np.abs(np.asarray(ours, np.float64) - np.asarray(ref, np.float64))
    return float(err.max()) / scale, float(err.mean()) / scale


# ---- device bytes of quantised weights vs the checkpoint's own headers ----

def _header(path: Path) -> dict:
    """The safetensors JSON header of ``path``, parsed here (u64 little-endian length, then JSON)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    return h


def _stored_tensors(directory: Path) -> dict[str, tuple[str, int, int]]:
    """name → (dtype string, element count, bytes) over all shards, from the headers alone."""
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        for name, info in _header(f).items():
            start, end = info["data_offsets"]
            out[re.sub(r"^model\.", "", name)] = (info["dtype"], math.prod(info["shape"]), end - start)
    return out


def _named_leaves(model) -> dict[str, object]:
    """Release name → device leaf (stacked experts under their ``{e}`` pattern)."""
    import jax

    from dinfer_jax.models.params import is_spec, param_specs
    from dinfer_jax.models.qweights import is_quantized

    specs = jax.tree_util.tree_leaves(param_specs(model.config, include_mtp=bool(model.params.get("mtp"))),
                                      is_leaf=is_spec)
    leaves = jax.tree_util.tree_leaves(model.params, is_leaf=is_quantized)
    assert len(specs) == len(leaves)
    return {s.ckpt: leaf for s, leaf in zip(specs, leaves, strict=False)}


def check_resident_bytes(model, directory: Path, host_only: str | None = None) -> None:
    """FP8/FP4 tensors stay resident as stored: every F8_E4M3/I8 weight is a QuantizedWeight of float8_e4m3fn /
    uint8 codes; param_bytes = the checkpoint's bytes except the 2 extra bytes per element of BF16 tensors the model
    keeps in fp32 (bf16 models: only those the spec promotes at load, compressor / gate / indexer weights_proj /
    norms)."""
    import jax.numpy as jnp

    from dinfer_jax.models.qweights import QuantizedWeight

    stored = _stored_tensors(directory)
    if host_only:
        stored = {k: v for k, v in stored.items() if not re.search(host_only, k)}
    leaves = _named_leaves(model)
    upcast_bytes, upcast_names = 0, []
    for pattern, leaf in leaves.items():
        names = [k for k in stored if re.fullmatch(re.escape(pattern).replace(r"\{e\}", r"\d+"), k)]
        assert names, pattern
        dtypes = {stored[n][0] for n in names}
        if dtypes <= {"F8_E4M3", "I8", "U8"}:
            assert isinstance(leaf, QuantizedWeight), f"{pattern} was materialised densely"
            assert leaf.data.dtype == (jnp.uint8 if dtypes != {"F8_E4M3"} else jnp.float8_e4m3fn)
        elif dtypes == {"BF16"} and leaf.dtype == jnp.float32:
            upcast_bytes += 2 * sum(stored[n][1] for n in names)
            upcast_names.append(pattern)
    promoted = re.compile(r"(compressor\.(wkv|wgate)|gate|weights_proj|norm|q_weight|k_weight)\.weight$|"
                          r"engram\.(q|k)_weight$")
    if model.dtype == "bfloat16":  # an fp32 model widens every BF16 tensor by choice
        assert all(promoted.search(n) for n in upcast_names), [n for n in upcast_names if not promoted.search(n)]
    scale_names = {k for k in stored if k.endswith(".scale")}
    assert scale_names, "the checkpoint should hold quantised tensors"
    assert model.param_bytes == sum(b for _, _, b in stored.values()) + upcast_bytes


def engine_models() -> dict[str, Any]:
    """The three models the engine tests serve, by name: random tiny V4 and V4.1 (weights large enough that every
    path matters) and the V4.1 golden fixture. Values are zero-argument builders (built once per test module)."""
    from dinfer_jax.models import load_config, load_model, random_model
    from provision import fixture_dir

    return {
        "v4-random": lambda: random_model(load_config("tiny-v4"), seed=3, std=0.1, include_mtp=False),
        "v41-random": lambda: random_model(load_config("tiny-v41"), seed=3, std=0.1, include_mtp=False),
        "v41-fixture": lambda: load_model(fixture_dir("v41-tiny")),
    }


def record_step_shapes(llm: Any) -> list[tuple[str, tuple[int, int, int]]]:
    """Wrap ``llm.runner.dispatch`` (on this engine object only) to record each dispatched step's kind and compiled
    bucket ``(B, Q, P)``; returns the list it appends to."""
    seen: list[tuple[str, tuple[int, int, int]]] = []
    inner = llm.runner.dispatch

    def dispatch(step, params, seeds, **kw):
        out = inner(step, params, seeds, **kw)
        seen.append((step.kind, out.shape))
        return out

    llm.runner.dispatch = dispatch
    return seen


def e2m1_value(nibble: int) -> float:
    """OCP MX FP4 E2M1: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0 is subnormal (m/2)."""
    s, e, m = nibble >> 3, (nibble >> 1) & 0x3, nibble & 0x1
    mag = m / 2 if e == 0 else math.ldexp(1 + m / 2, e - 1)
    return -mag if s else mag


def gpu_device() -> Any:
    """The first GPU device; skips the calling test when there is none (the ``gpu``-marked kernel tests)."""
    import jax
    import pytest

    try:
        devs = [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:
        devs = []
    if not devs:
        pytest.skip("no GPU backend")
    return devs[0]


_M64 = (1 << 64) - 1


def u53_host(seed: int, pos: int, case: int = 0) -> int:
    """Pure-Python SplitMix64 counter hash of DeepInfer's sampler (independent of the code under test): the
    53-bit integer ``k`` with ``u = k / 2**53``."""
    g = 0x9E3779B97F4A7C15
    seq = ((pos * 3 + case) * g) & _M64
    z = (seed + (seq ^ ((seq << 13) & _M64))) & _M64
    z = (z + g) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return (z ^ (z >> 31)) >> 11


def uncertifiable_rows(rng: np.random.Generator, count: int, n_tiny: int = 4096,
                       width: int = 4100) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """``count`` probability rows ``[count, width]`` f32 built around each row's own uniform so that its target
    falls between torch's rounded fp64 prefix sum and the exact real one (``n_tiny`` absorbed 2**-57 addends after
    three leading entries, then 1.0): the exact-real-sum answer is wrong there, so a vocabulary-parallel search
    cannot certify the row. Returns ``(probs, seeds [count] uint64, positions [count] int32, n_tiny)``; the
    reference token of every row is ``3 + n_tiny`` (checked by the callers against DeepInfer's reference)."""
    tiny = 2.0**-57
    rows, seeds, poss = [], [], []
    while len(rows) < count:
        seed, pos = int(rng.integers(0, 2**64, dtype=np.uint64)), int(rng.integers(0, 2**31))
        u = Fraction(u53_host(seed, pos), 2**53)
        if not Fraction(1, 5) < u < Fraction(7, 10):
            continue
        w = n_tiny * Fraction(tiny)
        s_a = (u - w / 2) / (1 - u)
        parts, rest = [], s_a
        for _ in range(3):  # s_a ~ a1 + a2 + a3, each fp32 rounded down so the row stays non-negative
            a = np.float32(float(rest))
            if Fraction(float(a)) > rest:
                a = np.nextafter(a, np.float32(0))
            parts.append(a)
            rest -= Fraction(float(a))
        row = np.zeros(width, np.float32)
        row[:3] = parts
        row[3:3 + n_tiny] = tiny
        row[3 + n_tiny] = 1.0
        cdf = np.cumsum(row.astype(np.float64))  # torch's sequential fp64 cumsum
        torch_idx = int(np.argmax(cdf > float(u) * cdf[-1]))
        # first index whose exact real prefix sum exceeds u * (exact total), in closed form for this layout
        exact = [Fraction(float(a)) for a in parts]
        a_sum = sum(exact)
        target = u * (a_sum + w + 1)
        if target < a_sum:
            naive_idx = next(j for j in range(3) if sum(exact[: j + 1]) > target)
        elif target < a_sum + w:
            naive_idx = 3 + math.floor((target - a_sum) / Fraction(tiny))
        else:
            naive_idx = 3 + n_tiny
        if torch_idx != naive_idx:
            rows.append(row)
            seeds.append(seed)
            poss.append(pos)
    return np.stack(rows), np.array(seeds, np.uint64), np.array(poss, np.int32), n_tiny
