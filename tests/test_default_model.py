"""The bundled default model (``dinfer_jax/bundled/default``, trained by ``scripts/train_tiny.py``).

* It loads by name through the same loader as released checkpoints (``load_model("default")``).
* Through ``LLM.generate`` (async scheduling, chunked prefill with chunks shorter than the passage) the greedy
  continuation of a passage of the training text reproduces the corpus's next 16 tokens exactly. The expected
  continuation is the corpus text (``pydoc_data.topics``), not a recording of the model's output.
* The engine's cached path equals the full-sequence forward's argmax on the growing sequence.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from dinfer_jax import LLM, SamplingParams
from dinfer_jax.checkpoints import REGISTRY
from dinfer_jax.engine.runner import Buckets
from dinfer_jax.models import forward_logits, load_config, load_model
from provision import missing

DEFAULT_DIR = REGISTRY["default"]

# A passage of the training text (topic "shifting" of pydoc_data.topics) and the text that follows it in the corpus.
PASSAGE = (
    'Shifting operations\n'
    '*******************\n'
    '\n'
    'The shifting operations have lower priority than the arithmetic\n'
    'operations:\n'
    '\n'
    '   shift_expr ::= a_expr | shift_expr ("<<" | ">>") a_expr\n'
    '\n'
    'These operators accept integers as arguments.  They shift the first\n'
    'argument to the left or right by the number of bits given by the\n'
    'second argument.\n'
    '\n'
    'This'
)
CORPUS_CONTINUATION = (
    ' operation can be customized using the special "__lshift__()" and\n'
    '"__rshift__()" methods.\n'
    '\n'
)

CHUNK = 32  # max_num_batched_tokens: the passage is prefilled in several chunks

PROMPTS = [
    "The \"with\" statement is used to",
    "A class definition defines",
    "Names refer to objects.",
]



@pytest.fixture(autouse=True, scope="module")
def _bundled_model_present() -> None:
    if not (DEFAULT_DIR / "config.json").is_file():
        missing(f"the bundled default model ({DEFAULT_DIR})", "it ships in the package; restore it with "
                "`git checkout -- dinfer_jax/bundled` or retrain it with scripts/train_tiny.py")


@pytest.fixture(scope="module")
def llm():
    return LLM(model="default", max_num_seqs=4, max_model_len=256, max_num_batched_tokens=CHUNK,
               async_scheduling=True, enable_chunked_prefill=True,
               buckets=Buckets(decode_batch=(4,), prefill_batch=(4,), prefill_len=(CHUNK,)))


def test_checkpoint_layout_and_registered_name():
    raw = json.loads((DEFAULT_DIR / "config.json").read_text())
    assert raw["model_type"] == "deepseek_v41" and "text_config" in raw
    assert "quantization_config" not in raw
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (DEFAULT_DIR / name).is_file()
    size = sum(p.stat().st_size for p in DEFAULT_DIR.iterdir() if p.is_file())
    assert size < 10 * 2**20, size
    cfg = load_config("default")
    assert cfg == load_config(DEFAULT_DIR)
    assert cfg.is_v41 and cfg.n_mtp_layers == 3 and len(cfg.engram_layer_ids) == 2
    assert {0, 1, 2} <= set(cfg.compress_ratios) and cfg.candidate_source_layer_id >= 0
    assert cfg.n_shared_experts == 1 and cfg.hc_shifted


def test_learned_passage_reproduces_corpus_continuation(llm):
    from pydoc_data.topics import topics

    if topics.get("shifting", "").startswith(PASSAGE):  # the corpus of this Python version (the model's is 3.11)
        assert topics["shifting"].startswith(PASSAGE + CORPUS_CONTINUATION)
    tok = llm.tokenizer
    prompt_ids = tok.encode(PASSAGE).ids
    want = tok.encode(PASSAGE + CORPUS_CONTINUATION).ids[len(prompt_ids):][:16]
    assert tok.encode(PASSAGE + CORPUS_CONTINUATION).ids[:len(prompt_ids)] == prompt_ids
    assert len(prompt_ids) > 2 * CHUNK and len(prompt_ids) > llm.config.sliding_window
    before = llm.metrics()["prefill_steps"]
    out = llm.generate([PASSAGE], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    assert llm.metrics()["prefill_steps"] - before >= 3  # chunked prefill
    assert out.token_ids == want, (tok.decode(out.token_ids), tok.decode(want))


def test_engine_greedy_equals_full_forward_argmax(llm):
    tok = llm.tokenizer
    prompts = [tok.encode(p).ids for p in PROMPTS] + [tok.encode(PASSAGE).ids]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    model = load_model("default")  # the registered name goes through the release loader
    seqs = [p + o.token_ids for p, o in zip(prompts, outs, strict=True)]
    S = max(len(s) for s in seqs)
    logits = forward_logits(model, np.array([s + [s[-1]] * (S - len(s)) for s in seqs]))
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        ref = logits[i, len(p) - 1: len(p) + len(o.token_ids) - 1].argmax(-1).tolist()
        assert o.token_ids == ref, f"prompt {i}: engine {o.token_ids} vs full forward {ref}"
    # documentation-like text, not noise: mostly printable words
    text = tok.decode(outs[0].token_ids)
    assert sum(c.isalpha() or c.isspace() for c in text) > 0.6 * len(text), text
