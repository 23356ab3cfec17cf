"""dinfer_jax: a JAX/XLA port of DeepSeek's DeepInfer inference engine for the DeepSeek-V4 family.

Offline batch inference: ``from dinfer_jax import LLM, SamplingParams``. Models and numerics:
``dinfer_jax.models`` (``load_config``, ``load_model``, ``forward_logits``, ``inspect``).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0.dev0"
__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    # Imported lazily so that `import dinfer_jax.models` does not pull in the engine.
    if name in ("LLM", "RequestOutput"):
        from dinfer_jax.engine import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from dinfer_jax.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'dinfer_jax' has no attribute {name!r}")
