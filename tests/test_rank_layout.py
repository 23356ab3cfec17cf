"""Rank layout, CP row split, the mesh that realises the groups, and strict sharding rules (issue 10 items 1, 4).

``layout`` and ``cp_split`` are checked against brute-force formulations written here (per-worker coordinates and
per-row ownership), not against the formulas the implementation transcribes.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import numpy as np
import pytest

from dinfer_jax.models import load_config
from dinfer_jax.models.params import map_specs, param_specs
from sharding import (
    DEFAULT_RULES,
    GROUP_AXES,
    MESH_AXES,
    Sharder,
    ShardingError,
    ShardingRules,
    cp_split,
    layout,
    make_mesh,
    mesh_shape,
)


def _valid(max_world: int = 16):
    for dp, cp in itertools.product(range(1, max_world + 1), repeat=2):
        if dp * cp <= max_world:
            for ep in range(1, dp * cp + 1):
                if (dp * cp) % ep == 0:
                    yield dp, cp, ep


def _brute_groups(dp: int, cp: int, ep: int) -> tuple[list, list, list]:
    """Groups from per-worker coordinates: worker w is (engine, cp rank) by enumeration order, EP block by counting."""
    coords, blocks, w = {}, {}, 0
    for e in range(dp):
        for c in range(cp):
            coords[w] = (e, c)
            w += 1
    for w in range(dp * cp):
        blocks.setdefault(w // ep, []).append(w)  # the ep workers counted together
    dpg = [[w for w in sorted(coords) if coords[w][1] == c] for c in range(cp)]
    cpg = [[w for w in sorted(coords) if coords[w][0] == e] for e in range(dp)]
    return dpg, cpg, [blocks[k] for k in sorted(blocks)]


def test_layout_issue_example():
    lay = layout(2, 2, 4)
    assert lay.dp_groups == [[0, 2], [1, 3]] and lay.cp_groups == [[0, 1], [2, 3]] and lay.ep_groups == [[0, 1, 2, 3]]
    with pytest.raises(dataclasses.FrozenInstanceError):
        lay.dp = 3  # type: ignore[misc]


@pytest.mark.parametrize("dp,cp,ep", list(_valid()))
def test_layout_matches_brute_force(dp, cp, ep):
    lay = layout(dp, cp, ep)
    assert (lay.dp_groups, lay.cp_groups, lay.ep_groups) == _brute_groups(dp, cp, ep)
    for groups in (lay.dp_groups, lay.cp_groups, lay.ep_groups):  # each kind partitions the workers
        assert sorted(w for g in groups for w in g) == list(range(dp * cp))
        assert all(type(w) is int for g in groups for w in g)


@pytest.mark.parametrize("args,msg", [((2, 2, 3), "does not divide"), ((1, 1, 8), "does not divide"),
                                      ((2, 1, 4), "does not divide"), ((0, 1, 1), "dp must"),
                                      ((1, -1, 1), "cp must"), ((1, 1, 0), "ep must")])
def test_layout_errors(args, msg):
    with pytest.raises(ValueError, match=msg):
        layout(*args)


def _brute_cp_split(q: int, C: int) -> list[list[int]]:
    """Per row: its piece (pieces of ceil(q/2C) rows) and the rank that owns that piece (mirrored)."""
    owner = {}
    size = max(1, -(-q // (2 * C)))
    for i in range(q):
        piece = i // size
        owner[i] = piece if piece < C else 2 * C - 1 - piece
    return [[i for i in range(q) if owner[i] == r] for r in range(C)]


@pytest.mark.parametrize("C", [1, 2, 3, 4, 5, 8])
def test_cp_split_matches_brute_force(C):
    for q in range(8 * C + 7):
        got = cp_split(q, C)
        assert got == _brute_cp_split(q, C), (q, C)
        assert sorted(i for r in got for i in r) == list(range(q))


def test_cp_split_examples():
    assert cp_split(8, 2) == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert cp_split(5, 2) == [[0, 1], [2, 3, 4]]  # pieces of 2: [0,1] [2,3] [4] [] -> rank 1 gets pieces 1 and 2
    assert cp_split(3, 4) == [[0], [1], [2], []]  # pieces of 1, the last five empty
    assert cp_split(0, 3) == [[], [], []]
    assert cp_split(7, 1) == [list(range(7))]
    with pytest.raises(ValueError, match="num_rows"):
        cp_split(-1, 2)
    with pytest.raises(ValueError, match="cp must"):
        cp_split(4, 0)


def _mesh_groups(mesh, axes: tuple[str, ...]) -> list[list[int]]:
    """Devices sharing every coordinate outside ``axes``, each group in row-major order over ``axes``."""
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    names = list(mesh.axis_names)
    keep = [names.index(a) for a in axes]
    rest = [i for i in range(len(names)) if i not in keep]
    arr = ids.transpose(rest + keep).reshape(-1, int(np.prod([ids.shape[i] for i in keep])))
    return sorted(arr.tolist())


MESH_CASES = [(2, 2, 2), (2, 2, 4), (4, 2, 8), (8, 1, 8), (1, 8, 8), (2, 4, 4), (2, 4, 2), (4, 2, 2), (1, 8, 2),
              (8, 1, 2), (2, 4, 8), (1, 1, 1), (4, 1, 2), (1, 4, 4), (4, 2, 4)]


@pytest.mark.parametrize("dp,cp,ep", MESH_CASES)
def test_mesh_realises_groups(dp, cp, ep):
    devs = jax.devices()
    assert len(devs) >= 8, "conftest sets --xla_force_host_platform_device_count=8"
    worker_of = {d.id: i for i, d in enumerate(devs)}  # worker w is device w of the list
    mesh = make_mesh(dp, cp, ep)
    assert tuple(mesh.axis_names) == MESH_AXES and mesh.devices.size == dp * cp
    lay = layout(dp, cp, ep)
    for kind, want in (("dp", lay.dp_groups), ("cp", lay.cp_groups), ("ep", lay.ep_groups)):
        got = [[worker_of[i] for i in g] for g in _mesh_groups(mesh, GROUP_AXES[kind])]
        assert sorted(got) == sorted(want), kind  # same members, and the same rank order within each group


def test_mesh_errors():
    with pytest.raises(ValueError, match="no device mesh realises"):
        mesh_shape(3, 2, 3)  # world 6, EP blocks of 3 straddle engines of 2
    with pytest.raises(ValueError, match="does not divide"):
        make_mesh(1, 1, 8)
    with pytest.raises(ValueError, match="needs dp·cp = 16 devices"):
        make_mesh(4, 4, 4)
    assert mesh_shape(6, 2, 4) == {"dp_out": 3, "dp_ep": 2, "cp_out": 1, "cp_ep": 2}
    assert mesh_shape(2, 6, 3) == {"dp_out": 2, "dp_ep": 1, "cp_out": 2, "cp_ep": 3}


def test_rules_fail_loudly():
    sharder = Sharder(make_mesh(2, 2, 4))  # EP spans both engines: dp and ep share mesh axis dp_ep
    with pytest.raises(ShardingError, match="'not_an_axis'"):
        sharder.named(("experts", "not_an_axis"))
    with pytest.raises(ShardingError, match="'experts' and 'act_experts'.*group 'ep'"):
        sharder.named(("experts", "act_experts"))
    with pytest.raises(ShardingError, match="mesh axis 'dp_ep' is used by both logical axes 'act_batch' and 'experts'"):
        sharder.named(("act_batch", "experts"))
    with pytest.raises(ShardingError, match="must be one of"):
        ShardingRules.from_dict({"experts": "tp"})
    with pytest.raises(ShardingError, match="Sharder needs a mesh"):
        Sharder(jax.sharding.Mesh(np.array(jax.devices()[:2]), ("ep",)))
    # When EP stays inside one engine, DP and EP are disjoint and the same tensor may use both.
    ok = Sharder(make_mesh(2, 4, 4)).named(("act_batch", "experts"), (2, 8))
    assert tuple(ok.spec) == ("dp_out", "cp_ep")
    # An EP group over dp_ep × cp_ep: a tuple entry, rank order = worker order.
    assert tuple(Sharder(make_mesh(2, 2, 4)).named(("experts", None), (8, 3)).spec) == (("dp_ep", "cp_ep"), None)


@pytest.mark.parametrize("preset", ["tiny-v4", "tiny-v41", "deepseek-v4-flash", "deepseek-v4.1-flash"])
def test_every_parameter_axis_is_declared(preset):
    cfg = load_config(preset)
    used: set[str] = set()
    map_specs(lambda s: used.update(a for a in s.axes if a is not None), param_specs(cfg, include_mtp=True))
    assert used and used <= set(DEFAULT_RULES), sorted(used - set(DEFAULT_RULES))
    assert len(used) >= 10
