"""``scripts/generate.py``, the README's main job, through its ``main``: the bundled default model continues a passage
of its training text with the corpus's next tokens (an expectation from the corpus, ``pydoc_data.topics``, not a
recording of the script's output), with step shapes compiled on demand (the default: no warm-up of every bucket),
and a malformed prompt file is rejected naming its line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from test_default_model import CORPUS_CONTINUATION, PASSAGE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import generate  # noqa: E402


def test_main_job_continues_the_corpus_with_shapes_compiled_on_demand(tmp_path, capsys):
    from tokenizers import Tokenizer

    from dinfer_jax.checkpoints import REGISTRY

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": PASSAGE, "max_tokens": 12}) + "\n"
                       + json.dumps({"prompt": "A class definition defines"}) + "\n")
    out = tmp_path / "out.jsonl"
    assert generate.main(["--prompts", str(prompts), "--output", str(out), "--max-tokens", "5", "--no-progress",
                          "--max-num-seqs", "2"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == [PASSAGE, "A class definition defines"]
    assert all(r["error"] is None and r["finish_reason"] == "length" for r in rows)
    assert [len(r["token_ids"]) for r in rows] == [12, 5]          # a record's max_tokens overrides --max-tokens
    tok = Tokenizer.from_file(str(REGISTRY["default"] / "tokenizer.json"))
    prompt_ids = tok.encode(PASSAGE).ids
    assert rows[0]["prompt_token_ids"] == prompt_ids
    assert rows[0]["token_ids"] == tok.encode(PASSAGE + CORPUS_CONTINUATION).ids[len(prompt_ids):][:12]
    summary = capsys.readouterr().err
    assert "building" in summary and "step programs" in summary, summary   # built while generating, and said so


def test_malformed_prompt_file_names_the_line(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"text": "no prompt key"}) + "\n")
    with pytest.raises(ValueError, match=r"prompts.jsonl:2: expected an object with 'prompt'"):
        generate.main(["--prompts", str(prompts), "--no-progress"])
