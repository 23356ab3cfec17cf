#!/usr/bin/env python
"""Train the bundled default model's DSpark drafter on its own greedy output (self-distillation).

The target model is frozen: only ``params["mtp"]`` (the three DSpark draft layers, the main projection, the Markov
and confidence heads) is trained; the shared embedding and LM head stay as they are, so every target output is
unchanged. Greedy speculative decoding accepts a draft iff it equals the target's argmax, so the training data is
what the target itself writes: prompts cut from the training corpus (the same topics and held-out split as
``scripts/train_tiny.py``; ``examples/prompts.txt`` is never seen) are continued greedily by the engine, and the
drafter learns, at anchors a inside the continuation, to predict tokens a+2 … a+1+block from the target features
up to a and the token at a+1 (teacher-forced Markov chain, the same inference code as ``train_tiny.py``'s drafter
loss). The confidence head learns whether each draft row is right.

Reproducible (fixed seeds); on the project's 2-core CPU it takes about 30 minutes (5 to generate the data, 22 to
train, the rest to evaluate)::

    python scripts/train_drafter.py          # rewrites the draft tensors of dinfer_jax/bundled/default/

Then it reloads the saved checkpoint and reports, on ``examples/prompts.txt`` (greedy, 64 tokens, k drafts per
verification), the mean acceptance length and whether speculative output equals plain output.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from dinfer_jax import LLM, SamplingParams  # noqa: E402
from dinfer_jax.checkpoints import resolve_checkpoint  # noqa: E402
from dinfer_jax.loading.safetensors_io import SafetensorsFile, save_file  # noqa: E402
from dinfer_jax.models import dspark, load_model, run  # noqa: E402
from dinfer_jax.models.params import is_spec, param_specs  # noqa: E402


def make_prompts(tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids from random offsets of the training chunks (held-out chunks excluded)."""
    from train_tiny import corpus_chunks, encode_stream, split_chunks

    train, _ = split_chunks(corpus_chunks())
    stream = encode_stream(tokenizer, train)
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, stream.size - length, size=n)
    return [[int(t) for t in stream[s: s + length]] for s in starts]


def greedy_sequences(model, prompts: list[list[int]], gen: int) -> np.ndarray:
    """Prompt + ``gen`` greedy target tokens per prompt, int32 ``[N, len + gen]`` (EOS ignored: fixed length)."""
    S = len(prompts[0]) + gen
    llm = LLM(model, max_num_seqs=32, max_model_len=S + 8, max_num_batched_tokens=512, progress=False)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True), use_tqdm=False)
    return np.asarray([p + list(o.token_ids) for p, o in zip(prompts, outs, strict=True)], np.int32)


def target_features(model, seqs: np.ndarray, batch: int) -> tuple[np.ndarray, float]:
    """DSpark features ``[N,S,F]`` of the frozen target, and the fraction of continuation positions where the
    full forward's argmax disagrees with the engine's token (a consistency check; expected 0)."""
    feats, bad, tot = [], 0, 0
    P = None
    for i in range(0, len(seqs), batch):
        ids = seqs[i: i + batch]
        out = run(model, ids, collect=True)
        feats.append(np.asarray(out.intermediates["dspark_features"], np.float32))
        pred = np.asarray(jnp.argmax(out.logits, -1))[:, :-1]
        P = P or ids.shape[1]
        bad += int((pred[:, P // 4:] != ids[:, 1 + P // 4:]).sum())  # not the prompt region
        tot += pred[:, P // 4:].size
    return np.concatenate(feats), bad / tot


def make_loss(cfg, frozen):
    blk = cfg.dspark_block_size

    def loss_fn(mtp, feats, ids, anchors):
        params = {**frozen, "mtp": mtp}
        B, S = ids.shape
        keys = dspark.main_keys(params, cfg, feats, jnp.arange(S))  # [n_draft,B,S,d]
        K = anchors.shape[1]
        bi = jnp.repeat(jnp.arange(B), K)
        a = anchors.reshape(-1)
        golden = ids[bi, a + 1]
        targets = ids[bi[:, None], a[:, None] + 2 + jnp.arange(blk)[None, :]]
        h = dspark.draft_hidden(params, cfg, keys[:, bi], a, golden)
        dlogits, conf, _ = dspark.dspark_heads(params, cfg, h, golden, sample_fn=lambda l, i: targets[:, i])
        ce = optax.softmax_cross_entropy_with_integer_labels(dlogits, targets).mean()
        hit = (jnp.argmax(dlogits, -1) == targets).astype(jnp.float32)
        # the greedy accepted length of a block: leading run of right rows
        run_len = jnp.sum(jnp.cumprod(hit, axis=1), axis=1).mean()
        c = jnp.clip(conf, 1e-6, 1 - 1e-6)
        bce = -(hit * jnp.log(c) + (1 - hit) * jnp.log(1 - c)).mean()
        return ce + 0.1 * bce, {"draft_ce": ce, "draft_acc": hit.mean(), "accepted_run": run_len, "conf_bce": bce}

    return loss_fn


def save_drafter(path: Path, cfg, mtp) -> int:
    """Rewrite the DSpark tensors of ``path/model.safetensors`` (stored dtypes kept); returns how many changed."""
    specs = param_specs(cfg, include_mtp=True)["mtp"]
    src = SafetensorsFile(path / "model.safetensors")
    tensors = {name: np.array(src.get(name)) for name in src.keys()}  # copies: the file is replaced below
    src.close()
    n = 0
    for spec, val in zip(jax.tree_util.tree_leaves(specs, is_leaf=is_spec), jax.tree_util.tree_leaves(mtp),
                         strict=True):
        arr = np.asarray(val)
        names = ([spec.ckpt.format(e=e) for e in range(spec.shape[0])] if spec.stacked_experts else [spec.ckpt])
        parts = list(arr) if spec.stacked_experts else [arr]
        for name, part in zip(names, parts, strict=True):
            old = tensors[name]
            dt = ml_dtypes.bfloat16 if old.dtype == ml_dtypes.bfloat16 else old.dtype
            tensors[name] = part.astype(dt).reshape(old.shape)
            n += 1
    tmp = path / "model.safetensors.tmp"
    save_file(tensors, tmp, metadata={"format": "pt"})
    tmp.replace(path / "model.safetensors")
    return n


def evaluate(path: Path, k: int, max_tokens: int) -> dict:
    """Greedy on examples/prompts.txt with and without DSpark (sync loop): acceptance and equality."""
    prompts = [line.rstrip("\n") for line in open(REPO / "examples" / "prompts.txt") if line.strip()]
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    kw = dict(max_num_seqs=16, max_model_len=256, progress=False, async_scheduling=False)
    plain = LLM(str(path), **kw).generate(prompts, sp, use_tqdm=False)
    spec_llm = LLM(str(path), speculative="dspark", num_speculative_tokens=k, **kw)
    spec = spec_llm.generate(prompts, sp, use_tqdm=False)
    m = spec_llm.metrics()
    return {"mean_acceptance_length": m["mean_acceptance_length"], "verify_steps": m["spec_verify_steps"],
            "equal_to_plain": [o.token_ids for o in spec] == [o.token_ids for o in plain]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(resolve_checkpoint("default")))
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen", type=int, default=160)
    ap.add_argument("--steps", type=int, default=2500)
    ap.add_argument("--batch", type=int, default=16, help="sequences per step")
    ap.add_argument("--anchors", type=int, default=16, help="anchors per sequence")
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--k", type=int, default=4, help="drafts per verification in the evaluation")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--data-cache", default="", help="npz file for the greedy sequences and features (reused if "
                    "present; delete it after changing the model or the data arguments)")
    ap.add_argument("--metrics", default=str(REPO / "docs" / "default_model_drafter.json"))
    args = ap.parse_args()

    t0 = time.time()
    path = Path(args.model)
    model = load_model(path, dtype="float32")
    cfg = model.config
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    prompts = make_prompts(tok, args.prompts, args.prompt_len, args.seed)
    cache = Path(args.data_cache) if args.data_cache else None
    if cache is not None and cache.is_file():  # the same prompts, model and lengths: reuse the greedy data
        data = np.load(cache)
        seqs, feats, mismatch = data["seqs"], data["feats"], float(data["mismatch"])
    else:
        seqs = greedy_sequences(model, prompts, args.gen)
        feats, mismatch = target_features(model, seqs, 32)
        if cache is not None:
            np.savez(cache, seqs=seqs, feats=feats, mismatch=mismatch)
    t_gen = time.time() - t0
    print(f"{len(seqs)} greedy sequences of {seqs.shape[1]} tokens in {t_gen:.0f}s; forward/engine argmax "
          f"mismatch {mismatch:.4%}", flush=True)

    frozen = {k: v for k, v in model.params.items() if k != "mtp"}
    mtp = model.params["mtp"]
    sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, 50, args.steps, end_value=args.lr * 0.05)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.01))
    opt_state = opt.init(mtp)
    loss_fn = make_loss(cfg, frozen)

    @jax.jit
    def step(mtp, opt_state, feats, ids, anchors):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(mtp, feats, ids, anchors)
        updates, opt_state = opt.update(grads, opt_state, mtp)
        return optax.apply_updates(mtp, updates), opt_state, aux

    rng = np.random.default_rng(args.seed + 1)
    blk, S, P = cfg.dspark_block_size, seqs.shape[1], args.prompt_len
    hold = max(1, len(seqs) // 16)  # held-out sequences for the draft accuracy printed at the end
    train_idx = np.arange(hold, len(seqs))
    acc: dict[str, list[float]] = {}
    for i in range(1, args.steps + 1):
        rows = rng.choice(train_idx, size=args.batch, replace=False)
        anchors = rng.integers(P - 1, S - 1 - blk, size=(args.batch, args.anchors)).astype(np.int32)
        mtp, opt_state, aux = step(mtp, opt_state, jnp.asarray(feats[rows]), jnp.asarray(seqs[rows]),
                                   jnp.asarray(anchors))
        for key, v in aux.items():
            acc.setdefault(key, []).append(float(v))
        if i % 100 == 0 or i == args.steps:
            print(f"step {i:4d}  " + "  ".join(f"{key} {np.mean(v):.3f}" for key, v in acc.items())
                  + f"  {time.time() - t0:.0f}s", flush=True)
            acc = {}
    held = np.arange(hold)
    anchors = np.tile(np.arange(P - 1, S - 1 - blk, 4, dtype=np.int32), (hold, 1))
    _, aux = loss_fn(mtp, jnp.asarray(feats[held]), jnp.asarray(seqs[held]), jnp.asarray(anchors))
    summary = {"held_out_" + key: round(float(v), 4) for key, v in aux.items()}
    summary.update(sequences=len(seqs), seq_len=int(S), prompt_len=P, steps=args.steps,
                   forward_engine_mismatch=mismatch, train_seconds=round(time.time() - t0, 1))
    if not args.no_save:
        summary["tensors_rewritten"] = save_drafter(path, cfg, mtp)
        summary["eval_prompts_txt"] = evaluate(path, args.k, 64) | {"k": args.k}
        Path(args.metrics).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
