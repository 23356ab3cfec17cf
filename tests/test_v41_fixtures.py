"""DeepSeek-V4.1 against the golden fixtures of the HF reference (``tests/data/fixtures/v41-tiny*``).

Tolerance (the issue's bound): max |error| ≤ 1e-2 × max |reference logit| and argmax agreement ≥ 99%. The model
fake-quantises SWA KV (FP8), compressed KV (FP4, e4m3 scales) and indexer Q/K (FP4): a rounding-order difference
of 1 ulp before a quantiser can flip one FP4 bin, which moves a logit by ~1e-3 relative, so 1e-2 is the budget for
rare flips while a wrong formula moves logits by O(1e-1). The fixtures were generated so that no top-k boundary is
an exact tie (their README's audit), so selections must match.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import rel_err
from provision import FIXTURES_DIR, fixture_dir

TINY, QUANT = FIXTURES_DIR / "v41-tiny", FIXTURES_DIR / "v41-tiny-quant"


@pytest.fixture(autouse=True, scope="module")
def _fixtures_present() -> None:
    fixture_dir("v41-tiny")
    fixture_dir("v41-tiny-quant")


@pytest.fixture(scope="module")
def tiny_model():
    from dinfer_jax.models import load_model

    return load_model(TINY)


def _check_logits(ours: np.ndarray, ref: np.ndarray, label: str) -> None:
    max_rel, mean_rel = rel_err(ours, ref)
    agree = (ours.argmax(-1) == ref.argmax(-1)).mean()
    print(f"{label}: max rel err {max_rel:.2e}, mean {mean_rel:.2e}, argmax agreement {agree:.3%}")
    assert max_rel <= 1e-2, f"{label}: max rel err {max_rel:.3e}"
    assert agree >= 0.99, f"{label}: argmax agreement {agree:.3%}"


def _check_prompts(model, ref, name: str) -> None:
    """Each of the fixture's three prompts (40, 57, 130 tokens) against its reference logits, from one causal
    forward over the prompts right-padded to a common length (one compile: a row's logits at position t see only
    its tokens ≤ t, so the first len(prompt) positions are the prompt's own forward)."""
    from dinfer_jax.models import forward_logits

    ids = [ref[f"input_ids_{i}"] for i in range(3)]
    S = max(len(x) for x in ids)
    logits = forward_logits(model, np.stack([np.concatenate([x, np.full(S - len(x), x[-1], x.dtype)]) for x in ids]))
    for i, x in enumerate(ids):
        _check_logits(logits[i, :len(x)], ref[f"logits_{i}"], f"{name} prompt {i} (S={len(x)})")


def test_tiny_logits_match_reference(tiny_model):
    _check_prompts(tiny_model, np.load(TINY / "reference.npz"), "v41-tiny")


def test_tiny_trunk_and_premix_match_reference(tiny_model):
    """Layer-by-layer: mHC streams after every layer, the shifted pre-mix carried between layers, final hidden."""
    from dinfer_jax.models import inspect

    ref = np.load(TINY / "reference.npz")
    out = inspect(tiny_model, ref["input_ids_0"][None])
    for layer in range(ref["hidden_0"].shape[0]):
        err, _ = rel_err(out["hidden_states"][layer, 0], ref["hidden_0"][layer])
        assert err <= 1e-2, f"streams after layer {layer - 1}: rel err {err:.2e}"
        perr, _ = rel_err(out["premix"][layer, 0], ref["premix_0"][layer])
        assert perr <= 1e-2, f"premix {layer}: rel err {perr:.2e}"
    assert rel_err(out["final_hidden"][0], ref["final_hidden_0"])[0] <= 1e-2


def test_quantized_release_checkpoint_matches_reference():
    _check_prompts(_quant_model(), np.load(QUANT / "reference.npz"), "v41-tiny-quant")


_QUANT_CACHE: dict[str, object] = {}


def _quant_model():
    from dinfer_jax.models import load_model

    if "m" not in _QUANT_CACHE:
        _QUANT_CACHE["m"] = load_model(QUANT)
    return _QUANT_CACHE["m"]


def test_quantized_checkpoint_keeps_engram_tables_on_host():
    model = _quant_model()
    assert model.engram is not None and len(model.engram.tables) == 2
    assert all(t.is_memory_mapped for t in model.engram.tables)
    leaves = [x.shape for x in __import__("jax").tree_util.tree_leaves(model.params)]
    assert (420, 32) not in leaves and (508, 32) not in leaves, "Engram tables must not be device parameters"


def test_yoco_compact_equals_mask_and_report_deviation_from_off(tiny_model):
    """YOCO ``compact`` is an approximation by design: from the first ratio-1 layer on, only the last KEEP rows are
    computed and their SWA keys are limited to those rows. ``mask`` applies the same visibility on all rows, so on
    the kept rows the two must agree to fp32 rounding; the deviation of both from the exact ``off`` mode is
    reported (not bounded tightly: it is the documented cost of the approximation)."""
    from dinfer_jax.models import run

    ref = np.load(TINY / "reference.npz")
    ids = ref["input_ids_2"][None]  # S = 130
    keep = 40  # ≥ window (16) + backtracking (6)
    off = np.asarray(run(tiny_model, ids).logits)[0]
    mask = np.asarray(run(tiny_model, ids, yoco="mask", yoco_keep=keep).logits)[0]
    compact_out = run(tiny_model, ids, yoco="compact", yoco_keep=keep)
    compact = np.asarray(compact_out.logits)[0]
    assert compact.shape == (keep, off.shape[-1])
    np.testing.assert_array_equal(np.asarray(compact_out.intermediates["positions"]), np.arange(130 - keep, 130))
    assert rel_err(compact, mask[-keep:])[0] <= 1e-5
    dev_max, dev_mean = rel_err(compact, off[-keep:])
    agree = (compact.argmax(-1) == off[-keep:].argmax(-1)).mean()
    print(f"YOCO compact (keep={keep}) vs off on the last {keep} rows: max rel {dev_max:.2e}, mean {dev_mean:.2e}, "
          f"argmax agreement {agree:.1%}")
    assert np.isfinite(compact).all() and dev_max > 0  # it is an approximation; identical would mean it did nothing
    with pytest.raises(ValueError, match="sliding window"):
        run(tiny_model, ids, yoco="compact", yoco_keep=8)
