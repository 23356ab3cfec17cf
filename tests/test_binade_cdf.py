"""The binade-by-binade exact CDF inversion (``sampling._binadecdf``) against float64 arithmetic done by numpy.

``np.cumsum`` of a float64 row is a sequential left-to-right sum, which ``test_sampling`` checks bit for bit
against torch's (DeepInfer's reference); the target is ``(k * 2**-53) * total`` in IEEE float64 (exact product, one
rounding: ``test_sampling`` checks ``_f64.mul_u53`` against it). Targets are placed within a few units of
``2**-53 * total`` of a chosen prefix sum, so the answer depends on every rounding of the running sum (ties to
even, absorbed addends, binade crossings); a reference that summed exactly, or in another order, would differ.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.sampling._binadecdf import binade_rows, binade_search
from dinfer_jax.sampling._u64 import U64


def _u64(k: np.ndarray) -> U64:
    k = k.astype(np.uint64)
    return U64(jnp.asarray((k >> np.uint64(32)).astype(np.uint32)),
               jnp.asarray((k & np.uint64(0xFFFFFFFF)).astype(np.uint32)))


def _boundary_targets(rng: np.random.Generator, probs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row a 53-bit ``k`` whose target lands within a few ulps of a random prefix sum (edge values on some
    rows), and the reference answer: first j with cumsum[j] > t, 0 if none."""
    n, v = probs.shape
    cs = np.cumsum(probs.astype(np.float64), axis=1)
    total = cs[:, -1]
    j = rng.integers(0, v, n)
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = np.where(total > 0, cs[np.arange(n), j] / total, 0.0)
    k = np.floor(frac * 2.0**53).astype(np.int64) + rng.integers(-3, 4, n)
    k[:: 11] = 2**53 - 1
    k[5:: 13] = 0
    k = np.clip(k, 0, 2**53 - 1).astype(np.uint64)
    t = (k.astype(np.float64) * 2.0**-53) * total
    return k, np.argmax(cs > t[:, None], axis=1).astype(np.int32)


def _rows(rng: np.random.Generator, v: int) -> np.ndarray:
    """Rows whose sequential fp64 sum rounds in every way."""
    f32 = np.float32
    rows = [rng.random(v).astype(f32)]  # flat
    r = np.zeros(v, f32)
    r[0], r[1], r[2:] = 1.0, 2.0**-52, 2.0**-53  # a tie at every step, alternating with the mantissa's parity
    rows.append(r)
    r = np.full(v, f32(2.0**-55))
    r[::7] = 0.75  # absorbed addends between large ones
    rows.append(r)
    rows.append(f32(2.0) ** -(np.arange(v) % 60).astype(f32))  # a binade crossing at nearly every step
    rows.append(f32(2.0) ** (np.arange(v) % 200 - 100).astype(f32))  # growing addends: many crossings
    r = np.full(v, f32(1.4e-45))  # the smallest subnormal, then one large entry
    r[v // 2] = 1.0
    rows.append(r)
    rows.append((rng.random(v) * 2.0 ** rng.integers(-149, 100, v)).astype(f32))  # every magnitude
    rows.append(f32(1 + 2.0**-23) * np.ones(v, f32))  # odd mantissas: ties at large sums
    r = np.zeros(v, f32)
    r[v - 1] = 3.0  # zeros, then one entry at the end
    rows.append(r)
    r = np.full(v, f32(2.0**-52))  # a binade entered on an odd mantissa (2 + 3 * 2**-51), then ties from there
    r[:4] = [1.0, 2.0**-51, 2.0**-50, 1.0]
    r[6::3] = (rng.random(len(r[6::3])) * 2.0**-40).astype(f32)
    rows.append(r)
    rows.append(np.zeros(v, f32))  # all zero: the answer is 0
    r = rng.random(v).astype(f32)
    r[: v // 3] = 0.0  # a run of zeros first
    r[rng.random(v) < 0.3] = -0.0  # negative zero reads as 0
    rows.append(r)
    return np.stack(rows)


def test_binade_search_matches_sequential_fp64_at_boundaries() -> None:
    rng = np.random.default_rng(11)
    base = _rows(rng, 1000)
    probs = np.concatenate([base] * 24)  # every row kind against 24 targets
    k, want = _boundary_targets(rng, probs)
    bits = jax.lax.bitcast_convert_type(jnp.asarray(probs), jnp.uint32)
    got = np.asarray(jax.jit(binade_search)(bits, _u64(k)))
    np.testing.assert_array_equal(got, want)


def test_binade_search_full_vocabulary() -> None:
    """V = 129280 (the V4 vocabulary): softmax rows of standard normal logits (what a random-weight model gives,
    ~18 binades) and a Zipf-like row, targets next to prefix sums."""
    rng = np.random.default_rng(12)
    v = 129280
    logits = rng.standard_normal((6, v)).astype(np.float32)
    logits[5] = -1.5 * np.log(rng.permutation(v) + 1.0)
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs = (probs / probs.sum(1, keepdims=True)).astype(np.float32)
    k, want = _boundary_targets(rng, probs)
    bits = jax.lax.bitcast_convert_type(jnp.asarray(probs), jnp.uint32)
    np.testing.assert_array_equal(np.asarray(jax.jit(binade_search)(bits, _u64(k))), want)


@pytest.mark.parametrize("todo_kind", ["none", "one", "some", "all"])
def test_binade_rows_computes_only_the_rows_asked(todo_kind: str) -> None:
    """The compacted, chunked form: rows in ``todo`` get the exact answer (several chunks of 8 when many), the
    others 0 — whatever their position among 27 rows."""
    rng = np.random.default_rng(13)
    probs = np.concatenate([_rows(rng, 300)] * 3)[:27]
    k, want = _boundary_targets(rng, probs)
    n = len(probs)
    todo = {"none": np.zeros(n, bool), "one": np.arange(n) == 17, "some": rng.random(n) < 0.6,
            "all": np.ones(n, bool)}[todo_kind]
    bits = jax.lax.bitcast_convert_type(jnp.asarray(probs), jnp.uint32)
    got = np.asarray(jax.jit(binade_rows)(bits, _u64(k), jnp.asarray(todo)))
    np.testing.assert_array_equal(got, np.where(todo, want, 0))


def test_binade_entered_on_an_odd_mantissa() -> None:
    """1 + 2**-51 + 2**-50 then + 1 enters the binade [2, 4) on the odd mantissa 2 + 3 * 2**-51; the next addend,
    2**-52, is exactly half its ulp, so torch rounds to even — up, to 2 + 4 * 2**-51. A pass that forgot its
    starting parity would round down; targets on both sides of that sum tell the two apart."""
    v = 1000
    row = np.full(v, np.float32(2.0**-52))
    row[:4] = [1.0, 2.0**-51, 2.0**-50, 1.0]
    cs = np.cumsum(row.astype(np.float64))
    assert float.hex(cs[3]) == "0x1.0000000000003p+1" and float.hex(cs[4]) == "0x1.0000000000004p+1"
    k = np.array([int(np.floor(cs[j] / cs[-1] * 2.0**53)) + d for j in (3, 4, 500) for d in range(-4, 5)], np.uint64)
    want = np.argmax(cs > ((k.astype(np.float64) * 2.0**-53) * cs[-1])[:, None], axis=1)
    assert set(want) == {0, 3, 4}  # both roundings are visible in the answers
    bits = jax.lax.bitcast_convert_type(jnp.asarray(np.repeat(row[None], len(k), 0)), jnp.uint32)
    np.testing.assert_array_equal(np.asarray(jax.jit(binade_search)(bits, _u64(k))), want)
