"""Attention-DP engines and expert parallelism on several GPUs against one GPU (issue 10; ``docs/dp_engines.md``).

One random real-dimension slice (the preset's first ``--layers`` layers, release formats: FP4 experts, FP8
linears, built on the first device) is served by the one-device engine and by each ``--layouts`` entry
``dp,cp,ep`` (``LLM(dp_size=, cp_size=, ep_size=)``). For each engine:

* **tokens**: ``--batch`` random prompts of ``--prompt-len`` tokens, ``--max-tokens`` greedy tokens each. An
  engine of ``dp`` DP ranks is compared with the one-device engine serving each DP rank's own prompts (prompts go
  to the ranks round-robin, ``prompts[e::dp]``): a rank then runs the same steps, with the same shapes, as that
  one-device run, so equal tokens are the expected result. A row that differs is reported with the position where
  it first differs and the one-device run's log-probability gap between its top two tokens there (a near tie
  decided by rounding, or a real error).
* **speed**: decode tokens/s and the decode step time (every engine's decode rows in one mesh step): the wall time
  of ``generate`` with ``--max-tokens`` tokens minus that with one token, over ``max_tokens − 1`` steps.

All engines use the same programs where they can: the FP8 linears through XLA (``--linear-impl``; the mesh
engines have no other path), no decode-only compiler options. A prefill step is one prompt (``[1, --prompt-len]``)
and decode batches are the powers of two up to ``--batch``, so a DP rank's rows see the same buckets as the
one-device run of its prompts. Prints a Markdown table; writes it and the JSON rows under ``--out`` after every engine.

    python scripts/bench_mesh.py --preset deepseek-v4-flash --layers 4 --layouts 1,1,2 2,1,1 2,1,2 --out /tmp/mesh

``--long-prompts N`` makes N of the prompts ``--long-len`` tokens long (prefilled in ``--chunk``-token chunks, split
over the CP ranks of a CP engine), and the table adds prefill tokens/s (all prompts' tokens over the wall time of
``generate`` with one new token). The four-GPU lab layout (issue 14: DP2/CP2/EP4 and DP4/EP4 against one GPU on a
V4.1-Flash slice; each mesh engine's rank groups and device assignment are printed):

    python scripts/bench_mesh.py --preset deepseek-v4.1-flash --layers 4 --engram-vocab 1000000 --batch 16 \
        --long-prompts 4 --long-len 4096 --layouts 2,2,4 4,1,4 --out /tmp/mesh4
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dinfer_jax.engine.buckets import Buckets  # noqa: E402
from dinfer_jax.models import random_model  # noqa: E402
from dinfer_jax.models.config import load_config  # noqa: E402
from dinfer_jax.models.engram import engram_table_sizes  # noqa: E402
from dinfer_jax.sampling.params import SamplingParams  # noqa: E402
from sharding.layout import layout as rank_layout  # noqa: E402


def parse_layout(text: str) -> tuple[int, int, int]:
    """``"dp,cp,ep"`` → ``(dp, cp, ep)``."""
    try:
        dp, cp, ep = (int(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"a layout is dp,cp,ep (three integers), got {text!r}") from None
    return dp, cp, ep


def divergence(got: list[list[int]], ref: list[list[int]], ref_logprobs: list[list[dict]]) -> list[dict]:
    """Rows whose tokens differ: ``{row, at, gap}`` with ``at`` the first differing position and ``gap`` the
    reference's log-probability margin of its token over the runner-up there (nats)."""
    out = []
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        if g == r:
            continue
        at = next((j for j, (a, b) in enumerate(zip(g, r, strict=False)) if a != b), min(len(g), len(r)))
        gap = float("nan")
        if at < len(ref_logprobs[i]):
            top = [lp for _, lp in ref_logprobs[i][at]["top"]]
            if len(top) >= 2:
                gap = top[0] - top[1]
        out.append(dict(row=i, at=at, gap=gap))
    return out


def serve(llm, prompts, args) -> tuple[list[list[int]], list[list[dict]], dict]:
    """Greedy tokens (with top-2 log-probs) and the decode timing of one engine."""
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    tokens, logprobs = [o.token_ids for o in outs], [o.logprobs for o in outs]
    full = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    runs = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        llm.generate(prompts, full, use_tqdm=False)
        t1 = time.perf_counter()
        llm.generate(prompts, one, use_tqdm=False)
        t2 = time.perf_counter()
        runs.append(((t1 - t0) - (t2 - t1), t1 - t0, t2 - t1))
    decode_s = min(r[0] for r in runs)
    one_token_s = min(r[2] for r in runs)
    steps = args.max_tokens - 1
    timing = dict(decode_s=decode_s, decode_step_ms=1e3 * decode_s / steps,
                  decode_tok_per_s=len(prompts) * steps / decode_s, generate_s=min(r[1] for r in runs),
                  prefill_s=one_token_s, prefill_tok_per_s=sum(len(p) for p in prompts) / one_token_s)
    return tokens, logprobs, timing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v4-flash")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--layouts", nargs="+", default=["1,1,2", "2,1,1", "2,1,2"], help="dp,cp,ep per engine")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--long-prompts", type=int, default=0,
                    help="how many of the --batch prompts are --long-len tokens long (spread over the batch), so "
                         "their prefill is chunked and, under CP, split over the CP ranks")
    ap.add_argument("--long-len", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk (max_num_batched_tokens) with long prompts")
    ap.add_argument("--engram-vocab", type=int, default=None,
                    help="V4.1 presets: Engram hash vocabulary of the random FP8 tables (e.g. 1000000; the release's "
                         "16,000,000 does not fit); omitted: the slice keeps no Engram branch")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per engine (the fastest is reported)")
    ap.add_argument("--kv-gib", type=int, default=4)
    ap.add_argument("--linear-impl", default="xla", choices=["xla", "auto", "pallas"])
    ap.add_argument("--compile-threads", type=int, default=None,
                    help="threads compiling the buckets at warm-up (LLM compile_threads; default: the cores)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    layouts = [parse_layout(t) for t in args.layouts]
    dps = sorted({dp for dp, _, _ in layouts} | {1})
    if any(args.batch % dp for dp in dps):
        raise SystemExit(f"--batch {args.batch} must be divisible by every dp in {dps}")
    cache = tempfile.mkdtemp(prefix="dinfer_jax_cold_cache_")
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    devs = jax.devices()
    print(f"jax {jax.__version__}, {len(devs)} × {devs[0].device_kind}", flush=True)

    from bench_compile import first_layers  # scripts/ is on sys.path when run as a script

    from dinfer_jax import LLM
    from dinfer_jax.engine.llm import default_block_size

    cfg = first_layers(load_config(args.preset), args.layers)
    if cfg.engram_layer_ids and args.engram_vocab:
        cfg = cfg.replace(engram_vocab_size=args.engram_vocab)
        cfg = cfg.replace(engram_num_embeddings=engram_table_sizes(cfg))
    elif cfg.engram_layer_ids:
        cfg = cfg.replace(engram_layer_ids=(), engram_num_embeddings=())
    t0 = time.perf_counter()
    model = random_model(cfg, dtype="bfloat16", include_mtp=False, weights="native", stacked=True)   # held once
    model = dataclasses.replace(model, linear_impl=args.linear_impl)
    jax.block_until_ready(model.params)
    print(f"model: {model.param_bytes / 1e9:.1f} GB built in {time.perf_counter() - t0:.1f} s", flush=True)
    rng = np.random.default_rng(0)
    every = args.batch // args.long_prompts if args.long_prompts else 0
    lengths = [args.long_len if every and i % every == 0 and i // every < args.long_prompts else args.prompt_len
               for i in range(args.batch)]
    prompts = [rng.integers(10, cfg.vocab_size - 10, n).tolist() for n in lengths]
    budget = args.chunk if args.long_prompts else args.prompt_len
    max_len = max(lengths) + args.max_tokens + 16
    # one page width for the short prompts' steps and one for the longest sequence (the engine's block size, given
    # explicitly so the widths are known)
    block = default_block_size(cfg)
    pages = tuple(sorted({-(-(args.prompt_len + args.max_tokens) // block), -(-max_len // block)}))
    buckets = Buckets(decode_batch=tuple(sorted({args.batch // dp for dp in dps})), prefill_batch=(1,),
                      prefill_len=tuple(sorted({args.prompt_len, budget})), pages=pages)
    kw = dict(dtype="bfloat16", max_num_seqs=args.batch, max_model_len=max_len, block_size=block,
              max_num_batched_tokens=budget, kv_cache_memory_bytes=args.kv_gib << 30,
              progress=False, buckets=buckets, decode_compiler_options={}, compile_threads=args.compile_threads)
    rows, out = [], Path(args.out) if args.out else None

    def record(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row, default=str), flush=True)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "bench_mesh.json").write_text(json.dumps(rows, default=str, indent=1))

    single = LLM(model, **kw)
    warm = single.metrics()["warmup_seconds"]
    refs: dict[int, tuple[list, list]] = {}
    for dp in dps:   # the one-device engine on each DP rank's prompts (dp = 1: all of them)
        toks, lps = [None] * args.batch, [None] * args.batch
        for e in range(dp):
            t, lp, timing = serve(single, prompts[e::dp], args)
            toks[e::dp], lps[e::dp] = t, lp
            if dp == 1:
                record(dict(layout="1,1,1", devices=1, warmup_s=warm, **timing, rows_equal=args.batch,
                            compared_with="itself", divergences=[],
                            warmup_programs=[dataclasses.asdict(t) for t in single.runner.warmup_timings]))
        refs[dp] = (toks, lps)
    del single
    gc.collect()
    for dp, cp, ep in layouts:
        llm = LLM(model, dp_size=dp, cp_size=cp, ep_size=ep, **kw)
        warm = llm.metrics()["warmup_seconds"]
        mesh = llm.runner.mesh
        groups = dataclasses.asdict(rank_layout(dp, cp, ep)) if ep <= dp * cp else "ep > dp·cp: engines replicated"
        devices = dict(axes=list(mesh.axis_names), shape=[int(n) for n in mesh.devices.shape],
                       ids=np.vectorize(lambda d: d.id)(mesh.devices).tolist())
        print(f"layout {dp},{cp},{ep}: groups {groups}; mesh {devices}", flush=True)
        toks, _, timing = serve(llm, prompts, args)
        ref_toks, ref_lps = refs[dp]
        div = divergence(toks, ref_toks, ref_lps)
        record(dict(layout=f"{dp},{cp},{ep}", devices=max(dp * cp, ep), warmup_s=warm, **timing,
                    rows_equal=args.batch - len(div),
                    compared_with="one device" if dp == 1 else f"one device, each DP rank's {args.batch // dp} prompts",
                    divergences=div, moe_impl=llm.runner.moe_impl, groups=groups, mesh=devices,
                    warmup_programs=[dataclasses.asdict(t) for t in llm.runner.warmup_timings]))
        del llm
        gc.collect()
    base = rows[0]
    lines = [f"{args.preset}, first {args.layers} layers, random native weights (FP4 experts, FP8 linears), "
             f"bf16; {len(devs)} × {devs[0].device_kind}; jax {jax.__version__}; batch {args.batch}, prompts of "
             f"{args.prompt_len} tokens ({args.long_prompts} of {args.long_len}, prefill chunks of {budget}), "
             f"{args.max_tokens} greedy tokens; FP8 linears: {args.linear_impl}"
             + (f"; Engram vocabulary {args.engram_vocab}" if cfg.engram_layer_ids else ""), "",
             "| dp,cp,ep | GPUs | warm-up s | prefill tok/s | decode step ms | decode tok/s | decode vs 1 GPU "
             "| rows with the 1-GPU tokens | first differences (row@pos, top-2 gap nats) |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        div = ", ".join(f"{d['row']}@{d['at']} ({d['gap']:.3f})" for d in r["divergences"][:6]) or "-"
        lines.append(f"| {r['layout']} | {r['devices']} | {r['warmup_s']:.1f} | {r['prefill_tok_per_s']:.0f} | "
                     f"{r['decode_step_ms']:.2f} | "
                     f"{r['decode_tok_per_s']:.0f} | {r['decode_tok_per_s'] / base['decode_tok_per_s']:.2f}× | "
                     f"{r['rows_equal']}/{args.batch} | {div} |")
    text = "\n".join(lines)
    print(text)
    if out is not None:
        (out / "bench_mesh.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
