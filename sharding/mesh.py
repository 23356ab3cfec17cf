"""The device mesh that realises DeepInfer's DP, CP and EP groups (:func:`sharding.layout.layout`).

DeepInfer has ``world = dp·cp`` workers, one device each: worker ``e·cp + c`` is engine ``e``'s CP rank ``c``, and
the EP groups are contiguous blocks of ``ep`` of the *same* workers, so ``ep`` is not a separate factor of the device
count. The mesh therefore has ``dp·cp`` devices on four axes, major to minor (``MESH_AXES``)::

    dp_out   engines outside one EP group          dp / dp_ep
    dp_ep    engines inside one EP group           ep / cp  when ep >= cp, else 1
    cp_out   CP ranks outside one EP group         cp / cp_ep
    cp_ep    CP ranks inside one EP group          min(ep, cp)

with the workers laid out in id order. Each group kind is the set of devices that share every coordinate except
its axes (``GROUP_AXES``): DP = (``dp_out``, ``dp_ep``), CP = (``cp_out``, ``cp_ep``), EP = (``dp_ep``, ``cp_ep``);
a group's rank is its devices' row-major index over those axes. So an EP group spans whole engines when
``ep > cp`` (``cp_out = 1``) and a slice of one engine's CP ranks when ``ep < cp`` (``dp_ep = 1``). When neither of
``cp`` and ``ep`` divides the other, DeepInfer's EP blocks straddle engines unevenly and no mesh realises them:
:func:`make_mesh` refuses such layouts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from sharding.layout import layout

MESH_AXES = ("dp_out", "dp_ep", "cp_out", "cp_ep")
GROUP_AXES: dict[str, tuple[str, ...]] = {
    "dp": ("dp_out", "dp_ep"),
    "cp": ("cp_out", "cp_ep"),
    "ep": ("dp_ep", "cp_ep"),
}


def mesh_shape(dp: int, cp: int, ep: int) -> dict[str, int]:
    """Sizes of the four mesh axes for a ``(dp, cp, ep)`` layout (no devices needed).

    Raises ValueError for sizes :func:`~sharding.layout.layout` rejects, and when neither ``cp`` nor ``ep`` divides
    the other (the EP groups are then not a sub-mesh).
    """
    layout(dp, cp, ep)  # validates sizes and world % ep
    if ep % cp and cp % ep:
        raise ValueError(f"no device mesh realises dp={dp} cp={cp} ep={ep}: an EP group must be whole engines "
                         f"(cp divides ep) or a slice of one engine's CP ranks (ep divides cp)")
    dp_ep = ep // cp if ep >= cp else 1
    cp_ep = min(ep, cp)
    return {"dp_out": dp // dp_ep, "dp_ep": dp_ep, "cp_out": cp // cp_ep, "cp_ep": cp_ep}


def make_mesh(dp: int = 1, cp: int = 1, ep: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The mesh of the first ``dp·cp`` of ``devices`` (default ``jax.devices()``) realising ``layout(dp, cp, ep)``:
    device ``i`` of that list is worker ``i``. See the module docstring for the axes.

    Raises ValueError for an invalid layout (see :func:`mesh_shape`) or too few devices.
    """
    sizes = mesh_shape(dp, cp, ep)
    devs = list(devices if devices is not None else jax.devices())
    world = dp * cp
    if world > len(devs):
        raise ValueError(f"dp={dp} cp={cp} ep={ep} needs dp·cp = {world} devices, {len(devs)} available")
    arr = np.array(devs[:world], dtype=object).reshape(tuple(sizes[a] for a in MESH_AXES))
    return Mesh(arr, MESH_AXES)


def group_size(mesh: Mesh, kind: str) -> int:
    """Number of workers in one ``kind`` (``"dp"``, ``"cp"`` or ``"ep"``) group of ``mesh``."""
    if kind not in GROUP_AXES:
        raise ValueError(f"group kind must be one of {tuple(GROUP_AXES)}, got {kind!r}")
    return math.prod(mesh.shape[a] for a in GROUP_AXES[kind])


def mesh_size(mesh: Mesh) -> int:
    """Number of devices in ``mesh``."""
    return math.prod(mesh.shape.values())
