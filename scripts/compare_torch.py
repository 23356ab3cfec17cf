#!/usr/bin/env python
"""Compare dinfer_jax with the transformers DeepSeek-V4 reference on the same weights and prompts.

Loads a checkpoint directory (DeepSeek release or transformers layout, quantised or not; quantised weights are
dequantised once and both models get the same values), or builds a random model from a config/preset, then runs
the transformers model (fp32, stateless) and ours (fp32 by default) and prints per-layer and logits errors.

    python scripts/compare_torch.py --config tiny-v4 --batch 2 --seq-len 40
    python scripts/compare_torch.py --checkpoint /path/to/ckpt --prompt-ids "0 15 27 99"

Needs the reference extra: ``pip install -e .[reference]`` (torch 2.13.0, transformers 5.24.0).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="Hugging Face checkpoint directory")
    src.add_argument("--config", help="preset name or config.json path: build a random model")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random model and prompts")
    ap.add_argument("--init-std", type=float, default=0.1, help="std of random weight matrices (--config)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=48)
    ap.add_argument("--prompt-ids", action="append", help="space-separated token ids (repeatable); overrides random")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dinfer_jax dtype")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    from rich.console import Console
    from rich.table import Table

    from dinfer_jax.models import inspect, load_config, load_model, random_model
    from dinfer_jax.reference.transformers_v4 import hf_logits_and_layers, hf_model_from_params

    console = Console(width=None if sys.stdout.isatty() else 140)
    if args.checkpoint:
        model = load_model(args.checkpoint, dtype=args.dtype)
        ref_params = model.params if args.dtype == "float32" else load_model(args.checkpoint).params
    else:
        cfg = load_config(args.config)
        model = random_model(cfg, seed=args.seed, dtype=args.dtype, std=args.init_std, include_mtp=False)
        ref_params = random_model(cfg, seed=args.seed, std=args.init_std, include_mtp=False).params
    cfg = model.config
    if args.prompt_ids:
        rows = [[int(t) for t in p.split()] for p in args.prompt_ids]
        if len({len(r) for r in rows}) != 1:
            console.print("[red]all --prompt-ids must have the same length (no padding in the full-sequence path)")
            return 2
        ids = np.array(rows)
    else:
        ids = np.random.default_rng(args.seed).integers(0, cfg.vocab_size, size=(args.batch, args.seq_len))

    t0 = time.perf_counter()
    hf = hf_model_from_params(cfg, ref_params)
    ref_logits, ref_layers, ref_picks = hf_logits_and_layers(hf, ids)
    t_ref = time.perf_counter() - t0
    t0 = time.perf_counter()
    ours = inspect(model, ids)
    t_ours = time.perf_counter() - t0

    table = Table(title=f"dinfer_jax ({args.dtype}) vs transformers (fp32), B={ids.shape[0]} S={ids.shape[1]}")
    for col in ("tensor", "max |err|", "max |err| / max |ref|", "mean |err| / max |ref|", "agreement"):
        table.add_column(col, justify="right" if col != "tensor" else "left")
    for i, ref_out in enumerate(ref_layers):
        err = np.abs(ours["hidden_states"][i + 1].astype(np.float64) - ref_out)
        scale = np.abs(ref_out).max()
        agree = ""
        if i in ref_picks:
            same = np.sort(ours["indexer_topk"][i], -1) == np.sort(ref_picks[i], -1)
            agree = f"indexer sets {same.all(-1).mean():.1%}"
        table.add_row(f"layer {i} ({cfg.attn_kinds[i]}) streams", f"{err.max():.3e}", f"{err.max() / scale:.3e}",
                      f"{err.mean() / scale:.3e}", agree)
    err = np.abs(ours["logits"].astype(np.float64) - ref_logits)
    scale = np.abs(ref_logits).max()
    argmax = (ours["logits"].argmax(-1) == ref_logits.argmax(-1)).mean()
    table.add_row("[bold]logits", f"{err.max():.3e}", f"{err.max() / scale:.3e}", f"{err.mean() / scale:.3e}",
                  f"argmax {argmax:.1%}")
    console.print(table)
    console.print(f"transformers {t_ref:.2f}s (incl. build), dinfer_jax {t_ours:.2f}s (incl. compile)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
