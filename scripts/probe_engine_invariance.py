"""Where a batch-invariant engine run stops being invariant: the engine test's scenario, with numbers.

``tests/test_batch_invariance.py::test_engine_logits_are_batch_invariant`` stops at the first request whose
logprobs differ. This probe runs the same 64 prompts (same seeds) through ``LLM(batch_invariant=True)`` under a few
bucket layouts and prints, for each of the 20 checked requests, at which generated positions its whole-vocabulary
logprobs differ and by how much — alone vs inside the 64-row batch, and alone under one layout vs alone under
another (which isolates a dependence on the page bucket or the decode row count from one on the other rows)::

    python3 scripts/probe_engine_invariance.py [--variants test pages16 decode64] [--out table.txt]

Variants: ``test`` is the test's layout (decode rows 1 or 64, 8 or 16 pages); ``pages16`` has only 16-page steps;
``decode64`` only 64-row decode steps (a request alone decodes in a padded 64-row step).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dinfer_jax import LLM, SamplingParams  # noqa: E402
from dinfer_jax.engine.runner import Buckets  # noqa: E402
from dinfer_jax.models import load_config, random_model  # noqa: E402

GEN, N_REQ, N_ALL = 3, 20, 64
LAYOUTS = {
    "test": dict(decode_batch=(1, 64), prefill_batch=(4,), prefill_len=(32, 128), pages=(8, 16)),
    "pages16": dict(decode_batch=(1, 64), prefill_batch=(4,), prefill_len=(32, 128), pages=(16,)),
    "decode64": dict(decode_batch=(64,), prefill_batch=(4,), prefill_len=(32, 128), pages=(8, 16)),
}


def scenario(vocab: int) -> tuple[list[list[int]], list[SamplingParams], np.ndarray]:
    """The test's prompts, sampling parameters and the 64-row batch's order (the same generator draws)."""
    rng = np.random.default_rng(11)
    lengths = rng.integers(3, 150, N_ALL)
    prompts = [[int(t) for t in rng.integers(4, vocab, int(n))] for n in lengths]
    params = [SamplingParams(temperature=1.0, max_tokens=GEN, ignore_eos=True, logprobs=vocab, seq_seed=1000 + i)
              for i in range(N_ALL)]
    return prompts, params, rng.permutation(N_ALL)


def _arrays(out) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [GEN] int, whole-vocabulary logprobs [GEN, V] float64 in token order) of one request's output."""
    toks = np.array([d["token"] for d in out.logprobs])
    lps = np.array([[lp for _, lp in sorted(d["top"])] for d in out.logprobs], np.float64)
    return toks, lps


def run_layout(model, name: str, prompts, params, order) -> dict[str, dict[int, tuple[np.ndarray, np.ndarray]]]:
    """Each checked request alone (prefill budget 64 or 100 by parity, as the test) and in the 64-row batch."""
    V = model.config.vocab_size
    t0 = time.perf_counter()
    llm = LLM(model, max_num_seqs=64, max_model_len=256, max_num_batched_tokens=100, progress=False,
              max_logprobs=V, block_size=16, buckets=Buckets(**LAYOUTS[name]), batch_invariant=True)
    print(f"[{name}] warm-up {time.perf_counter() - t0:.1f} s", flush=True)

    def gen(ids: list[int], chunk: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        llm.configure(max_num_batched_tokens=chunk)
        outs = llm.generate([prompts[i] for i in ids], [params[i] for i in ids], use_tqdm=False)
        return {i: _arrays(o) for i, o in zip(ids, outs, strict=True)}

    alone: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for i in range(N_REQ):
        alone.update(gen([i], 64 if i % 2 else 100))
    batch = gen([int(i) for i in order], 64)
    return {"alone": alone, "batch": {i: v for i, v in batch.items() if i < N_REQ}}


def compare(a: dict, b: dict, prompts, label: str) -> list[str]:
    """One line per request: positions whose tokens or logprobs differ and the largest |Δ logprob| at each."""
    lines, n_bad = [], 0
    for i in range(N_REQ):
        (ta, la), (tb, lb) = a[i], b[i]
        diff = np.abs(la - lb).max(axis=1)
        bad = [p for p in range(GEN) if diff[p] > 0 or ta[p] != tb[p]]
        n_bad += bool(bad)
        worst = " ".join(f"{d:.2e}" for d in diff)
        lines.append(f"{label:28s} req {i:2d} prompt {len(prompts[i]):3d}  differing positions {bad!s:10s}"
                     f" max|d| per position {worst}")
    lines.append(f"{label:28s} {n_bad} of {N_REQ} requests differ")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["test", "pages16", "decode64"], choices=sorted(LAYOUTS))
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = ap.parse_args()
    model = random_model(load_config("tiny-v41"), seed=3, include_mtp=False)
    prompts, params, order = scenario(model.config.vocab_size)
    results, lines = {}, []
    for name in args.variants:
        results[name] = run_layout(model, name, prompts, params, order)
        block = compare(results[name]["alone"], results[name]["batch"], prompts, f"{name}: alone vs batch")
        print("\n".join(block), flush=True)
        lines += block
    base = args.variants[0]
    for name in args.variants[1:]:
        for kind in ("alone", "batch"):
            block = compare(results[base][kind], results[name][kind], prompts, f"{kind}: {base} vs {name}")
            print("\n".join(block), flush=True)
            lines += block
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
