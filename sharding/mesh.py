"""Device mesh with DeepInfer's rank-group axes ``dp`` × ``cp`` × ``ep``."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from sharding.rules import MESH_AXES


def make_mesh(dp: int = 1, cp: int = 1, ep: int | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``(dp, cp, ep)`` mesh. ``ep=None`` takes all devices left after ``dp*cp``.

    Raises ValueError when the sizes do not multiply to the number of devices used.
    """
    devs = list(devices if devices is not None else jax.devices())
    if ep is None:
        if len(devs) % (dp * cp):
            raise ValueError(f"{len(devs)} devices are not divisible by dp*cp = {dp * cp}")
        ep = len(devs) // (dp * cp)
    n = dp * cp * ep
    if n > len(devs) or min(dp, cp, ep) < 1:
        raise ValueError(f"mesh dp={dp} cp={cp} ep={ep} needs {n} devices, {len(devs)} available")
    arr = np.array(devs[:n], dtype=object).reshape(dp, cp, ep)
    return Mesh(arr, MESH_AXES)


def mesh_size(mesh: Mesh) -> int:
    return math.prod(mesh.shape.values())
