"""The user-facing comparison script runs end to end and reports agreement."""

from __future__ import annotations

import sys
from pathlib import Path

from helpers import require_reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))


def test_compare_torch_on_random_preset(capsys):
    require_reference()
    import compare_torch

    assert compare_torch.main(["--config", "tiny-v4", "--batch", "1", "--seq-len", "24"]) == 0
    out = capsys.readouterr().out
    assert "logits" in out and "argmax 100.0%" in out and "indexer sets 100.0%" in out
