#!/usr/bin/env python
"""Structured outputs at batch 64: what the token masks cost (issue 12; docs/perf/structured_cpu.md).

Runs the same 64 prompts on the bundled default model three ways — free, under a JSON Schema, under a regex — in
asynchronous and synchronous scheduling, and prints a table: wall seconds, output tokens/s, host seconds spent
filling token masks and their share of the wall time (the device can wait on the masks only while the host fills
them), the time the device waited for the host (``metrics()["device_wait_fraction"]``), and how many structured
outputs are valid (``json.loads`` + ``jsonschema`` / ``re.fullmatch``; a run that ends by length is counted invalid).

    python scripts/bench_structured.py [--batch 64] [--max-tokens 64] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SCHEMA = {"type": "object", "required": ["name", "kind", "arguments"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "kind": {"enum": ["function", "class", "module", "method"]},
                         "arguments": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 8}},
                         "since": {"type": "integer", "minimum": 0, "maximum": 40}}}
REGEX = r"[A-Z][a-z]{1,12}( [a-z]{1,12}){0,6}\."


def _valid(kind: str, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import jax

    from dinfer_jax import LLM, SamplingParams
    from dinfer_jax.engine.buckets import Buckets

    root = Path(__file__).resolve().parents[1]
    base = [ln for ln in (root / "examples" / "prompts.txt").read_text().splitlines() if ln.strip()]
    prompts = [base[i % len(base)] for i in range(args.batch)]
    t0 = time.perf_counter()
    llm = LLM("default", max_num_seqs=args.batch, max_model_len=512, max_num_batched_tokens=128, progress=False,
              buckets=Buckets(decode_batch=(args.batch,), prefill_batch=(16,), prefill_len=(128,)))
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; warm-up {time.perf_counter() - t0:.1f} s",
          flush=True)
    so = {"free": None, "json": {"schema_type": "json", "schema": json.dumps(SCHEMA)},
          "regex": {"schema_type": "regex", "schema": REGEX}}
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, so_args=so["json"]), use_tqdm=False)  # grammar cache
    rows = []
    for mode in ("async", "sync"):
        llm.configure(async_scheduling=mode == "async")
        for kind, so_args in so.items():
            params = [SamplingParams(temperature=0.7, seq_seed=i, max_tokens=args.max_tokens, so_args=so_args)
                      for i in range(args.batch)]
            before = llm.metrics()
            outs = llm.generate(prompts, params, use_tqdm=False)
            after = llm.metrics()
            d = {k: after[k] - before[k] for k in ("generate_seconds", "output_tokens", "structured_mask_seconds",
                                                   "device_waited_for_host_seconds", "compilations")}
            valid = sum(_valid(kind, o.text) and o.finish_reason == "stop" for o in outs) if so_args else None
            row = dict(mode=mode, kind=kind, wall_s=d["generate_seconds"], tokens=d["output_tokens"],
                       tok_per_s=d["output_tokens"] / d["generate_seconds"], mask_s=d["structured_mask_seconds"],
                       mask_frac=d["structured_mask_seconds"] / d["generate_seconds"],
                       device_wait_frac=d["device_waited_for_host_seconds"] / d["generate_seconds"],
                       valid=valid, n=len(outs), compilations=d["compilations"])
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = ["| scheduling | constraint | wall s | output tokens | tokens/s | mask-filling s (% of wall) | "
             "device waited for host (% of wall) | valid outputs | compilations |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        valid = "—" if r["valid"] is None else f"{r['valid']}/{r['n']}"
        lines.append(f"| {r['mode']} | {r['kind']} | {r['wall_s']:.2f} | {r['tokens']} | {r['tok_per_s']:.0f} | "
                     f"{r['mask_s']:.3f} ({100 * r['mask_frac']:.1f}%) | {100 * r['device_wait_frac']:.1f}% | "
                     f"{valid} | {r['compilations']} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_structured.md").write_text(table + "\n")
        (out / "bench_structured.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
