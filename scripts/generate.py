#!/usr/bin/env python
r"""Batch generation: prompts file (text, one prompt per line, or JSONL) → JSONL of continuations.

    python scripts/generate.py --model default --prompts examples/prompts.txt --output out.jsonl
    python scripts/generate.py --model /path/to/ckpt --prompts prompts.jsonl --temperature 0.7 --top-p 0.9
    python scripts/generate.py --prompts examples/prompts.txt --json-schema person.schema.json --max-tokens 64
    python scripts/generate.py --prompts examples/prompts.txt --regex '[a-z]{1,8} (is|was) [0-9]{1,3}\.'

JSONL input lines are objects with ``"prompt"`` (text) or ``"prompt_token_ids"`` (list of ints), optionally
``"max_tokens"``, ``"temperature"``, ``"seed"``, ``"so_args"`` (structured output for that prompt, as in
``SamplingParams``). ``--json-schema FILE`` / ``--regex RE`` / ``--ebnf FILE`` constrain every prompt without its own
``so_args`` (docs/structured_outputs.md); a schema that does not compile ends those requests with an error. Each
output line holds the prompt, the generated token ids and text,
the finish reason and any error. ``--print`` also shows the continuations on the terminal.

Step programs are compiled when the job first needs each shape (``--compile on-demand``, the default: a batch job
compiles only what its prompts use, ~20 s for the README's main job on 2 cores against ~75 s for every bucket) or
all before generating (``--compile ahead``: the engine's warm-up, what a server wants). Compiled programs persist in
the on-disk compilation cache either way.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="checkpoint directory, 'default', or a preset (random weights)")
    ap.add_argument("--prompts", required=True, help="text file (one prompt per line) or .jsonl")
    ap.add_argument("--output", help="JSONL output path (default: stdout)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None, help="seq_seed for every request (deterministic sampling)")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=128, help="prefill tokens per step")
    ap.add_argument("--sync", action="store_true", help="disable asynchronous scheduling")
    ap.add_argument("--compile", choices=("on-demand", "ahead"), default="on-demand",
                    help="on-demand (default): compile each step shape when the job first needs it, so a batch job "
                         "compiles only the shapes its prompts use; ahead: compile every shape bucket first (LLM's "
                         "warm-up, as a server does so that no request waits for a compilation)")
    ap.add_argument("--print", action="store_true", help="print prompt → continuation to stderr")
    ap.add_argument("--no-progress", action="store_true")
    so = ap.add_mutually_exclusive_group()
    so.add_argument("--json-schema", metavar="FILE", help="structured output: every output follows this JSON Schema")
    so.add_argument("--regex", metavar="RE", help="structured output: every output fully matches this regex")
    so.add_argument("--ebnf", metavar="FILE", help="structured output: every output parses under this GBNF grammar")
    return ap.parse_args(argv)


def read_prompts(path: Path) -> list[dict[str, Any]]:
    """Prompt records from a text file (one per non-empty line) or JSONL (objects with prompt / prompt_token_ids)."""
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    if path.suffix == ".jsonl":
        out = []
        for i, ln in enumerate(lines):
            rec = json.loads(ln)
            if not isinstance(rec, dict) or not ("prompt" in rec or "prompt_token_ids" in rec):
                raise ValueError(f"{path}:{i + 1}: expected an object with 'prompt' or 'prompt_token_ids'")
            out.append(rec)
        return out
    return [{"prompt": ln} for ln in lines]


def structured_args(args: argparse.Namespace) -> dict[str, str] | None:
    """``so_args`` from --json-schema / --regex / --ebnf (the schema files are read here), or None."""
    if args.json_schema:
        return {"schema_type": "json", "schema": Path(args.json_schema).read_text()}
    if args.regex:
        return {"schema_type": "regex", "schema": args.regex}
    if args.ebnf:
        return {"schema_type": "ebnf", "schema": Path(args.ebnf).read_text()}
    return None


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    from dinfer_jax import LLM, SamplingParams

    records = read_prompts(Path(args.prompts))
    so_args = structured_args(args)
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_num_batched_tokens, async_scheduling=not args.sync,
              warmup=args.compile == "ahead")
    params = [SamplingParams(temperature=float(r.get("temperature", args.temperature)), top_p=args.top_p,
                             top_k=args.top_k, min_p=args.min_p, max_tokens=int(r.get("max_tokens", args.max_tokens)),
                             seq_seed=r.get("seed", args.seed), so_args=r.get("so_args", so_args)) for r in records]
    prompts = [r["prompt"] if "prompt" in r else r["prompt_token_ids"] for r in records]
    outputs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    sink = open(args.output, "w") if args.output else sys.stdout
    try:
        for rec, out in zip(records, outputs, strict=True):
            sink.write(json.dumps({"prompt": rec.get("prompt"), "prompt_token_ids": out.prompt_token_ids,
                                   "token_ids": out.token_ids, "text": out.text, "finish_reason": out.finish_reason,
                                   "error": out.error}) + "\n")
            if args.print:
                shown = out.text if out.error is None else f"[error] {out.error}"
                print(f"\n>>> {rec.get('prompt', out.prompt_token_ids)}\n{shown}", file=sys.stderr)
    finally:
        if sink is not sys.stdout:
            sink.close()
    m = llm.metrics()
    compiled = (f" (timing includes building {m['compilations']} step programs: compiled, or loaded from the "
                f"compilation cache)" if args.compile == "on-demand" else "")
    print(f"\n{len(outputs)} requests, {m['decode_tokens']} decode tokens, {m['output_tokens_per_second']:.1f} tok/s"
          f"{compiled}, device waited for host {m['device_wait_fraction']:.1%} of the time", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
