# %% [markdown]
# # A tour of the bundled default model
#
# `dinfer_jax` ships a small model of the DeepSeek-V4.1 architecture (every feature on: ratio-0/2/1 layers with
# shared compressed KV, index sources, candidate two-level top-k, Engram, shifted mHC, MoE with a shared expert and
# the DSpark drafter) trained on Python's own documentation topics (`pydoc_data.topics`) by
# `scripts/train_tiny.py`. It lives in `dinfer_jax/bundled/default/` and is registered as `"default"`.
#
# Run as a script (`python examples/default_model_tour.py [OUT_DIR]`) or cell by cell (`# %%`) in VS Code /
# Jupyter. The figures (matplotlib: `pip install -e ".[examples]"`) are written to OUT_DIR, default `docs/figures/`.

# %%
import sys
from pathlib import Path

import numpy as np

from dinfer_jax import LLM, SamplingParams
from dinfer_jax.engine.runner import Buckets
from dinfer_jax.models import forward_logits, inspect, load_model

sys.path.insert(0, str(Path(__file__).resolve().parent))  # examples/ is not a package
import tour_plots  # noqa: E402

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else (
    Path(__file__).resolve().parents[1] / "docs" / "figures")
OUT.mkdir(parents=True, exist_ok=True)

model = load_model("default")  # resolves the registered name to dinfer_jax/bundled/default/
cfg = model.config
print(f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, {model.num_params:,} parameters")
print("compress ratios per layer:", cfg.compress_ratios)
print("KV sources", cfg.kv_source_layer_ids, "| index sources", cfg.index_source_layer_ids,
      "| candidate source", cfg.candidate_source_layer_id, "| Engram layers", cfg.engram_layer_ids)

# %% [markdown]
# ## Generate with the engine
# `LLM` runs the paged, cached engine (async scheduling and chunked prefill on by default). Greedy decoding of
# documentation-style beginnings:

# %%
prompts = [ln for ln in (Path(__file__).resolve().parent / "prompts.txt").read_text().splitlines() if ln.strip()]
llm = LLM(model="default", max_num_seqs=4, max_model_len=256, max_num_batched_tokens=64,
          buckets=Buckets(decode_batch=(4,), prefill_batch=(4,), prefill_len=(64,)))  # few shapes: fast warm-up
greedy = SamplingParams(temperature=0.0, max_tokens=24)
for p, out in zip(prompts, llm.generate(prompts, greedy, use_tqdm=False), strict=True):
    print(f"{p!r} -> {out.text!r}")

# %% [markdown]
# ## Indexer selections and router choices
# `inspect` runs the full-sequence forward and returns the intermediates as numpy arrays: per index-source layer
# the compressed rows each query selected (`indexer_topk`, −1 = unused slot) and the candidate blocks of the
# candidate source; per layer the routed experts (`router_indices`) and their weights.

# %%
tok = llm.tokenizer
text = "The \"with\" statement is used to wrap the execution of a block with methods defined by a context manager."
ids = np.array([tok.encode(text).ids])
pieces = [tok.decode([t]) for t in ids[0]]
info = inspect(model, ids)
last = ids.shape[1] - 1
for layer, topk in sorted(info["indexer_topk"].items()):
    ratio = cfg.compress_ratios[layer]
    sel = [int(i) for i in topk[0, last] if i >= 0]
    # a compressed row j of a ratio-r layer covers tokens r*j .. r*j + r - 1
    spans = ["".join(pieces[ratio * j: ratio * j + ratio]) for j in sel]
    print(f"layer {layer} (ratio {ratio}) last query selects rows {sel}: {spans}")
fig = tour_plots.plot_indexer_selections({k: v[0] for k, v in info["indexer_topk"].items()},
                                         cfg.compress_ratios, pieces)
fig.savefig(OUT / "tour_indexer_selections.png", dpi=110)
for layer, blocks in sorted(info["candidate_blocks"].items()):
    print(f"layer {layer} candidate blocks of the last query: {blocks[0, last].tolist()}")
for layer in sorted(info["router_indices"]):
    experts = info["router_indices"][layer][0]
    weights = info["router_weights"][layer][0]
    counts = np.bincount(experts.reshape(-1), minlength=cfg.n_routed_experts)
    print(f"layer {layer} expert load over the sentence: {counts.tolist()}; "
          f"token {pieces[1]!r} -> experts {experts[1].tolist()} weights {np.round(weights[1], 3).tolist()}")
fig = tour_plots.plot_expert_load({k: v[0] for k, v in info["router_indices"].items()}, cfg.n_routed_experts)
fig.savefig(OUT / "tour_expert_load.png", dpi=110)

# %% [markdown]
# The engine's cached path and the full-sequence forward agree: the greedy tokens equal the argmax of
# `forward_logits` on the growing sequence.

# %%
out = llm.generate([ids[0].tolist()], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                   use_tqdm=False)[0]
seq = ids[0].tolist() + out.token_ids
logits = forward_logits(model, np.array([seq]))
ref = logits[0, ids.shape[1] - 1: len(seq) - 1].argmax(-1).tolist()
print("engine:", out.token_ids, "\nforward:", ref, "\nequal:", out.token_ids == ref)

# %% [markdown]
# ## Comparing two sampling settings
# Greedy decoding is deterministic; sampling at temperature 0.8 with top-p 0.9 (a fixed `seq_seed` per request
# makes it reproducible) trades faithfulness to the documentation for variety.
# The figure shows each sampled token's log-probability under the filtered distribution the sampler drew from;
# for greedy rows that distribution is one-hot (DeepInfer clamps the temperature to 1e-5), so the line sits at 0.

# %%
prompt = "A class definition defines"
settings = {
    "greedy": [SamplingParams(temperature=0.0, max_tokens=32, logprobs=0)] * 3,
    "T=0.8, top-p 0.9": [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=32, seq_seed=s, logprobs=0)
                         for s in (1, 2, 3)],
}
runs = {}
for name, sps in settings.items():
    print(f"--- {name}")
    outs = llm.generate([prompt] * len(sps), sps, use_tqdm=False)
    for o in outs:
        print("   ", repr(prompt + o.text))
    runs[name] = [(o.text, [e["logprob"] for e in o.logprobs]) for o in outs]
fig = tour_plots.plot_sampling_settings(prompt, runs)
fig.savefig(OUT / "tour_sampling_settings.png", dpi=110)

# %% [markdown]
# ## Structured outputs
# `SamplingParams(so_args=...)` constrains a request to a JSON Schema, a regex or an EBNF (GBNF) grammar, as in
# DeepInfer. The grammar is compiled by llguidance off the step loop; each step, the engine masks every token the
# grammar forbids before sampling. The model has only read Python's documentation, so the *values* are what it
# finds likely; the *form* is guaranteed. A trigger (`trigger_token_ids`) leaves the text free until it appears.

# %%
import json  # noqa: E402

schema = {"type": "object", "required": ["name", "kind", "arguments"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "kind": {"enum": ["function", "class", "module"]},
                         "arguments": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 8}}}}
structured = [
    SamplingParams(temperature=0.0, max_tokens=64, so_args={"schema_type": "json", "schema": json.dumps(schema)}),
    SamplingParams(temperature=0.7, seq_seed=4, max_tokens=64,
                   so_args={"schema_type": "json", "schema": json.dumps(schema)}),
    SamplingParams(temperature=0.0, max_tokens=16,
                   so_args={"schema_type": "regex", "schema": r"[A-Z][a-z]{1,10} (is|are) [a-z]{1,10}\."}),
    SamplingParams(temperature=0.0, max_tokens=40,  # free text until " is", then the grammar
                   so_args={"schema_type": "regex", "schema": " [0-9]{1,2} times\\.",
                            "trigger_token_ids": tok.encode(" is").ids}),
]
for sp, out in zip(structured, llm.generate(["The open() function"] * 4, structured, use_tqdm=False), strict=True):
    print(f"{sp.so_args['schema_type']:5s} {out.finish_reason:6s} {out.text!r}")
    if sp.so_args["schema_type"] == "json":
        print("      parsed:", json.loads(out.text))
print(f"figures written to {OUT}")
