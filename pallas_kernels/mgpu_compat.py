"""Small shims over Mosaic GPU Pallas APIs that differ between the jax versions the project runs on (0.10.2 on the
CPU machines, 0.11.2 on the H200)."""

from __future__ import annotations

import inspect


def load_whole(plgpu, ref, layout):
    """``plgpu.load`` of a whole shared-memory ref in ``layout``: jax 0.10.2 requires the index argument (``()``),
    jax ≥ 0.11 deprecates it (the ref is indexed with ``.at`` instead)."""
    if inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)
