"""``dinfer_jax.structured``: so_args validation, the device bitmask, llguidance-backed matchers (random walks checked
by independent recognisers), triggers / bound tokens / rollback, and the asynchronous builder (cache, errors,
timeouts). CPU only; the bundled tokenizer (vocab 2048, EOS id 1)."""

from __future__ import annotations

import ast
import json
import re
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest
import tokenizers

from dinfer_jax.structured import (
    MatcherBuilder,
    StructuredMatcher,
    StructuredSpec,
    apply_token_bitmask,
    compile_grammar,
    full_mask,
    grammar_tokenizer,
    mask_words,
    parse_so_args,
)
from dinfer_jax.structured import builder as builder_mod

TOKENIZER_JSON = Path(__file__).resolve().parents[1] / "dinfer_jax" / "bundled" / "default" / "tokenizer.json"
V = 2048
EOS = 1
W = (V + 31) // 32


# ---- shared fixtures and independent helpers ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    return grammar_tokenizer(TOKENIZER_JSON.read_text(), V, [EOS])


@pytest.fixture(scope="module")
def hf():
    return tokenizers.Tokenizer.from_file(str(TOKENIZER_JSON))


@pytest.fixture(scope="module")
def texts(hf):
    """The decoded text of every id (special tokens decode to '')."""
    return [hf.decode([i]) for i in range(V)]


@pytest.fixture(scope="module")
def ids(hf):
    """Ids of single-character tokens: ids["a"] etc."""

    def get(text: str) -> int:
        i = hf.token_to_id(text)
        assert i is not None and hf.decode([i]) == text
        return i

    return {c: get(c) for c in "abcdexyz0123456789"}


def allowed(row: np.ndarray, vocab: int = V) -> np.ndarray:
    """Allowed ids of a packed row, by numpy's own little-endian bit unpacking (independent of the code)."""
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab])


def mask_of(m: StructuredMatcher, vocab: int = V) -> np.ndarray:
    """The matcher's next-token mask, filled over a zeroed and over an all-ones row: every word must be written."""
    rows = np.zeros((2, mask_words(vocab)), np.int32)
    rows[1] = -1
    m.fill_mask(rows[0])
    m.fill_mask(rows[1])
    np.testing.assert_array_equal(rows[0], rows[1])
    return rows[0]


def ids_matching(texts: list[str], pattern: str) -> np.ndarray:
    return np.array([i for i, t in enumerate(texts) if t and re.fullmatch(pattern, t)])


def regex_matcher(tok, pattern: str, **kw) -> StructuredMatcher:
    return StructuredMatcher(tok, compile_grammar(tok, "regex", pattern), V, [EOS], **kw)


def random_walk(
    m: StructuredMatcher, rng: np.random.Generator, texts: list[str], *, eos_after: int = 25, max_steps: int = 3000
) -> list[int]:
    """Sample allowed tokens until EOS; EOS is taken whenever allowed after ``eos_after`` steps, and
    whitespace-only tokens are drawn rarely (JSON allows unbounded whitespace) so the walks stay short."""
    tokens: list[int] = []
    for step in range(max_steps):
        ok = allowed(mask_of(m))
        assert len(ok) > 0, "a constrained mask must never be empty"
        if EOS in ok and (step >= eos_after or len(ok) == 1):
            t = EOS
        else:
            cand = ok[ok != EOS]
            solid = np.array([i for i in cand if texts[i].strip()])
            if len(solid) and (len(solid) == len(cand) or rng.random() < 0.9):
                cand = solid
            t = int(rng.choice(cand))
        assert m.accept_token(t), (step, t, m.error)
        if t == EOS:
            assert m.finished() and not m.constrained()
            return tokens
        tokens.append(t)
    raise AssertionError(f"no EOS after {max_steps} steps")


# ---- parse_so_args ----------------------------------------------------------------------------------------------

_OK = {"schema_type": "json", "schema": "{}"}


@pytest.mark.parametrize(
    ("so_args", "needle"),
    [
        ("json", "mapping"),
        ({**_OK, "serialized": "blob"}, "serialized"),
        ({**_OK, "bound_token_ids": [1]}, "bound_token_ids"),
        ({**_OK, "grammar": "x"}, "grammar"),
        ({"schema": "{}"}, "schema_type"),
        ({"schema_type": "json"}, "missing schema"),
        ({"schema_type": "xml", "schema": "{}"}, "schema_type"),
        ({"schema_type": "json", "schema": {"type": "object"}}, "schema must be a str"),
        ({"schema_type": "regex", "schema": b"[0-9]"}, "schema must be a str"),
        ({**_OK, "trigger_token_ids": "ab"}, "trigger_token_ids"),
        ({**_OK, "trigger_token_ids": 5}, "trigger_token_ids"),
        ({**_OK, "trigger_token_ids": [1, -1]}, "trigger_token_ids"),
        ({**_OK, "trigger_token_ids": [1, True]}, "trigger_token_ids"),
        ({**_OK, "trigger_token_ids": [1.0]}, "trigger_token_ids"),
        ({**_OK, "trigger_token_ids": [5], "bound_token_id": -1}, "bound_token_id"),
        ({**_OK, "trigger_token_ids": [5], "bound_token_id": True}, "bound_token_id"),
        ({**_OK, "trigger_token_ids": [5], "bound_token_id": "3"}, "bound_token_id"),
        ({**_OK, "trigger_token_ids": [5], "bound_token_id": [3]}, "bound_token_id"),
        ({**_OK, "bound_token_id": 3}, "requires non-empty trigger"),
        ({**_OK, "trigger_token_ids": [], "bound_token_id": 0}, "requires non-empty trigger"),
    ],
)
def test_parse_so_args_rejects(so_args, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        parse_so_args(so_args)


def test_parse_so_args_accepts():
    assert parse_so_args(_OK) == StructuredSpec("json", "{}")
    spec = parse_so_args({"schema_type": "regex", "schema": "[0-9]", "trigger_token_ids": None, "bound_token_id": None})
    assert spec == StructuredSpec("regex", "[0-9]", (), None)
    spec = parse_so_args(
        {"schema_type": "ebnf", "schema": 'root ::= "a"', "trigger_token_ids": [np.int64(7), 0], "bound_token_id": 0}
    )
    assert spec.trigger_token_ids == (7, 0) and type(spec.trigger_token_ids[0]) is int and spec.bound_token_id == 0
    with pytest.raises(ValueError, match="bound_token_id requires"):
        StructuredSpec("json", "{}", (), 4)
    with pytest.raises(ValueError, match="schema_type"):
        StructuredSpec("yaml", "{}")


# ---- device bitmask -----------------------------------------------------------------------------------------------


def _reference_mask(logits: np.ndarray, words: np.ndarray) -> np.ndarray:
    out = logits.copy()
    for b in range(logits.shape[0]):
        for v in range(logits.shape[1]):
            word = int(words[b, v // 32]) & 0xFFFFFFFF if v // 32 < words.shape[1] else 0
            if not (word >> (v % 32)) & 1:
                out[b, v] = -np.inf
    return out


@pytest.mark.parametrize(("vocab", "n_words"), [(1000, 32), (77, 3), (77, 5), (100, 2)])
def test_apply_token_bitmask_matches_bitwise_reference(vocab, n_words):
    rng = np.random.default_rng(vocab + n_words)
    logits = rng.standard_normal((4, vocab)).astype(np.float32)
    words = rng.integers(
        np.iinfo(np.int32).min, np.iinfo(np.int32).max, size=(4, n_words), dtype=np.int32, endpoint=True
    )
    words[1] = 0  # a row with nothing allowed
    words[2, : vocab // 32] = -1  # full words then random padding
    got = np.asarray(jax.jit(apply_token_bitmask)(jnp.asarray(logits), jnp.asarray(words)))
    np.testing.assert_array_equal(got, _reference_mask(logits, words))


def test_apply_token_bitmask_all_ones_is_identity_bitwise():
    vocab = 1000
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, vocab)).astype(np.float32)
    logits[0, :4] = [np.nan, -0.0, np.inf, -np.inf]
    words = full_mask(3, vocab)
    assert words.shape == (3, mask_words(vocab)) == (3, 32) and words.dtype == np.int32 and (words == -1).all()
    got = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(words)))
    np.testing.assert_array_equal(got.view(np.uint32), logits.view(np.uint32))
    bf = jnp.asarray(logits).astype(jnp.bfloat16)
    got_bf = apply_token_bitmask(bf, jnp.asarray(words))
    assert got_bf.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got_bf.view(jnp.uint16)), np.asarray(bf.view(jnp.uint16)))


# ---- random walks with the bundled tokenizer --------------------------------------------------------------------

_PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["x", "y", "zz"]}, "maxItems": 3},
        "inner": {"type": "object", "properties": {"k": {"enum": [1, 2, "three"]}}, "required": ["k"]},
    },
    "required": ["name", "age", "inner"],
}
_ITEMS = {
    "type": "array",
    "minItems": 1,
    "maxItems": 3,
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": -5, "maximum": 5}, "flag": {"type": "boolean"}},
        "required": ["id", "flag"],
        "additionalProperties": False,
    },
}
_CHOICE = {"anyOf": [{"type": "string", "pattern": "^[a-c]{2,4}$"}, {"enum": [None, 3.5, "lit", False]}]}


def _closed(schema):
    """The schema with additionalProperties: false written out by hand (the strict-mode contract)."""
    out = json.loads(json.dumps(schema))
    out["additionalProperties"] = False
    out["properties"]["inner"]["additionalProperties"] = False
    return out


@pytest.mark.parametrize(("schema", "check"), [(_PERSON, _closed(_PERSON)), (_ITEMS, _ITEMS), (_CHOICE, _CHOICE)])
def test_json_schema_random_walks_validate(tok, hf, texts, schema, check):
    grammar = compile_grammar(tok, "json", json.dumps(schema))
    for seed in range(4):
        m = StructuredMatcher(tok, grammar, V, [EOS])
        out = random_walk(m, np.random.default_rng(seed), texts)
        value = json.loads(hf.decode(out))
        jsonschema.validate(value, check)


@pytest.mark.parametrize(
    "pattern",
    [r"[a-z]{1,6}@[a-z]{2,5}\.(com|org)", r"-?[0-9]{1,4}(\.[0-9]{1,2})?", r"(yes|no|maybe)", r"[A-F0-9]{4}-[xyz]+"],
)
def test_regex_random_walks_fullmatch(tok, hf, texts, pattern):
    for seed in range(4):
        m = regex_matcher(tok, pattern)
        text = hf.decode(random_walk(m, np.random.default_rng(seed), texts, eos_after=3))
        assert re.fullmatch(pattern, text), text


_ARITH_GBNF = r"""
# integer arithmetic, no whitespace
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*
factor ::= num | "(" expr ")"
num    ::= [0-9]{1,3}
"""


def _is_arith(text: str) -> bool:
    """Hand-written recursive-descent recogniser of _ARITH_GBNF's language."""
    pos = 0

    def peek() -> str:
        return text[pos] if pos < len(text) else ""

    def num() -> None:
        nonlocal pos
        start = pos
        while pos < len(text) and text[pos] in "0123456789":
            pos += 1
        if not 1 <= pos - start <= 3:
            raise ValueError

    def factor() -> None:
        nonlocal pos
        if peek() == "(":
            pos += 1
            expr()
            if peek() != ")":
                raise ValueError
            pos += 1
        else:
            num()

    def term() -> None:
        nonlocal pos
        factor()
        while peek() in ("*", "/"):
            pos += 1
            factor()

    def expr() -> None:
        nonlocal pos
        term()
        while peek() in ("+", "-"):
            pos += 1
            term()

    try:
        expr()
    except ValueError:
        return False
    return pos == len(text)


def test_recogniser_sanity():
    assert _is_arith("1+(22*333)-4/5") and _is_arith("(((7)))")
    assert not _is_arith("1234") and not _is_arith("1+") and not _is_arith("(1") and not _is_arith("1 + 2")


def test_ebnf_arithmetic_random_walks(tok, hf, texts):
    grammar = compile_grammar(tok, "ebnf", _ARITH_GBNF)
    for seed in range(5):
        m = StructuredMatcher(tok, grammar, V, [EOS])
        text = hf.decode(random_walk(m, np.random.default_rng(seed), texts))
        assert _is_arith(text), text


_LIST_GBNF = r"""
root ::= "[" ( item ( "," item )* )? "]"
item ::= num | str
num  ::= "0" | [1-9] [0-9]{0,3}
str  ::= "'" [a-z]{0,5} "'"
"""


def test_ebnf_list_random_walks_literal_eval(tok, hf, texts):
    grammar = compile_grammar(tok, "ebnf", _LIST_GBNF)
    for seed in range(5):
        m = StructuredMatcher(tok, grammar, V, [EOS])
        text = hf.decode(random_walk(m, np.random.default_rng(seed), texts, eos_after=8))
        value = ast.literal_eval(text)
        assert isinstance(value, list) and " " not in text, text
        for item in value:
            assert (isinstance(item, int) and 0 <= item <= 9999) or (
                isinstance(item, str) and re.fullmatch("[a-z]{0,5}", item)
            ), text


def test_ebnf_accepts_lark_syntax(tok, hf, texts):
    grammar = compile_grammar(tok, "ebnf", 'start: "yes" | "no"')
    seen = set()
    for seed in range(6):
        m = StructuredMatcher(tok, grammar, V, [EOS])
        seen.add(hf.decode(random_walk(m, np.random.default_rng(seed), texts, eos_after=0)))
    assert seen <= {"yes", "no"} and seen


# ---- masks, EOS, out-of-tokenizer ids --------------------------------------------------------------------------


def test_grammar_masks_and_eos(tok, texts, ids):
    m = regex_matcher(tok, "[0-9]{2}")
    assert m.constrained() and not m.finished() and m.error is None
    np.testing.assert_array_equal(allowed(mask_of(m)), ids_matching(texts, "[0-9]{1,2}"))
    before = mask_of(m)
    assert not m.accept_token(ids["a"]) and not m.accept_token(EOS)  # rejected: state unchanged, no error
    assert m.error is None
    np.testing.assert_array_equal(mask_of(m), before)
    assert m.accept_token(ids["1"])
    np.testing.assert_array_equal(allowed(mask_of(m)), ids_matching(texts, "[0-9]"))
    assert m.accept_token(ids["2"])
    np.testing.assert_array_equal(allowed(mask_of(m)), [EOS])  # the grammar is complete: only EOS
    assert m.accept_token(EOS) and m.finished() and not m.constrained()
    assert (mask_of(m) == -1).all()  # after EOS: everything, padding bits included
    assert m.accept_token(ids["x"]) and m.accept_token(V - 1)

    m = regex_matcher(tok, "[0-9]{1,3}")  # accepting but extensible: EOS next to the digits
    assert m.accept_token(ids["7"])
    ok = allowed(mask_of(m))
    assert EOS in ok and ids["5"] in ok
    assert m.accept_token(EOS) and m.finished()


def test_vocab_larger_than_tokenizer(texts, ids):
    vocab = 2100
    tok = grammar_tokenizer(TOKENIZER_JSON.read_text(), vocab, [EOS])
    assert tok.vocab_size == vocab
    m = StructuredMatcher(tok, compile_grammar(tok, "regex", "(?s).*"), vocab, [EOS], trigger_token_ids=[ids["a"]])
    np.testing.assert_array_equal(allowed(mask_of(m, vocab), vocab), np.arange(vocab))  # free: every model id
    assert m.accept_token(2050) and m.accept_token(ids["a"]) and m.constrained()
    ok = allowed(mask_of(m, vocab), vocab)
    assert ok.max() < V and EOS in ok and ids["x"] in ok
    assert not m.accept_token(2050) and not m.accept_token(vocab + 5) and not m.accept_token(-1)
    assert m.error is None and m.accept_token(ids["x"])


def test_tokenizer_narrower_than_matcher_vocab(texts):
    """A tokenizer built without the model's padding (not via grammar_tokenizer): extra ids stay disallowed."""
    import llguidance

    raw = llguidance.LLTokenizer(TOKENIZER_JSON.read_text(), n_vocab=V, eos_token=EOS)
    vocab = 2100
    m = StructuredMatcher(raw, compile_grammar(raw, "regex", "[0-9]{2}"), vocab, [EOS])
    np.testing.assert_array_equal(allowed(mask_of(m, vocab), vocab), ids_matching(texts, "[0-9]{1,2}"))
    assert not m.accept_token(2050) and m.error is None


def test_vocab_smaller_than_tokenizer(ids):
    vocab = 2000
    tok = grammar_tokenizer(TOKENIZER_JSON.read_text(), vocab, [EOS])
    assert tok.vocab_size == V
    m = StructuredMatcher(tok, compile_grammar(tok, "regex", "(?s).*"), vocab, [EOS])
    row = mask_of(m, vocab)
    assert row.shape == (63,)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    assert bits[vocab:].sum() == 0 and bits[ids["x"]] == 1


def test_fill_mask_rejects_wrong_rows(tok):
    m = regex_matcher(tok, "[0-9]")
    with pytest.raises(ValueError, match="int32"):
        m.fill_mask(np.zeros(W, np.int64))
    with pytest.raises(ValueError, match="int32"):
        m.fill_mask(np.zeros(W + 1, np.int32))
    batch = np.zeros((3, 2 * W), np.int32)
    m.fill_mask(batch[1, ::2])  # a strided row view goes through the scratch buffer
    np.testing.assert_array_equal(batch[1, ::2], mask_of(m))
    assert (batch[1, 1::2] == 0).all() and (batch[[0, 2]] == 0).all()


# ---- triggers, bound token, rollback ----------------------------------------------------------------------------


def _first_trigger_end(seq: list[int], trigger: list[int]) -> int | None:
    """Naive reference: the number of tokens after which ``seq`` first ends with ``trigger``."""
    for i in range(len(trigger), len(seq) + 1):
        if seq[i - len(trigger) : i] == trigger:
            return i
    return None


def test_trigger_kmp_overlapping_prefixes(tok, texts, ids):
    a, b, c = ids["a"], ids["b"], ids["c"]
    digits2 = ids_matching(texts, "[0-9]{1,2}")
    m = regex_matcher(tok, "[0-9]{2}", trigger_token_ids=[a, a, b])
    for t in (a, a, a):
        assert not m.constrained() and (mask_of(m) == -1).all()
        assert m.accept_token(t)
    assert not m.constrained()
    assert m.accept_token(b) and m.constrained()  # "a a a b" ends with the trigger
    np.testing.assert_array_equal(allowed(mask_of(m)), digits2)
    assert not m.accept_token(a)

    # Random sequences over {a, b, c} against the naive reference, for triggers with self-overlap.
    rng = np.random.default_rng(0)
    for trigger in ([a, a, b], [a, b, a, c], [a, b, a, b, c], [a, a, a], [c]):
        for _ in range(40):
            seq = [int(x) for x in rng.choice([a, b, c], size=16)]
            end = _first_trigger_end(seq, trigger)
            m = regex_matcher(tok, "[0-9]{2}", trigger_token_ids=trigger)
            for i, t in enumerate(seq):
                assert m.constrained() == (end is not None and i >= end)
                if m.constrained():
                    break
                assert m.accept_token(t)
            if end is not None:
                np.testing.assert_array_equal(allowed(mask_of(m)), digits2)


def test_bound_token_forces_the_trigger(tok, texts, ids):
    a, b, c, d = ids["a"], ids["b"], ids["c"], ids["d"]
    m = regex_matcher(tok, "[0-9]{2}", trigger_token_ids=[a, b, c], bound_token_id=b)
    assert m.accept_token(d) and m.accept_token(a) and not m.constrained()
    assert m.accept_token(b)  # the bound token (also trigger progress 2: "a b")
    assert m.constrained()
    np.testing.assert_array_equal(allowed(mask_of(m)), [c])
    for wrong in (a, b, d, EOS, ids["1"]):
        assert not m.accept_token(wrong)
    assert m.accept_token(c)
    np.testing.assert_array_equal(allowed(mask_of(m)), ids_matching(texts, "[0-9]{1,2}"))

    m = regex_matcher(tok, "[0-9]{2}", trigger_token_ids=[a, b, c], bound_token_id=d)
    assert m.accept_token(a) and m.accept_token(d)  # bound seen: "a" then "d" resets the progress to 0
    for expected in (a, b, c):
        np.testing.assert_array_equal(allowed(mask_of(m)), [expected])
        assert not m.accept_token(d)
        assert m.accept_token(expected)
    np.testing.assert_array_equal(allowed(mask_of(m)), ids_matching(texts, "[0-9]{1,2}"))


def _snapshots(m: StructuredMatcher, seq: list[int]) -> list[tuple[bytes, bool, bool]]:
    """(mask, constrained, finished) before each token of ``seq`` and after the last."""
    snaps = []
    for t in seq:
        snaps.append((mask_of(m).tobytes(), m.constrained(), m.finished()))
        assert m.accept_token(t), t
    snaps.append((mask_of(m).tobytes(), m.constrained(), m.finished()))
    return snaps


@pytest.mark.parametrize("pattern", ["[0-9]{2}", "[0-9]{1,3}"])  # EOS once the grammar stopped / while extensible
@pytest.mark.parametrize("bound", [False, True])
def test_rollback_restores_every_phase(tok, ids, pattern, bound):
    a, b, x, y = ids["a"], ids["b"], ids["x"], ids["y"]
    seq = [x, y, a, b, ids["1"], ids["2"], EOS, x, y] if bound else [x, a, b, ids["1"], ids["2"], EOS, x, y]
    kw = {"trigger_token_ids": [a, b], "bound_token_id": y if bound else None}
    ref = _snapshots(regex_matcher(tok, pattern, **kw), seq)
    m = regex_matcher(tok, pattern, **kw)
    pos = 0
    # (roll back, then advance) pairs crossing every boundary: free/forced/grammar/after-EOS.
    for back, forward in [
        (0, len(seq)),
        (1, 0),
        (2, 0),
        (1, 1),
        (3, 2),
        (4, 0),
        (2, 6),
        (9 if bound else 8, 0),
        (0, 4),
        (4, len(seq)),
    ]:
        back = min(back, pos)
        m.rollback(back)
        pos -= back
        assert (mask_of(m).tobytes(), m.constrained(), m.finished()) == ref[pos], (pos, back)
        for t in seq[pos : pos + forward]:
            assert m.accept_token(t)
            pos += 1
            assert (mask_of(m).tobytes(), m.constrained(), m.finished()) == ref[pos], pos
    assert m.error is None


def test_rollback_limits(tok, ids):
    m = regex_matcher(tok, "[a-z]*", max_rollback=4)
    with pytest.raises(ValueError, match="roll back 1"):
        m.rollback(1)
    for _ in range(6):
        assert m.accept_token(ids["a"])
    with pytest.raises(ValueError, match="max_rollback=4"):
        m.rollback(5)
    with pytest.raises(ValueError):
        m.rollback(-1)
    m.rollback(0)
    m.rollback(4)  # still allowed after the failed attempts, which changed nothing
    assert m.error is None and m.accept_token(ids["b"])


# ---- builder -----------------------------------------------------------------------------------------------------


def test_builder_cache_and_dedup(tok):
    a = StructuredSpec("json", json.dumps(_ITEMS))
    with MatcherBuilder(tok, V, [EOS], workers=2) as b:
        m1 = b.submit(a).result()
        m2 = b.submit(StructuredSpec("json", a.schema, (5, 6), 6)).result()  # same schema, other trigger
        assert m1.error is None and m2.error is None and m1 is not m2
        assert b.compiled_count == 1 and b.cache_len == 1
        assert b.submit(StructuredSpec("regex", "[0-9]+")).result().error is None
        assert b.compiled_count == 2
        futures = [b.submit(StructuredSpec("regex", "[a-f]{3}")) for _ in range(6)]  # concurrent, uncached
        assert all(f.result().error is None for f in futures)
        assert b.compiled_count == 3
    with MatcherBuilder(tok, V, [EOS], cache_size=1) as b:  # LRU of one: A, B, A compiles three times
        for spec in (a, StructuredSpec("regex", "[0-9]+"), a, a):
            assert b.submit(spec).result().error is None
        assert b.compiled_count == 3


@pytest.mark.parametrize(
    ("schema_type", "schema", "needle"),
    [
        ("json", '{"type": "foo"}', "invalid JSON schema"),
        ("json", '{"type": ', "invalid JSON schema: not valid JSON"),
        ("json", "[1, 2]", "invalid JSON schema"),
        ("regex", "[0-9", "invalid regex"),
        ("regex", "(ab", "invalid regex"),
        ("ebnf", "root ::= undefined_rule", "invalid EBNF grammar"),
        ("ebnf", 'expr ::= "a"', "invalid EBNF grammar"),  # no root
        ("ebnf", 'root ::= "a', "invalid EBNF grammar"),
        ("ebnf", "start: foo", "invalid EBNF grammar"),  # Lark syntax, unknown rule
    ],
)
def test_builder_compile_errors_are_failed_matchers(tok, schema_type, schema, needle):
    with MatcherBuilder(tok, V, [EOS]) as b:
        m = b.submit(StructuredSpec(schema_type, schema)).result()
        assert m.error is not None and m.error.startswith(needle), m.error
        _assert_inert(m)
        assert b.compiled_count == 1


def test_builder_bad_trigger_is_failed_matcher(tok):
    with MatcherBuilder(tok, V, [EOS]) as b:
        m = b.submit(StructuredSpec("regex", "[0-9]", (5, V + 3))).result()
        assert m.error is not None and "trigger_token_ids" in m.error


def _assert_inert(m: StructuredMatcher) -> None:
    """A failed matcher reports and never raises."""
    assert m.error
    assert not m.constrained() and not m.finished()
    assert m.accept_token(EOS) is False and m.accept_token(10**9) is False
    row = np.zeros(W, np.int32)
    m.fill_mask(row)
    assert (row == -1).all()
    m.fill_mask(np.zeros(7, np.int32))
    m.rollback(100)
    m.rollback(0)


def test_failed_matcher_is_inert():
    _assert_inert(StructuredMatcher.failed("boom"))
    assert StructuredMatcher.failed("boom").error == "boom"


def test_builder_timeouts(tok, monkeypatch):
    release = threading.Event()
    real = builder_mod.compile_grammar

    def blocked(*args, **kwargs):
        assert release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(builder_mod, "compile_grammar", blocked)
    spec = StructuredSpec("regex", "[0-9]{2}")
    try:
        with MatcherBuilder(tok, V, [EOS], workers=1, timeout_s=1e-6) as b:
            fut = b.submit(spec)
            time.sleep(0.001)
            m = fut.try_result()
            assert m is not None and "timed out after 1e-06 s" in m.error
            assert fut.try_result() is m and fut.result() is m  # sticky
            _assert_inert(m)
            release.set()
        release.clear()
        with MatcherBuilder(tok, V, [EOS], workers=1, timeout_s=0.05) as b:
            start = time.monotonic()
            m = b.submit(StructuredSpec("regex", "[0-9]{3}")).result()  # blocks for the rest of the timeout
            assert 0.04 <= time.monotonic() - start < 5 and "timed out" in m.error
            release.set()
        release.clear()
        with MatcherBuilder(tok, V, [EOS], workers=1, timeout_s=30) as b:
            fut = b.submit(spec)
            assert fut.try_result() is None and fut.try_result() is None  # still building, within the timeout
            release.set()
            m = fut.result()
            assert m.error is None and m.constrained()
    finally:
        release.set()


def test_builder_closed_and_cancel(tok):
    b = MatcherBuilder(tok, V, [EOS])
    fut = b.submit(StructuredSpec("regex", "[0-9]"))
    fut.cancel()
    assert "cancelled" in fut.result().error
    b.close()
    m = b.submit(StructuredSpec("regex", "[0-9]")).try_result()
    assert m is not None and "closed" in m.error


def test_a_build_finished_after_its_deadline_times_out_however_late_it_is_read():
    """The outcome of a timeout does not depend on when the engine looks: a build that finished within the limit is
    used even if read much later; one that finished after it is a timeout even if it is done when first read."""
    import concurrent.futures

    start = time.monotonic() - 10.0   # submitted 10 s ago; both builds are done now
    matcher = object()
    for finished_after, want_timeout in ((0.4, False), (0.6, True)):
        task: concurrent.futures.Future = concurrent.futures.Future()
        task.set_result((matcher, start + finished_after))
        for read in ("try_result", "result"):
            fut = builder_mod.MatcherFuture(task, 0.5, start)
            got = getattr(fut, read)()
            if want_timeout:
                assert got is not matcher and "timed out after 0.5 s" in got.error, read
            else:
                assert got is matcher, read
