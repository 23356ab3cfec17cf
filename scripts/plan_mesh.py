"""Per-device memory of every (dp, cp, ep) layout of a model on N devices, from abstract shapes (no allocation).

Usage::

    python scripts/plan_mesh.py --model deepseek-v4.1-flash --devices 8 --hbm-gb 141 [--context N --batch B]

Prints a Markdown table (weights and KV pool per device, Engram tables per host) and flags the layouts whose
weights + KV exceed ``--hbm-gb`` (GB = 10^9 bytes). What is counted: :mod:`sharding.plan`.
"""

from __future__ import annotations

import argparse
import sys

from dinfer_jax.models import load_config
from sharding.plan import format_table, plan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="preset name, config.json path or checkpoint directory")
    ap.add_argument("--devices", type=int, required=True, help="number of devices (workers = dp·cp)")
    ap.add_argument("--hbm-gb", type=float, required=True, help="HBM per device, GB (10^9 bytes)")
    ap.add_argument("--context", type=int, default=65536, help="tokens per sequence (default 65536)")
    ap.add_argument("--batch", type=int, default=64, help="concurrent sequences in all, split over DP engines")
    ap.add_argument("--block-size", type=int, default=128, help="KV page size in tokens (DeepInfer: 128)")
    ap.add_argument("--no-mtp", action="store_true", help="leave out the MTP / DSpark draft weights")
    args = ap.parse_args(argv)
    cfg = load_config(args.model)
    rows = plan(cfg, args.devices, int(args.hbm_gb * 1e9), args.context, args.batch, block_size=args.block_size,
                include_mtp=not args.no_mtp)
    print(f"{args.model} on {args.devices} devices of {args.hbm_gb:g} GB: context {args.context}, batch "
          f"{args.batch} (split over DP engines), KV page {args.block_size} tokens")
    print(format_table(rows))
    bad = [r for r in rows if not r.fits]
    print(f"{len(rows) - len(bad)} of {len(rows)} layouts fit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
