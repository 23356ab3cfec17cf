"""Structured outputs through the engine (``SamplingParams(so_args=...)``, docs/structured_outputs.md).

Every check is against something independent of the engine: outputs are parsed by ``json`` and validated by the
``jsonschema`` package, regex outputs are matched by Python's ``re``, EBNF outputs by a regular expression of the
same (regular) language written by hand; free requests are compared with the same requests run alone, and trigger
runs with the free run of the same prompt (the mask is all ones until the trigger, so the tokens up to it must be
the free run's, bit for bit, greedy).
"""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest

from dinfer_jax import LLM, SamplingParams
from dinfer_jax.checkpoints import REGISTRY
from dinfer_jax.engine.buckets import Buckets
from dinfer_jax.models import load_config, random_model

DEFAULT_DIR = REGISTRY["default"]
TOKENIZER = DEFAULT_DIR / "tokenizer.json"
PROMPTS = ["The person is", "def f(x):", "Return the", "A list of", "class Point:", "import os"]

PERSON = {"type": "object", "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}}}
ITEMS = {"type": "object", "required": ["kind", "tags"],
         "properties": {"kind": {"enum": ["module", "class", "function"]},
                        "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 6}},
                        "size": {"type": "number", "minimum": -5, "maximum": 5}}}
REGEX = r"[a-z]{1,8} (is|was) [0-9]{1,3}\."  # bounded: random models must finish too
# GBNF (xgrammar's EBNF form): sums of up to three small integers (bounded, so that every run can complete within
# max_tokens); the same language as SUM_RE
EBNF = 'root ::= num (op num (op num)?)?\nop ::= "+" | "-"\nnum ::= [1-9] [0-9]? | "0"'
SUM_RE = r"(?:[1-9][0-9]?|0)(?:[+-](?:[1-9][0-9]?|0)){0,2}"


def _so(kind: str, schema: str | dict, **kw) -> dict:
    return {"schema_type": kind, "schema": schema if isinstance(schema, str) else json.dumps(schema), **kw}


def _engine(model, **kw) -> LLM:
    return LLM(model, max_num_seqs=4, max_model_len=256, max_num_batched_tokens=32, progress=False,
               buckets=Buckets(decode_batch=(4,), prefill_batch=(4,), prefill_len=(32,)), **kw)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return _engine("default")


def _check_json(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def test_json_regex_ebnf_outputs_are_valid(llm):
    warm = llm.metrics()["compilations"]
    cases = [("json", PERSON), ("json", ITEMS), ("regex", REGEX), ("ebnf", EBNF)]
    params, prompts, kinds = [], [], []
    for i, (kind, schema) in enumerate(cases):
        for temp, seed in ((0.0, None), (1.0, 11 + i)):  # greedy and seeded sampling
            params.append(SamplingParams(temperature=temp, seq_seed=seed, max_tokens=96, so_args=_so(kind, schema)))
            prompts.append(PROMPTS[(i + len(prompts)) % len(PROMPTS)])
            kinds.append((kind, schema))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o, (kind, schema) in zip(outs, kinds, strict=True):
        assert o.finish_reason == "stop", (o.finish_reason, o.text, o.error)
        assert o.token_ids[-1] == 1  # the grammar allows only EOS once complete
        text = o.text
        if kind == "json":
            _check_json(text, schema)
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        else:
            assert re.fullmatch(SUM_RE, text), text
    m = llm.metrics()
    assert m["compilations"] == warm, "structured requests compiled something after warm-up"
    assert m["structured_requests"] >= len(params) and m["structured_mask_seconds"] > 0


def test_async_and_sync_give_the_same_tokens(llm):
    params = [SamplingParams(temperature=t, seq_seed=5, max_tokens=64, so_args=_so("json", PERSON))
              for t in (0.0, 0.9)] + [SamplingParams(temperature=0.9, seq_seed=6, max_tokens=24)]
    prompts = PROMPTS[:3]
    runs = []
    for mode in (True, False):
        llm.configure(async_scheduling=mode)
        runs.append([(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params, use_tqdm=False)])
    llm.configure(async_scheduling=True)
    assert runs[0] == runs[1]


def test_launch_thread_gives_the_same_tokens(llm):
    """Steps launched from a second host thread (``launch_thread``, the default with host Engram tables): the same
    tokens as launches on the loop's thread, async and sync, with structured rows (launched without their sampler,
    masks first) among free and seeded ones."""
    params = [SamplingParams(temperature=t, seq_seed=5, max_tokens=48, so_args=_so("json", PERSON))
              for t in (0.0, 0.9)] + [SamplingParams(temperature=0.9, seq_seed=6, max_tokens=24),
                                      SamplingParams(temperature=0.0, max_tokens=30)]
    prompts = PROMPTS[:4]
    runs = {}
    for mode in (True, False):
        for thread in (False, True):
            llm.configure(async_scheduling=mode, launch_thread=thread)
            runs[mode, thread] = [(o.token_ids, o.finish_reason)
                                  for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.configure(async_scheduling=True, launch_thread=False)
    assert runs[True, True] == runs[True, False] and runs[False, True] == runs[False, False]
    assert all(len(t) > 1 for t, _ in runs[True, True])
    with pytest.raises(ValueError, match="launch_thread must be True, False or None"):
        llm.configure(launch_thread=1)


def test_free_requests_get_the_tokens_they_get_alone(llm):
    free = [SamplingParams(temperature=0.0, max_tokens=20), SamplingParams(temperature=1.0, seq_seed=3, max_tokens=20)]
    alone = [o.token_ids for o in llm.generate(PROMPTS[:2], free, use_tqdm=False)]
    mixed_params = [free[0], SamplingParams(temperature=0.0, max_tokens=64, so_args=_so("regex", REGEX)), free[1],
                    SamplingParams(temperature=0.7, seq_seed=9, max_tokens=64, so_args=_so("json", ITEMS))]
    mixed = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3]], mixed_params, use_tqdm=False)
    assert [mixed[0].token_ids, mixed[2].token_ids] == alone
    assert re.fullmatch(REGEX, mixed[1].text) and mixed[3].finish_reason == "stop"
    _check_json(mixed[3].text, ITEMS)


def test_bad_schemas_end_only_their_request(llm):
    good = SamplingParams(temperature=0.0, max_tokens=12)
    bad = [_so("json", "{not json"), _so("json", {"type": "nonsense"}), _so("regex", "([a-z"),
           _so("ebnf", "root ::= (")]
    params = [good] + [SamplingParams(temperature=0.0, max_tokens=12, so_args=b) for b in bad] + [good]
    outs = llm.generate([PROMPTS[0]] * len(params), params, use_tqdm=False)
    alone = llm.generate([PROMPTS[0]], good, use_tqdm=False)[0]
    assert outs[0].token_ids == outs[-1].token_ids == alone.token_ids
    for o, prefix in zip(outs[1:-1], ["invalid JSON schema", "invalid JSON schema", "invalid regex",
                                      "invalid EBNF grammar"], strict=True):
        assert o.finish_reason == "error" and o.error.startswith(prefix) and o.token_ids == [], o.error
    # malformed so_args are refused where they are written, like any other bad sampling parameter
    with pytest.raises(ValueError, match="so_args: unknown schema_type"):
        SamplingParams(so_args={"schema_type": "xml", "schema": "<a/>"})
    with pytest.raises(ValueError, match="so_args: .*bound_token_id requires"):
        SamplingParams(so_args={"schema_type": "regex", "schema": "a", "bound_token_id": 3})


def test_compile_timeout_ends_the_request(llm):
    # a schema nobody compiled yet (no cache hit) against a limit no compilation meets
    schema = {"type": "object", "required": [f"k{i}" for i in range(40)],
              "properties": {f"k{i}": {"type": "string", "pattern": f"[a-z]{{{i % 5 + 1}}}x{i}"} for i in range(40)}}
    llm.configure(structured_timeout_s=1e-9)
    try:
        outs = llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=8, so_args=_so("json", schema)),
                                          SamplingParams(temperature=0.0, max_tokens=8)], use_tqdm=False)
    finally:
        llm.configure(structured_timeout_s=20.0)
    assert outs[0].finish_reason == "error" and "timed out" in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 8


def _first_occurrence(seq: list[int], pat: list[int]) -> int:
    return next(i for i in range(len(seq) - len(pat) + 1) if seq[i:i + len(pat)] == pat)


def test_trigger_then_grammar(llm):
    free = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].token_ids
    trigger = free[3:5]
    end = _first_occurrence(free, trigger) + len(trigger)
    so = _so("regex", "[0-9]{3}", trigger_token_ids=trigger)
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=40, so_args=so), use_tqdm=False)[0]
    assert out.token_ids[:end] == free[:end]  # free generation up to and including the trigger
    tail = llm.tokenizer.decode(out.token_ids[end:])
    assert re.fullmatch(r"[0-9]{3}", tail) and out.finish_reason == "stop", (tail, out.finish_reason)


def test_bound_token_forces_the_trigger(llm):
    free = llm.generate([PROMPTS[4]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                        use_tqdm=False)[0].token_ids
    trigger = llm.tokenizer.encode("->").ids
    assert trigger and free[0] not in trigger
    so = _so("regex", "[0-9]{2}", trigger_token_ids=trigger, bound_token_id=free[0])
    out = llm.generate([PROMPTS[4]], SamplingParams(temperature=0.0, max_tokens=40, so_args=so), use_tqdm=False)[0]
    n = len(trigger)
    assert out.token_ids[0] == free[0]  # free until the bound token appears ...
    assert out.token_ids[1:1 + n] == trigger  # ... then the trigger is forced token by token ...
    assert re.fullmatch(r"[0-9]{2}", llm.tokenizer.decode(out.token_ids[1 + n:])), out.text  # ... then the grammar


def test_structured_output_needs_a_tokenizer_and_a_vocabulary_that_covers_the_grammar():
    model = random_model(load_config("tiny-v4"), seed=3, std=0.1, include_mtp=False)  # 512 ids, no tokenizer
    kw = dict(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16, progress=False, warmup=False)
    llm = LLM(model, **kw)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, so_args=_so("regex", "a")), use_tqdm=False)[0]
    assert out.finish_reason == "error" and "needs a tokenizer" in out.error  # no tokenizer.json, none given
    with pytest.raises(ValueError, match="no tokenizer.json file"):
        LLM(model, tokenizer=DEFAULT_DIR / "missing.json", **kw)
    # with the bundled tokenizer (2048 ids) the grammar of PERSON needs the key token "name" (id 656 > 511): the
    # request ends with an error naming the cause instead of sampling from an empty mask; the free one is unharmed
    llm = LLM(model, tokenizer=TOKENIZER, **kw)
    outs = llm.generate([[5, 6, 7]] * 2, [SamplingParams(max_tokens=40, so_args=_so("json", PERSON)),
                                          SamplingParams(temperature=0.0, max_tokens=6)], use_tqdm=False)
    assert outs[0].finish_reason == "error" and "no token of the model's vocabulary (512)" in outs[0].error
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 6


@pytest.mark.parametrize("name", ["tiny-v4", "tiny-v41"])
def test_random_tiny_models_follow_the_schema(name):
    # random weights draw nearly uniform tokens: only the mask keeps them inside the grammar; the bundled
    # tokenizer provides the vocabulary (the random model is given its 2048 ids)
    cfg = dataclasses.replace(load_config(name), vocab_size=2048)
    llm = _engine(random_model(cfg, seed=4, std=0.1, include_mtp=False), tokenizer=TOKENIZER)
    params = [SamplingParams(temperature=1.0, seq_seed=s, max_tokens=160, so_args=_so("json", PERSON))
              for s in range(2)]
    params += [SamplingParams(temperature=1.0, seq_seed=7, max_tokens=64, so_args=_so("regex", REGEX)),
               SamplingParams(temperature=1.0, seq_seed=8, max_tokens=64, so_args=_so("ebnf", EBNF))]
    outs = llm.generate([[2, 3, 4, 5]] * len(params), params, use_tqdm=False)
    for o in outs:
        assert o.finish_reason == "stop", (o.finish_reason, o.text, o.error)
    for o in outs[:2]:
        _check_json(o.text, PERSON)
    assert re.fullmatch(REGEX, outs[2].text) and re.fullmatch(SUM_RE, outs[3].text)


def test_speculative_engine_masks_every_verified_position(llm):
    # DSpark drafts are verified against masked target logits (one mask per verified position, built from the
    # drafts): greedy structured output is the non-speculative engine's, token for token, in both loops
    spec = LLM("default", max_num_seqs=4, max_model_len=128, max_num_batched_tokens=32, progress=False,
               buckets=Buckets(decode_batch=(4,), prefill_batch=(4,), prefill_len=(32,)), speculative="dspark",
               num_speculative_tokens=3)  # the configuration of tests/test_speculative.py: its programs are reused
    warm = spec.metrics()["compilations"]
    params = [SamplingParams(temperature=0.0, max_tokens=64, so_args=_so(kind, schema))
              for kind, schema in (("json", PERSON), ("regex", REGEX), ("ebnf", EBNF))]
    params.append(SamplingParams(temperature=0.0, max_tokens=20))
    prompts = PROMPTS[:4]
    want = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for mode in (True, False):
        spec.configure(async_scheduling=mode)
        got = spec.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in got] == want, mode
    _check_json(got[0].text, PERSON)
    assert re.fullmatch(REGEX, got[1].text) and re.fullmatch(SUM_RE, got[2].text)
    m = spec.metrics()
    assert m["spec_verify_steps"] > 0 and m["spec_accepted_tokens"] > 0 and m["compilations"] == warm
    sampled = spec.generate(prompts[:2], [SamplingParams(temperature=1.0, seq_seed=s, max_tokens=96,
                                                         so_args=_so("json", ITEMS)) for s in (1, 2)],
                            use_tqdm=False)
    for o in sampled:
        assert o.finish_reason == "stop", (o.text, o.error)
        _check_json(o.text, ITEMS)
