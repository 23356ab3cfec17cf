"""Which of the model's operations give a row the same bits whatever the other rows (batch invariance), on the
current backend.

Each probe runs one operation on ``T`` rows for several ``T`` (and row positions), with one fixed row planted at
the last position, and reports whether that row's output is bitwise the same at every ``T``; then the serving step
of the tiny models (``model_step``) for one prompt alone and inside other batches, with the batch-invariant
tracing (:mod:`dinfer_jax.models.invariant`) and without it. Used to find what breaks invariance on a backend
(``docs/batch_invariance.md``)::

    python3 scripts/probe_invariance.py [--out results.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dinfer_jax import SamplingParams  # noqa: E402
from dinfer_jax.engine.runner import _device_sample  # noqa: E402
from dinfer_jax.models import load_config, mhc, ops, random_model  # noqa: E402
from dinfer_jax.models.attention_invariant import _attend_tile, index_dots_invariant  # noqa: E402
from dinfer_jax.models.invariant import (  # noqa: E402
    CPU_INVARIANT_OPTIONS,
    DEFAULT_TILE,
    active_tile,
    batch_invariant,
    token_tiled,
)
from dinfer_jax.models.moe import moe  # noqa: E402
from dinfer_jax.sampling import SamplingTensors  # noqa: E402

TS = (1, 2, 5, 16, 17, 40, 100)


def _row_stable(fn, make, tile: int, ts: tuple[int, ...] = TS) -> tuple[bool, float]:
    """(bitwise equal at every T, largest difference) of the last row's output, a fixed input row."""
    def traced(x):
        with batch_invariant(tile):
            return fn(x)

    opts = CPU_INVARIANT_OPTIONS if tile and jax.default_backend() == "cpu" else None
    f = jax.jit(traced, compiler_options=opts)
    fixed = make(1)
    base, worst = None, 0.0
    for t in ts:
        x = make(t).at[t - 1].set(fixed[0])
        y = np.asarray(f(x))[t - 1]
        if base is None:
            base = y
        else:
            worst = max(worst, float(np.abs(y - base).max()))
    return worst == 0.0, worst


def op_probes(tiles: tuple[int, int], ts: tuple[int, ...], report) -> None:
    """Each probe with the default tracing and the batch-invariant one (``tiles``); ``report(name, a, b)``."""
    rng = np.random.default_rng(0)

    def normal(*shape):
        return lambda t: jnp.asarray(rng.standard_normal((t, *shape)), jnp.float32)

    w = jnp.asarray(rng.standard_normal((512, 256)), jnp.float32)
    site = {"fn": jnp.asarray(rng.standard_normal((24, 4 * 64)), jnp.float32),
            "base": jnp.asarray(rng.standard_normal(24), jnp.float32),
            "scale": jnp.asarray(rng.standard_normal(3), jnp.float32)}
    cfg = load_config("tiny-v4")
    ffn = random_model(cfg, seed=3, include_mtp=False).params["layers"][5]["ffn"]
    H, d, W = 4, 32, 8
    sink = jnp.asarray(rng.standard_normal(H), jnp.float32)

    def attend(x):
        t = x.shape[0]
        q, wr, wv = x[:, :H * d].reshape(t, H, d), x[:, H * d:(H + W) * d].reshape(t, W, d), x[:, -W:] > 0
        if active_tile():
            return token_tiled(lambda a, b, c: _attend_tile(a, b, c, None, None, sink), q, wr, wv, lead=1)
        return _attend_tile(q, wr, wv, None, None, sink)

    keys = jnp.asarray(rng.standard_normal((1, 100, 32)), jnp.float32)

    def index(x):
        q, wt = x[:, :4 * 32].reshape(-1, 4, 32), x[:, 4 * 32:]
        if active_tile():
            return index_dots_invariant(q[None], wt[None], keys)[0]
        dots = jnp.einsum("shd,td->sht", q, keys[0], precision=jax.lax.Precision.HIGHEST)
        return jnp.einsum("sht,sh->st", jax.nn.relu(dots), wt, precision=jax.lax.Precision.HIGHEST)

    def sampler(x):   # the engine's sampler program: whole-vocabulary logprobs of temperature-1 draws
        t = x.shape[0]
        samp = SamplingTensors.from_params([SamplingParams(temperature=1.0)] * t, [7] * t, [5] * t,
                                           num_top_logprobs=x.shape[1])
        return _device_sample(x, samp, max_rows=t, batch_invariant=active_tile())[1].top_logprobs

    probes = {
        "sampler log-softmax [T,72]": (sampler, normal(72)),
        "linear [T,256]·[256,512]": (lambda x: ops.linear(x, w), normal(256)),
        "rms_norm [T,64]": (lambda x: ops.rms_norm(x, None, 1e-6), normal(64)),
        "softmax [T,64]": (lambda x: jax.nn.softmax(x, -1), normal(64)),
        "exp, cos (elementwise)": (lambda x: jnp.exp(x) + jnp.cos(x), normal(64)),
        "mHC mixes + Sinkhorn": (lambda x: mhc.hc_pre(x[:, None], site, hc_mult=4, sinkhorn_iters=20, hc_eps=1e-6,
                                                      norm_eps=1e-6)[0][:, 0], normal(4, 64)),
        "attention block (online softmax)": (attend, normal(H * d + W * d + W)),
        "indexer scores (100 keys)": (index, normal(4 * 32 + 4)),
        "MoE (tiny V4 layer)": (lambda x: moe(ffn, x[None], None, cfg=cfg, hash_routed=False)[0][0],
                                normal(cfg.hidden_size)),
    }
    for name, (fn, make) in probes.items():
        report(name, *(_row_stable(fn, make, tile, ts) for tile in tiles))


STEP_VARIANTS = {   # (preset, config overrides): single layer kinds of the tiny V4 model, and the whole models
    "tiny-v4, 1 sliding layer": ("tiny-v4", dict(num_layers=1, compress_ratios=(0,), attn_kinds=("sliding",),
                                                 hash_layers=(False,))),
    "tiny-v4, sliding + CSA": ("tiny-v4", dict(num_layers=2, compress_ratios=(0, 4), attn_kinds=("sliding", "csa"),
                                               hash_layers=(False, False))),
    "tiny-v4, sliding + HCA": ("tiny-v4", dict(num_layers=2, compress_ratios=(0, 16),
                                               attn_kinds=("sliding", "hca"), hash_layers=(False, False))),
    "tiny-v4": ("tiny-v4", None),
    "tiny-v41": ("tiny-v41", None),
}


# (rows B, tokens per row Q, the prompt's row, pages per row, other rows' tokens): the prompt alone, then among others
STEP_SHAPES = [(1, 16, 0, 2, 0), (2, 16, 1, 2, 10), (4, 32, 2, 4, 30), (8, 16, 7, 4, 16)]


def step_probe(variant: str, tile: int, dump: Path | None = None) -> tuple[bool, float]:
    """One prompt's logits through the serving step alone and at other rows of other batches (the tests'
    ``_step_rows``); prints where the row's results first differ (the layers' output streams or only the head's
    logits). ``dump``: write each shape's optimised program text there (``<variant>-<tile>-<B>x<Q>.hlo``), to
    compare XLA's fusions between shapes."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_batch_invariance import _step_rows

    def write(B: int, Q: int, compiled) -> None:
        if dump is not None:
            dump.mkdir(parents=True, exist_ok=True)
            tag = re.sub(r"[^A-Za-z0-9]+", "_", variant)
            (dump / f"{tag}-{tile}-{B}x{Q}.hlo").write_text(compiled.as_text())

    name, overrides = STEP_VARIANTS[variant]
    rows = _step_rows(name, tile, STEP_SHAPES, overrides, on_compiled=write)
    d_logits = [float(np.abs(lg - rows[0][0]).max()) for lg, _ in rows[1:]]
    d_streams = [float(np.abs(st - rows[0][1]).max()) for _, st in rows[1:]]
    per = ", ".join(f"{B}x{Q}: {a:.1e} / {b:.1e}"
                    for (B, Q, *_), a, b in zip(STEP_SHAPES[1:], d_streams, d_logits, strict=True))
    print(f"  {variant} (tile {tile}) vs 1x16, streams / logits: {per}", flush=True)
    worst = max(d_logits)
    return worst == 0.0, worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--no-step", action="store_true", help="skip the model-step probes")
    ap.add_argument("--no-ops", action="store_true", help="skip the operation probes")
    ap.add_argument("--steps", default=";".join(STEP_VARIANTS), help="semicolon-separated model-step variants")
    ap.add_argument("--invariant-only", action="store_true", help="model steps with the batch-invariant tracing only")
    ap.add_argument("--dump", type=Path, default=None, help="write the step programs' optimised text here")
    ap.add_argument("--ts", default=",".join(map(str, TS)), help="comma-separated row counts T")
    args = ap.parse_args(argv)
    ts = tuple(int(t) for t in args.ts.split(","))
    results = {}
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}; T in {ts}")
    print(f"{'probe':<38} {'default':>22} {'batch-invariant':>22}")

    def report(key: str, a: tuple[bool, float], b: tuple[bool, float]) -> None:
        fmt = functools.partial("{}: {:.1e}".format)
        da, db = fmt("same" if a[0] else "DIFFERS", a[1]), fmt("same" if b[0] else "DIFFERS", b[1])
        print(f"{key:<38} {da:>22} {db:>22}", flush=True)
        results[key] = {"default": {"invariant": a[0], "max_diff": a[1]},
                        "batch_invariant": {"invariant": b[0], "max_diff": b[1]}}
        if args.out:
            args.out.write_text(json.dumps({"backend": jax.default_backend(), "jax": jax.__version__, "T": ts,
                                            "results": results}, indent=1))

    if not args.no_ops:
        op_probes((0, DEFAULT_TILE), ts, report)
    if not args.no_step:
        for name in args.steps.split(";"):
            default = (False, float("nan")) if args.invariant_only else step_probe(name, 0, args.dump)
            report(f"step: {name}", default, step_probe(name, DEFAULT_TILE, args.dump))
    return 0


if __name__ == "__main__":
    sys.exit(main())
