"""Normalise the three spellings of a V4 tensor name to DeepSeek's release names.

See ``docs/spec/model-v4.md`` §6.2."""

from __future__ import annotations

import re

_ATTN_NORM = re.compile(r"^((?:layers|mtp)\.\d+\.attn)\.norm\.weight$")
_HC_HEAD = re.compile(r"^((?:mtp\.\d+\.)?)hc_head\.hc_(fn|base|scale)$")


def normalize_name(name: str) -> str:
    """Release name for a tensor spelled as DeepSeek released it or as transformers' ``save_pretrained`` wrote it.

    ``model.`` prefix stripped; ``embed_tokens``→``embed``; ``lm_head``→``head``; ``hc_head.hc_fn``→``hc_head_fn``;
    ``attn.norm.weight``→``attn.kv_norm.weight`` (only directly under ``attn``); ``weight_scale_inv``→``scale``.
    """
    if name.startswith("model."):
        name = name[len("model."):]
    if name == "embed_tokens.weight":
        return "embed.weight"
    if name == "lm_head.weight":
        return "head.weight"
    m = _HC_HEAD.match(name)
    if m:
        return f"{m.group(1)}hc_head_{m.group(2)}"
    m = _ATTN_NORM.match(name)
    if m:
        return f"{m.group(1)}.kv_norm.weight"
    if name.endswith(".weight_scale_inv"):
        return name[: -len(".weight_scale_inv")] + ".scale"
    return name
