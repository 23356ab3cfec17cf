#!/usr/bin/env python
"""Throughput of ``LLM.generate`` on tiny models, beside transformers' ``generate`` (the PyTorch baseline).

For each model: output tokens/s of dinfer_jax with asynchronous scheduling on and off, the fraction of the
generate wall time during which the device waited for the host (``metrics()["device_wait_fraction"]``), and — for V4,
the only family transformers implements — transformers 5.24 ``generate`` on the same weights and prompts (greedy,
fp32, KV cache on). All prompts have one length so the PyTorch baseline needs no padding. Compilation happens in
warm-up and is excluded; each configuration is timed over ``--repeats`` runs and the median is reported.

    python scripts/bench_generate.py --batch 8 --prompt-len 48 --max-tokens 64

``--max-model-lens 256,8192`` instead measures how output tokens/s depends on ``max_model_len`` on the same short
prompts (asynchronous scheduling, no transformers baseline): one row per model and length, with the ratio to the
first length. A step should read only the pages its batch can need, so the ratio should stay near 1.

``--attention-modes dense,sparse`` instead measures the decode rate with each way of reading compressed rows
(``LLM(attention=...)``) on long prompts (``--prompt-len``): decode time is the generate time with ``--max-tokens``
new tokens minus that with one (the prefill), so the table compares what a decode step costs when each query
masks all of the step's compressed rows against gathering its top-k.

``--speculative K`` instead measures speculative decoding on the bundled default model (trained weights, so drafts
mean something): ``examples/prompts.txt`` (repeated to ``--batch`` prompts), greedy, ``--max-tokens`` new tokens,
output tokens/s with DSpark verifying K drafts per step against the same engine without it, asynchronous and
synchronous loops, with the mean acceptance length (tokens emitted per verification step). Outputs are checked to be
identical with and without speculation. ``--max-num-seqs N`` serves the prompts N at a time (default: all at once;
1 = one request at a time, the latency-bound case where a step costs the same for 1 or 1 + K query tokens).
``--sampling`` instead measures sampled decoding on the bundled default model: ``examples/prompts.txt`` (repeated to
``--batch`` prompts), ``--max-tokens`` new tokens (EOS ignored), asynchronous loop, output tokens/s greedy and with
seeded sampling at temperature 0.7 with top-p 0.9, top-k 50, both, and no filter — what the sampler's filters cost
on top of the model's step (the top-p / top-k decision from the most likely candidates, ``sampling/sampler.py``).
Run it once with the package of another commit first on ``PYTHONPATH`` to compare the two.
``--speculative-widths all`` (or e.g. ``1,3,5``) adds two engines with confidence-scheduled verification over
those decode widths (``LLM(speculative_widths=...)``), without and with the online step-time correction
(``speculative_time_correction=True``), and reports the widths their decode steps took.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import numpy as np


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny-v4,tiny-v41", help="comma-separated presets (random weights)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-torch", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--max-model-lens", default=None,
                    help="comma-separated max_model_len values: compare tokens/s across them instead")
    ap.add_argument("--attention-modes", default=None,
                    help="comma-separated LLM(attention=...) modes: compare decode rates across them instead")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="compare LLM(batch_invariant=True) with the default engine (decode rate, prefill time)")
    ap.add_argument("--max-position-embeddings", type=int, default=None,
                    help="override the presets' position limit (random weights; e.g. 8192-token prompts on tiny-v41)")
    ap.add_argument("--yoco", action="store_true",
                    help="prefill tokens/s of long prompts with LLM(yoco=off / mask / compact) (V4.1 models)")
    ap.add_argument("--speculative", type=int, default=0, metavar="K",
                    help="compare DSpark speculation (K drafts per verification) on the default model instead")
    ap.add_argument("--speculative-widths", default=None,
                    help="with --speculative: also engines with confidence-scheduled verification over these "
                         "decode widths ('all' or comma-separated ints including K + 1), without and with the "
                         "online step-time correction")
    ap.add_argument("--sampling", action="store_true",
                    help="compare greedy with sampled decoding (top-p / top-k filters) on the default model instead")
    ap.add_argument("--max-num-seqs", type=int, default=0,
                    help="with --speculative: requests served at once (default: --batch)")
    return ap.parse_args(argv)


def bench_dinfer(model, prompts, max_tokens: int, async_scheduling: bool, repeats: int,
                 max_model_len: int | None = None, attention: str = "auto",
                 chunk: int | None = None, decode_rate: bool = False,
                 batch_invariant: bool = False) -> dict[str, float]:
    from dinfer_jax import LLM, SamplingParams
    from dinfer_jax.engine.runner import Buckets

    B = len(prompts)
    chunk = chunk or len(prompts[0])
    llm = LLM(model, max_num_seqs=B, max_model_len=max_model_len or len(prompts[0]) + max_tokens + 1,
              max_num_batched_tokens=B * chunk, async_scheduling=async_scheduling, progress=False,
              attention=attention, batch_invariant=batch_invariant,
              buckets=Buckets(decode_batch=(B,), prefill_batch=(B,), prefill_len=(chunk, B * chunk)))
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)  # warm the host paths too
    rates, waits = [], []
    for _ in range(repeats):
        before = llm.metrics()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        after = llm.metrics()
        rates.append(sum(len(o.token_ids) for o in outs) / dt)
        waited = after["device_waited_for_host_seconds"] - before["device_waited_for_host_seconds"]
        waits.append(waited / dt)
    out = {"tok_s": statistics.median(rates), "device_wait": statistics.median(waits),
           "compilations": llm.metrics()["compilations"], "warmup_s": llm.metrics()["warmup_seconds"]}
    if decode_rate and max_tokens > 1:  # generate time with max_tokens new tokens minus that with one (the prefill)
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        full, first = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            full.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            llm.generate(prompts, one, use_tqdm=False)
            first.append(time.perf_counter() - t0)
        decode_s = max(statistics.median(full) - statistics.median(first), 1e-9)
        out["decode_tok_s"] = B * (max_tokens - 1) / decode_s
        out["prefill_s"] = statistics.median(first)
    return out


def bench_torch(model, prompts, max_tokens: int, repeats: int) -> dict[str, float]:
    import torch

    from dinfer_jax.reference.transformers_v4 import hf_model_from_params

    hf = hf_model_from_params(model.config, model.params)
    ids = torch.as_tensor(np.array(prompts), dtype=torch.long)
    kw = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, use_cache=True,
              pad_token_id=0)
    with torch.no_grad():
        hf.generate(ids, **kw)
        rates = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = hf.generate(ids, **kw)
            dt = time.perf_counter() - t0
            rates.append((out.shape[1] - ids.shape[1]) * ids.shape[0] / dt)
    return {"tok_s": statistics.median(rates)}


def _models_and_prompts(args: argparse.Namespace):
    """``(name, config, random model, prompts)`` for each model of ``--models``: ``--batch`` random prompts of
    ``--prompt-len`` ids (one seeded stream over all models, so every run benchmarks the same inputs)."""
    from dinfer_jax.models import load_config, random_model

    rng = np.random.default_rng(0)
    for name in args.models.split(","):
        cfg = load_config(name)
        if args.max_position_embeddings:
            cfg = dataclasses.replace(cfg, max_position_embeddings=args.max_position_embeddings)
        model = random_model(cfg, seed=0, std=0.1, include_mtp=False)
        prompts = [[int(t) for t in rng.integers(4, cfg.vocab_size, args.prompt_len)] for _ in range(args.batch)]
        yield name, cfg, model, prompts


def bench_max_model_len(args: argparse.Namespace) -> int:
    """Output tokens/s of ``LLM.generate`` (async) per model and ``max_model_len``, same short prompts."""
    from rich.console import Console
    from rich.table import Table


    lens = [int(x) for x in args.max_model_lens.split(",")]
    table = Table(title=f"LLM.generate on CPU vs max_model_len: batch {args.batch}, prompt {args.prompt_len}, "
                        f"{args.max_tokens} new tokens, greedy fp32, async (median of {args.repeats})")
    for col in ("model", "max_model_len", "output tok/s", f"vs max_model_len={lens[0]}", "compiled buckets",
                "warm-up s"):
        table.add_column(col, justify="left" if col == "model" else "right")
    for name, _cfg, model, prompts in _models_and_prompts(args):
        base = None
        for n in lens:
            r = bench_dinfer(model, prompts, args.max_tokens, True, args.repeats, max_model_len=n)
            base = base or r["tok_s"]
            table.add_row(name, str(n), f"{r['tok_s']:.1f}", f"{r['tok_s'] / base:.2f}×", str(r["compilations"]),
                          f"{r['warmup_s']:.1f}")
    Console(width=140).print(table)
    return 0


def bench_attention(args: argparse.Namespace) -> int:
    """Decode rate per model and ``LLM(attention=...)`` mode on long prompts (async, greedy, fp32)."""
    from rich.console import Console
    from rich.table import Table

    modes = args.attention_modes.split(",")
    table = Table(title=f"LLM decode on CPU by compressed-row attention: batch {args.batch}, prompt "
                        f"{args.prompt_len}, {args.max_tokens} new tokens, greedy fp32, async (median of "
                        f"{args.repeats})")
    for col in ("model", "attention", "decode tok/s", f"vs {modes[0]}", "prefill s", "warm-up s"):
        table.add_column(col, justify="left" if col in ("model", "attention") else "right")
    for name, _cfg, model, prompts in _models_and_prompts(args):
        base = None
        for mode in modes:
            r = bench_dinfer(model, prompts, args.max_tokens, True, args.repeats, attention=mode, chunk=256,
                             decode_rate=True)
            base = base or r["decode_tok_s"]
            table.add_row(name, mode, f"{r['decode_tok_s']:.1f}", f"{r['decode_tok_s'] / base:.2f}×",
                          f"{r['prefill_s']:.2f}", f"{r['warmup_s']:.1f}")
    Console(width=140).print(table)
    return 0


def bench_batch_invariant(args: argparse.Namespace) -> int:
    """Decode rate, prefill time and warm-up per model with ``LLM(batch_invariant=True)`` against the default
    engine (async, greedy, fp32): what batch invariance costs."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"LLM on CPU, batch_invariant on/off: batch {args.batch}, prompt {args.prompt_len}, "
                        f"{args.max_tokens} new tokens, greedy fp32, async (median of {args.repeats})")
    for col in ("model", "batch_invariant", "decode tok/s", "vs off", "prefill s", "vs off", "warm-up s"):
        table.add_column(col, justify="left" if col in ("model", "batch_invariant") else "right")
    for name, _cfg, model, prompts in _models_and_prompts(args):
        base = None
        for inv in (False, True):
            r = bench_dinfer(model, prompts, args.max_tokens, True, args.repeats, decode_rate=True,
                             batch_invariant=inv)
            base = base or r
            table.add_row(name, "on" if inv else "off", f"{r['decode_tok_s']:.1f}",
                          f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}×", f"{r['prefill_s']:.3f}",
                          f"{r['prefill_s'] / base['prefill_s']:.2f}×", f"{r['warmup_s']:.1f}")
    Console(width=140).print(table)
    return 0


def bench_yoco(args: argparse.Namespace) -> int:
    """Prefill tokens/s (generate with one new token) of ``--batch`` prompts of ``--prompt-len`` tokens per V4.1
    model with ``yoco`` off, mask and compact (keep 140; chunk buckets of 256 and ``--prompt-len`` tokens)."""
    from rich.console import Console
    from rich.table import Table

    from dinfer_jax import LLM, SamplingParams
    from dinfer_jax.engine.runner import Buckets

    L, B = args.prompt_len, args.batch
    table = Table(title=f"LLM prefill on CPU by YOCO mode: {B} prompts of {L} tokens, one new token, keep 140, "
                        f"greedy fp32 (median of {args.repeats})")
    for col in ("model", "yoco", "prefill tok/s", "vs off", "region-skipping steps", "same first tokens as mask"):
        table.add_column(col, justify="left" if col in ("model", "yoco") else "right")
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for name, cfg, model, prompts in _models_and_prompts(args):
        if not cfg.is_v41:
            continue
        base = ref = None
        for mode in ("off", "mask", "compact"):
            llm = LLM(model, max_num_seqs=B, max_model_len=L + 2, max_num_batched_tokens=L, progress=False,
                      yoco=mode, yoco_keep=140,
                      buckets=Buckets(decode_batch=(B,), prefill_batch=(1,), prefill_len=(min(256, L), L)))
            outs = llm.generate(prompts, sp, use_tqdm=False)
            before = llm.metrics()["yoco_skipped_steps"]
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                outs = llm.generate(prompts, sp, use_tqdm=False)
                times.append(time.perf_counter() - t0)
            rate = B * L / statistics.median(times)
            base = base or rate
            toks = [o.token_ids for o in outs]
            ref = toks if mode == "mask" else ref
            skipped = (llm.metrics()["yoco_skipped_steps"] - before) / args.repeats
            table.add_row(name, mode, f"{rate:.0f}", f"{rate / base:.2f}×", f"{skipped:.0f}",
                          "—" if mode != "compact" else str(toks == ref))
    Console(width=140).print(table)
    return 0


def bench_speculative(args: argparse.Namespace) -> int:
    """Output tokens/s on the default model with and without DSpark speculation (greedy, identical outputs)."""
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    from dinfer_jax import LLM, SamplingParams

    k = args.speculative
    lines = [ln.rstrip("\n") for ln in open(Path(__file__).resolve().parents[1] / "examples" / "prompts.txt")
             if ln.strip()]
    prompts = [lines[i % len(lines)] for i in range(args.batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    seqs = args.max_num_seqs or args.batch
    table = Table(title=f"LLM.generate on CPU, default model: {args.batch} prompts of examples/prompts.txt, "
                        f"{seqs} at a time, {args.max_tokens} new tokens, greedy fp32 (median of {args.repeats})")
    for col in ("loop", "speculation", "output tok/s", "vs off", "mean acceptance length", "same tokens as off",
                "decode steps by width"):
        table.add_column(col, justify="left" if col in ("loop", "speculation", "decode steps by width") else "right")
    widths = args.speculative_widths
    if widths is not None and widths != "all":
        widths = tuple(int(w) for w in widths.split(","))
    setups = {"off": (None, None, False), f"dspark k={k}": ("dspark", None, False)}
    if widths is not None:
        setups[f"dspark k={k}, widths {args.speculative_widths}"] = ("dspark", widths, False)
        setups[f"dspark k={k}, widths {args.speculative_widths}, time correction"] = ("dspark", widths, True)
    engines = {name: LLM("default", max_num_seqs=seqs, max_model_len=256, progress=False, speculative=spec,
                         num_speculative_tokens=k if spec else 5, speculative_widths=w,
                         speculative_time_correction=fix)
               for name, (spec, w, fix) in setups.items()}
    for async_ in (True, False):
        base, ref = None, None
        for name, llm in engines.items():
            spec = llm.speculative
            llm.configure(async_scheduling=async_)
            before = llm.metrics()
            rate, outs = _median_rate(llm, prompts, sp, args.repeats)
            toks = [o.token_ids for o in outs]
            base, ref = (rate, toks) if spec is None else (base, ref)
            m = llm.metrics()
            steps = m["spec_verify_steps"] - before["spec_verify_steps"]
            acc = (m["spec_accepted_tokens"] - before["spec_accepted_tokens"] + steps) / steps if steps else 0.0
            by_width = {w: n - before["spec_step_widths"].get(w, 0) for w, n in sorted(m["spec_step_widths"].items())}
            table.add_row("async" if async_ else "sync", name, f"{rate:.1f}",
                          f"{rate / base:.2f}×", f"{acc:.2f}" if spec else "—",
                          "—" if spec is None else str(toks == ref),
                          ", ".join(f"{w}: {n}" for w, n in by_width.items() if n) or "—")
    Console(width=140).print(table)
    return 0


def _median_rate(llm, prompts, sp, repeats: int):
    """Median output tokens/s of ``llm.generate(prompts, sp)`` over ``repeats`` runs after one untimed run, and the
    last run's outputs."""
    outs = llm.generate(prompts, sp, use_tqdm=False)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        rates.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
    return statistics.median(rates), outs


def bench_sampling(args: argparse.Namespace) -> int:
    """``--sampling`` (module docstring): output tok/s of the default model, greedy against sampled with filters."""
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    from dinfer_jax import LLM, SamplingParams

    lines = [ln.rstrip("\n") for ln in open(Path(__file__).resolve().parents[1] / "examples" / "prompts.txt")
             if ln.strip()]
    prompts = [lines[i % len(lines)] for i in range(args.batch)]
    settings = {"greedy": dict(temperature=0.0), "T 0.7, no filter": dict(temperature=0.7),
                "T 0.7, top-p 0.9": dict(temperature=0.7, top_p=0.9),
                "T 0.7, top-k 50": dict(temperature=0.7, top_k=50),
                "T 0.7, top-p 0.9, top-k 50": dict(temperature=0.7, top_p=0.9, top_k=50)}
    llm = LLM("default", max_num_seqs=args.batch, max_model_len=256, progress=False)
    import dinfer_jax

    table = Table(title=f"LLM.generate on CPU, default model ({Path(dinfer_jax.__file__).parent}): {args.batch} "
                        f"prompts of examples/prompts.txt, {args.max_tokens} new tokens, async (median of "
                        f"{args.repeats})")
    for col in ("sampling", "output tok/s", "vs greedy"):
        table.add_column(col, justify="left" if col == "sampling" else "right")
    base = None
    for name, kw in settings.items():
        sp = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seq_seed=i, **kw) for i in range(args.batch)]
        rate, _ = _median_rate(llm, prompts, sp, args.repeats)
        base = base or rate
        table.add_row(name, f"{rate:.1f}", f"{rate / base:.2f}×")
    Console(width=140).print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.sampling:
        return bench_sampling(args)
    if args.speculative:
        return bench_speculative(args)
    if args.max_model_lens:
        return bench_max_model_len(args)
    if args.attention_modes:
        return bench_attention(args)
    if args.batch_invariant:
        return bench_batch_invariant(args)
    if args.yoco:
        return bench_yoco(args)
    from rich.console import Console
    from rich.table import Table


    table = Table(title=f"LLM.generate on CPU: batch {args.batch}, prompt {args.prompt_len}, "
                        f"{args.max_tokens} new tokens, greedy fp32 (median of {args.repeats})")
    for col in ("model", "engine", "output tok/s", "vs transformers", "device waited for host"):
        table.add_column(col, justify="left" if col in ("model", "engine") else "right")
    for name, cfg, model, prompts in _models_and_prompts(args):
        base = None
        if not args.no_torch and not cfg.is_v41:
            base = bench_torch(model, prompts, args.max_tokens, args.repeats)["tok_s"]
            table.add_row(name, "transformers 5.24 generate", f"{base:.1f}", "1.00×", "—")
        for mode in (True, False):
            r = bench_dinfer(model, prompts, args.max_tokens, mode, args.repeats)
            no_base = "n/a (--no-torch)" if args.no_torch else "n/a (no transformers V4.1)"
            ratio = f"{r['tok_s'] / base:.2f}×" if base else no_base
            table.add_row(name, f"dinfer_jax async={'on' if mode else 'off'}", f"{r['tok_s']:.1f}", ratio,
                          f"{r['device_wait']:.1%}")
    Console(width=140).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
