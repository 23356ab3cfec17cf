#!/usr/bin/env python
"""Train the bundled default model: a small DeepSeek-V4.1-architecture model on Python's documentation topics.

Everything is reproducible (fixed seeds, fixed step count) and runs on a 2-core CPU in well under 30 minutes::

    python scripts/train_tiny.py                       # writes dinfer_jax/bundled/default/ and docs/default_model_*

Corpus: ``pydoc_data.topics`` (the documentation topics that ship with CPython). It is cut into ~2000-character
chunks at paragraph boundaries; every 20th chunk is held out for validation. A byte-level BPE ``tokenizer.json``
is trained on the training chunks with ``tokenizers`` (ids 0/1/2/3 = BOS / EOS / pad / DSpark noise).

Model: V4.1 with every feature on — ratio-0/2/1 layers with KV sources and consumers, index sources, candidate
two-level top-k, Engram at two layers, shifted mHC, MoE with a shared expert, and three DSpark draft layers. The
training loss runs the *inference* code: :func:`dinfer_jax.models.v4.forward` (the full-sequence forward) for the
next-token loss, and :mod:`dinfer_jax.models.dspark` (``main_keys`` → ``draft_hidden`` → ``dspark_heads``) for the
drafter loss at random anchors (teacher-forced Markov chain, confidence head trained to predict a correct draft).
Engram tables are trainable device arrays here; rows are gathered with ``jnp.take`` from host-computed hash ids
(:func:`engram.engram_hash` of :func:`engram.ngram_rows` of the compressed token map), exactly the rows inference
gathers on the host. The only training-specific piece is a straight-through gradient for the FP8/FP4 KV
fake-quant rounding (forward values unchanged).

The result is saved in the Hugging Face V4.1 layout (composite ``config.json`` with ``text_config``,
``model.safetensors`` in BF16/F32, ``tokenizer.json``) and read back by ``dinfer_jax.models.load_model``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from dinfer_jax.models import dspark, engram, fake_quant  # noqa: E402
from dinfer_jax.models.config import config_from_dict  # noqa: E402
from dinfer_jax.models.params import ParamSpec, count_params, init_params, is_spec, param_specs  # noqa: E402
from dinfer_jax.models.v4 import ForwardOptions, forward  # noqa: E402

SPECIAL_TOKENS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", engram.PAD_TOKEN, "<｜▁noise▁｜>"]
BOS_ID, EOS_ID, PAD_ID, NOISE_ID = 0, 1, 2, 3
CHUNK_CHARS = 2000
VAL_EVERY = 20  # every 20th chunk is held out

# ----------------------------------------------------------------------------------------------------------------
# corpus and tokenizer


def corpus_chunks() -> list[tuple[str, str]]:
    """``(topic, text)`` chunks of ≥ CHUNK_CHARS characters, cut at blank lines, topics in sorted order."""
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        paras = [p for p in topics[name].split("\n\n") if p.strip()]
        cur: list[str] = []
        for p in paras:
            cur.append(p)
            if sum(len(c) + 2 for c in cur) >= CHUNK_CHARS:
                out.append((name, "\n\n".join(cur)))
                cur = []
        if cur:
            out.append((name, "\n\n".join(cur)))
    return out


def split_chunks(chunks: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    train = [c for i, c in enumerate(chunks) if i % VAL_EVERY != VAL_EVERY // 2]
    val = [c for i, c in enumerate(chunks) if i % VAL_EVERY == VAL_EVERY // 2]
    return train, val


def train_tokenizer(texts: list[str], vocab_size: int, path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    tok.save(str(path))


def encode_stream(tok, chunks: list[tuple[str, str]]) -> np.ndarray:
    """Token ids of the chunks in order; a topic's last chunk ends with EOS."""
    ids: list[int] = []
    for i, (topic, text) in enumerate(chunks):
        ids += tok.encode(text + "\n\n").ids
        if i + 1 == len(chunks) or chunks[i + 1][0] != topic:
            ids.append(EOS_ID)
    return np.asarray(ids, np.int32)


# ----------------------------------------------------------------------------------------------------------------
# model config


def make_config(vocab_size: int, compressed_vocab: int) -> dict:
    """The composite V4.1 ``config.json`` (text_config holds the model); Engram table sizes filled in below."""
    text = {
        "architectures": ["DeepseekV41ForCausalLM"],
        "model_type": "deepseek_v41_text",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 64,
        "o_groups": 2,
        "o_lora_rank": 32,
        "sliding_window": 64,
        # 8 backbone layers: sliding, sliding, ratio 2 (KV + index source), ratio 2 (consumer), ratio 1 (KV + index
        # + candidate source), ratio 1 (consumer), ratio 1 (index source on the candidates), ratio 1 (consumer);
        # then the three DSpark draft layers (sliding).
        "compress_ratios": [0, 0, 2, 2, 1, 1, 1, 1, 0, 0, 0],
        "kv_source_layer_ids": [2, 4],
        "index_source_layer_ids": [2, 4, 6],
        "candidate_source_layer_id": 4,
        "candidate_block_size": 8,
        "candidate_topk_blocks": 4,
        "index_n_heads": 4,
        "index_head_dim": 32,
        "index_topk": 16,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
                         "beta_fast": 32.0, "beta_slow": 1.0},
        "max_position_embeddings": 2048,
        "moe_intermediate_size": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "routed_scaling_factor": 1.5,
        "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "swiglu_limit": 10.0,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "gate_temp": 1.0,
        "engram_layer_ids": [1, 3],
        "engram_vocab_size": 1024,
        "engram_max_ngram_size": 3,
        "engram_n_heads": 2,
        "engram_head_dim": 32,
        "engram_pad_token_id": PAD_ID,
        "engram_compressed_vocab_size": compressed_vocab,
        "engram_num_embeddings": [0, 0],
        "num_nextn_predict_layers": 3,
        "dspark_block_size": 5,
        "dspark_noise_token_id": NOISE_ID,
        "dspark_target_layer_ids": [3, 5, 7],
        "dspark_markov_rank": 16,
        "dspark_n_routed_experts": 4,
        "dspark_num_experts_per_tok": 2,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
    }
    cfg = config_from_dict({"model_type": "deepseek_v41", "text_config": text})
    text["engram_num_embeddings"] = list(engram.engram_table_sizes(cfg))
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
            "text_config": text, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
            "tie_word_embeddings": False}


# ----------------------------------------------------------------------------------------------------------------
# training-only gradient rule: straight-through estimator for the fake-quant rounding (forward values unchanged)


def _install_ste() -> None:
    orig = fake_quant._round_to_grid

    @jax.custom_jvp
    def ste_round(y, mant_bits, min_exp):
        return orig(y, mant_bits, min_exp)

    @ste_round.defjvp
    def _jvp(primals, tangents):
        y, m, e = primals
        return ste_round(y, m, e), tangents[0]

    def patched(y, mant_bits, min_exp):
        return ste_round(y, mant_bits, min_exp)

    fake_quant._round_to_grid = patched


# ----------------------------------------------------------------------------------------------------------------
# losses


def engram_ids(cfg, cmap: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Host-side table row ids int32 ``[n_engram, B, S, (M−1)·n_heads]`` for raw ids ``[B, S]`` from position 0."""
    cmp = cmap[ids]
    rows = engram.ngram_rows(cmp, cfg.engram_max_ngram_size, int(cmap[cfg.engram_pad_id]))
    return engram.engram_hash(cfg, rows).astype(np.int32)


def gather_engram(tables, rows):
    """``[n_engram, B, S, H·head_dim]`` rows of the trainable tables (the same rows inference gathers)."""
    out = []
    for t, r in zip(tables, rows, strict=True):
        g = jnp.take(t, r, axis=0)  # [B,S,H,hd]
        out.append(g.reshape(*g.shape[:-2], -1))
    return jnp.stack(out)


def make_loss(cfg, draft_weight: float):
    blk = cfg.dspark_block_size

    def loss_fn(state, ids, erows, anchors):
        params, tables = state["params"], state["engram"]
        x, y = ids[:, :-1], ids[:, 1:]
        B, S = x.shape
        emb = gather_engram(tables, erows)
        out = forward(params, x, cfg=cfg, dtype="float32", options=ForwardOptions(), engram_emb=emb)
        ce = optax.softmax_cross_entropy_with_integer_labels(out.logits, y).mean()
        # DSpark drafter at K anchors per row: golden = token a+1, row i predicts token a+2+i.
        feats = jax.lax.stop_gradient(out.intermediates["dspark_features"])
        keys = dspark.main_keys(params, cfg, feats, jnp.arange(S))  # [n_draft,B,S,d]
        K = anchors.shape[1]
        bi = jnp.repeat(jnp.arange(B), K)
        a = anchors.reshape(-1)
        golden = ids[bi, a + 1]
        targets = ids[bi[:, None], a[:, None] + 2 + jnp.arange(blk)[None, :]]  # [B·K, blk]
        h = dspark.draft_hidden(params, cfg, keys[:, bi], a, golden)
        dlogits, conf, _ = dspark.dspark_heads(params, cfg, h, golden, sample_fn=lambda l, i: targets[:, i])
        dce = optax.softmax_cross_entropy_with_integer_labels(dlogits, targets).mean()
        hit = jax.lax.stop_gradient((jnp.argmax(dlogits, -1) == targets).astype(jnp.float32))
        c = jnp.clip(conf, 1e-6, 1 - 1e-6)
        bce = -(hit * jnp.log(c) + (1 - hit) * jnp.log(1 - c)).mean()
        total = ce + draft_weight * (dce + 0.1 * bce)
        return total, {"ce": ce, "draft_ce": dce, "draft_acc": hit.mean(), "conf_bce": bce}

    return loss_fn


# ----------------------------------------------------------------------------------------------------------------
# checkpoint


def save_checkpoint(directory: Path, config: dict, cfg, params, tables) -> None:
    from dinfer_jax.loading.safetensors_io import save_file

    directory.mkdir(parents=True, exist_ok=True)
    specs = param_specs(cfg, include_mtp=True)
    flat_specs = jax.tree_util.tree_leaves(specs, is_leaf=is_spec)
    flat_vals = jax.tree_util.tree_leaves(params)
    assert len(flat_specs) == len(flat_vals)
    tensors: dict[str, np.ndarray] = {}

    def cast(spec: ParamSpec, a: np.ndarray) -> np.ndarray:
        if spec.integer:
            return a.astype(np.int32)
        return a.astype(np.float32) if spec.keep_fp32 else a.astype(ml_dtypes.bfloat16)

    for spec, val in zip(flat_specs, flat_vals, strict=True):
        arr = np.asarray(val)
        if spec.stacked_experts:
            for e in range(spec.shape[0]):
                tensors[spec.ckpt.format(e=e)] = cast(spec, arr[e])
        else:
            tensors[spec.ckpt] = cast(spec, arr)
    for lid, t in zip(cfg.engram_layer_ids, tables, strict=True):
        tensors[f"layers.{lid}.engram.embed.weight"] = np.asarray(t).astype(ml_dtypes.bfloat16)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    (directory / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}, indent=1) + "\n")


# ----------------------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "dinfer_jax" / "bundled" / "default"))
    ap.add_argument("--docs", default=str(REPO / "docs"))
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=900)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--anchors", type=int, default=4, help="DSpark anchors per sequence")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--draft-weight", type=float, default=0.5)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-save", action="store_true")
    # The bundled checkpoint is the 800-step schedule ended at step 785 (the run's 23-minute safety stop fired
    # there while a test suite shared the CPU); these defaults reproduce it exactly. --stop-at 0 runs all steps.
    ap.add_argument("--stop-at", type=int, default=785,
                    help="end after this step (the LR schedule still spans --steps); 0 = run all --steps")
    ap.add_argument("--max-minutes", type=float, default=0.0,
                    help="safety stop (0 = off): end early, still saving, if training runs longer than this")
    args = ap.parse_args()

    t_start = time.time()
    out_dir, docs = Path(args.out), Path(args.docs)
    out_dir.mkdir(parents=True, exist_ok=True)
    docs.mkdir(parents=True, exist_ok=True)
    _install_ste()

    from tokenizers import Tokenizer

    train_chunks, val_chunks = split_chunks(corpus_chunks())
    tok_path = out_dir / "tokenizer.json"
    train_tokenizer([t for _, t in train_chunks], args.vocab, tok_path)
    tok = Tokenizer.from_file(str(tok_path))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    cmap = engram.build_compressed_token_map(tok_path)
    config = make_config(vocab, int(cmap.max()) + 1)
    cfg = config_from_dict(config)
    assert cfg.engram_num_embeddings == engram.engram_table_sizes(cfg)
    train_ids, val_ids = encode_stream(tok, train_chunks), encode_stream(tok, val_chunks)
    print(f"corpus: {len(train_chunks)} train / {len(val_chunks)} val chunks, {train_ids.size} / {val_ids.size} "
          f"tokens, vocab {vocab}, compressed vocab {cfg.engram_compressed_vocab_size}, "
          f"engram rows {cfg.engram_num_embeddings}", flush=True)

    # unigram baseline (add-one smoothed train counts) on the validation tokens
    counts = np.bincount(train_ids, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    unigram_val = float(-logp[val_ids].mean())
    unigram_train = float(-logp[train_ids].mean())

    params = init_params(cfg, seed=args.seed, dtype=jnp.float32, include_mtp=True, std=0.02)
    rng = np.random.default_rng(args.seed)
    tables = [jnp.asarray(0.02 * rng.standard_normal((rows, cfg.engram_head_dim)), jnp.float32)
              for rows in cfg.engram_num_embeddings]
    state = {"params": params, "engram": tables}
    n_params = count_params(params)
    n_table = sum(int(np.prod(t.shape)) for t in tables)
    print(f"parameters: {n_params:,} (+ {n_table:,} Engram table scalars)", flush=True)

    sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(args.warmup, args.steps // 2), args.steps,
                                               end_value=args.lr * 0.05)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.01))
    opt_state = opt.init(state)
    loss_fn = make_loss(cfg, args.draft_weight)

    @jax.jit
    def train_step(state, opt_state, ids, erows, anchors):
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state, ids, erows, anchors)
        updates, opt_state = opt.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss, aux

    @jax.jit
    def eval_ce(state, ids, erows):
        emb = gather_engram(state["engram"], erows)
        out = forward(state["params"], ids[:, :-1], cfg=cfg, dtype="float32", options=ForwardOptions(),
                      engram_emb=emb)
        return optax.softmax_cross_entropy_with_integer_labels(out.logits, ids[:, 1:]).sum()

    S, B = args.seq, args.batch
    blk = cfg.dspark_block_size

    def windows(stream: np.ndarray) -> np.ndarray:
        n = (stream.size - 1) // S
        return np.stack([stream[i * S: i * S + S + 1] for i in range(n)])

    val_win = windows(val_ids)
    val_erows = engram_ids(cfg, cmap, val_win[:, :-1])

    def evaluate(state) -> float:
        tot = 0.0
        for i in range(0, len(val_win), B):
            w, e = val_win[i:i + B], val_erows[:, i:i + B]
            if len(w) < B:  # pad the batch with copies (excluded from the sum)
                k = len(w)
                w = np.concatenate([w, np.repeat(w[:1], B - k, 0)])
                e = np.concatenate([e, np.repeat(e[:, :1], B - k, 1)], 1)
                full = float(eval_ce(state, jnp.asarray(w), jnp.asarray(e)))
                tot += full - (B - k) * float(eval_ce(state, jnp.asarray(np.repeat(w[:1], B, 0)),
                                                      jnp.asarray(np.repeat(e[:, :1], B, 1)))) / B
            else:
                tot += float(eval_ce(state, jnp.asarray(w), jnp.asarray(e)))
        return tot / (len(val_win) * S)

    log_rows = []
    csv_path = docs / "default_model_loss.csv"
    t0 = time.time()
    acc: dict[str, list[float]] = {}
    for step in range(1, args.steps + 1):
        starts = rng.integers(0, train_ids.size - S - 1, size=B)
        ids = np.stack([train_ids[s: s + S + 1] for s in starts])
        anchors = rng.integers(0, S - 1 - blk, size=(B, args.anchors)).astype(np.int32)
        erows = engram_ids(cfg, cmap, ids[:, :-1])
        state, opt_state, loss, aux = train_step(state, opt_state, jnp.asarray(ids), jnp.asarray(erows),
                                                 jnp.asarray(anchors))
        for k, v in {"loss": loss, **aux}.items():
            acc.setdefault(k, []).append(float(v))
        if step == 1:
            print(f"step 1 (compile + run) {time.time() - t0:.1f}s", flush=True)
            t_steady = time.time()
        stop = (args.max_minutes > 0 and time.time() - t0 > 60 * args.max_minutes) or step == args.stop_at
        if step % args.log_every == 0 or step == args.steps or stop:
            row = {"step": step, **{k: float(np.mean(v)) for k, v in acc.items()},
                   "lr": float(sched(step)), "elapsed_s": round(time.time() - t0, 1), "val_ce": ""}
            acc = {}
            if step % args.eval_every == 0 or step == args.steps or stop:
                row["val_ce"] = evaluate(state)
            log_rows.append(row)
            rate = (step - 1) / max(time.time() - t_steady, 1e-9)
            val = "" if row["val_ce"] == "" else f"  val {row['val_ce']:.3f}"
            print(f"step {step:5d}  ce {row['ce']:.3f}  draft_ce {row['draft_ce']:.3f}  draft_acc "
                  f"{row['draft_acc']:.3f}{val}  {rate:.2f} step/s  {row['elapsed_s']}s", flush=True)
            with open(csv_path, "w", newline="") as f:
                wr = csv.DictWriter(f, fieldnames=list(log_rows[0]))
                wr.writeheader()
                wr.writerows(log_rows)
        if stop:
            print(f"stopped after {step} of {args.steps} scheduled steps", flush=True)
            break
    train_time = time.time() - t0
    val_ce = next(r["val_ce"] for r in reversed(log_rows) if r["val_ce"] != "")
    summary = {"train_ce_last_log": log_rows[-1]["ce"], "val_ce": val_ce, "unigram_val_ce": unigram_val,
               "unigram_train_ce": unigram_train, "draft_ce": log_rows[-1]["draft_ce"],
               "draft_acc": log_rows[-1]["draft_acc"], "params": n_params, "engram_table_scalars": n_table,
               "train_tokens": int(train_ids.size), "val_tokens": int(val_ids.size), "steps": args.steps,
               "batch": B, "seq": S, "train_seconds": round(train_time, 1), "vocab": vocab,
               "compressed_vocab": cfg.engram_compressed_vocab_size}
    summary["steps_run"] = step
    np.savez(Path(os.environ.get("TMPDIR", "/tmp")) / "train_tiny_state.npz",
             *[np.asarray(x) for x in jax.tree_util.tree_leaves(state)])
    if not args.no_save:
        save_checkpoint(out_dir, config, cfg, state["params"], state["engram"])
        summary["checkpoint_bytes"] = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
    (docs / "default_model_metrics.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot_loss(log_rows, unigram_val, docs / "default_model_loss.png")
    print(json.dumps(summary, indent=1))
    print(f"total {time.time() - t_start:.0f}s")


def plot_loss(rows: list[dict], unigram: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["ce"] for r in rows], label="train (next token)")
    ax.plot(steps, [r["draft_ce"] for r in rows], label="train (DSpark drafter)", alpha=0.8)
    vs = [(r["step"], r["val_ce"]) for r in rows if r["val_ce"] != ""]
    ax.plot([s for s, _ in vs], [v for _, v in vs], "o-", label="validation (next token)")
    ax.axhline(unigram, color="gray", ls="--", label=f"unigram baseline (val) {unigram:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("default model: DeepSeek-V4.1 architecture on pydoc_data.topics")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
