"""Expert parallelism and EPLB (docs/expert_parallel.md) on 8 forced CPU devices (tests/conftest.py).

Exactness. The EP paths and the one-device ``"ragged"`` path compute every (token, choice) row with the same
grouped GEMM (``jax.lax.ragged_dot``) and sum a token's k rows in choice order, so they differ only where XLA:CPU
rounds a row's fp32 dot differently in GEMMs of different shapes: its ``ragged_dot`` contracts over (group, D)
jointly, so the number of groups a rank holds (E on one device, (E + R) / ep under EP) and the row count change
the summation blocking (one group is lowered as a plain dot). Measured: bit-equal in most layouts, else ≤ 2.4e-9
absolute (≈ 1e-6 of the output scale); held to 1e-6 relative. All-gather vs all-to-all dispatch and two
placements of one layout run GEMMs of identical shapes and are checked bit for bit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.models import eplb, inspect, load_config, random_model
from dinfer_jax.models.ep_model import measured_loads, with_placements
from dinfer_jax.models.expert_parallel import ep_experts
from dinfer_jax.models.moe import _experts_ragged, moe
from helpers import rel_err
from sharding import Sharder, make_mesh

E_TINY = 8  # tiny-v4: 8 routed experts, top-2, hidden 64


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config("tiny-v4").replace(index_topk=3)
    assert cfg.n_routed_experts == E_TINY and len(jax.devices()) >= 8
    model = random_model(cfg, seed=11, include_mtp=False)
    p = model.params["layers"][3]["ffn"]
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 8, cfg.hidden_size))
    ref, aux = moe(p, x, None, cfg=cfg, hash_routed=False, impl="ragged")
    return cfg, model, p, x, np.asarray(ref), aux


def _ep_moe(cfg, p, x, sharder, impl, expert_map=None):
    fn = jax.jit(lambda p, x, m: moe(p, x, None, cfg=cfg, hash_routed=False, impl=impl, sharder=sharder,
                                     expert_map=m)[0])
    return np.asarray(fn(p, x, expert_map))


def _assert_matches_single_device(got, ref):
    assert rel_err(got, ref)[0] < 1e-6  # fp32 GEMMs of other shapes (module docstring)


def _placed(p, placement):
    """Layer params with experts in the placement's physical-slot layout (unsharded; shard_map splits them)."""
    return {**p, "experts": eplb.physical_experts(p["experts"], placement)}


# DeepInfer layouts on 8 workers: EP over everything, EP inside one engine's CP ranks, EP spanning engines, and
# EP groups smaller than the world (dp > 1 outside the group).
LAYOUTS = [(8, 1, 8), (1, 8, 8), (4, 2, 8), (2, 4, 4), (4, 2, 4), (8, 1, 2), (1, 8, 2), (2, 4, 2)]


@pytest.mark.parametrize("dispatch", ["ep_allgather", "ep_alltoall"])
@pytest.mark.parametrize("dp,cp,ep", LAYOUTS)
def test_ep_equals_single_device(tiny, dp, cp, ep, dispatch):
    cfg, _, p, x, ref, _ = tiny
    got = _ep_moe(cfg, p, x, Sharder(make_mesh(dp=dp, cp=cp, ep=ep)), dispatch)
    _assert_matches_single_device(got, ref)


@pytest.mark.parametrize("dp,cp,ep,redundant", [(8, 1, 8, 8), (2, 4, 4, 4), (8, 1, 2, 2)])
def test_eplb_dispatches_agree_and_rebalance_is_bit_identical(tiny, dp, cp, ep, redundant):
    """Redundant replicas: all-gather = all-to-all = one device, and a second placement (rebalanced on a skewed
    load) gives the same bits."""
    cfg, _, p, x, ref, aux = tiny
    sharder = Sharder(make_mesh(dp=dp, cp=cp, ep=ep))
    first = eplb.initial_placement(E_TINY, redundant, ep)
    loads = np.asarray(eplb.expert_loads(aux["router_indices"], E_TINY)) * np.array([9, 1, 1, 1, 1, 1, 1, 3])
    second = eplb.rebalance(loads, redundant, ep)
    assert not np.array_equal(first.physical_to_logical, second.physical_to_logical)
    outs = {}
    for name, placement in (("first", first), ("second", second)):
        for impl in ("ep_allgather", "ep_alltoall"):
            outs[name, impl] = _ep_moe(cfg, _placed(p, placement), x, sharder, impl, placement.expert_map())
    base = outs["first", "ep_allgather"]
    for key, got in outs.items():
        np.testing.assert_array_equal(got, base, err_msg=str(key))
    _assert_matches_single_device(base, ref)


def test_alltoall_capacity_drops_are_counted(tiny):
    """``ep_experts`` directly (routed experts only): the default capacity is lossless, a small one drops rows and
    says so."""
    cfg, _, p, x, _, aux = tiny
    mesh = make_mesh(dp=8, cp=1, ep=4)
    idx, w = aux["router_indices"], aux["router_weights"]
    want = _experts_ragged(p["experts"], x.reshape(-1, x.shape[-1]), idx.reshape(-1, 2), w.reshape(-1, 2), cfg=cfg)
    kw = dict(mesh=mesh, token_spec=Sharder(mesh).spec(("act_batch", "act_seq"), x.shape[:2]),
              swiglu_limit=cfg.swiglu_limit, dispatch="alltoall")
    y, dropped = ep_experts(p["experts"], x, idx, w, **kw)
    assert int(np.asarray(dropped).sum()) == 0
    np.testing.assert_array_equal(np.asarray(y).reshape(want.shape), np.asarray(want))
    _, dropped = ep_experts(p["experts"], x, idx, w, capacity=1, **kw)
    assert int(np.asarray(dropped).sum()) > 0


def test_bad_ep_sizes_raise(tiny):
    cfg, _, p, x, _, aux = tiny
    with pytest.raises(ValueError, match="does not divide num_experts"):
        eplb.initial_placement(8, 3, 4)                  # 11 slots over 4 ranks: unequal slots per rank
    with pytest.raises(ValueError, match="does not divide num_experts"):
        eplb.rebalance(np.ones(8), 1, 2)
    with pytest.raises(ValueError, match="num_redundant_experts must be an integer >= 0"):
        eplb.initial_placement(8, -2, 2)
    assert eplb.resolve_num_redundant(8, 3, 4) == 4
    mesh = make_mesh(dp=8, cp=1, ep=4)
    kw = dict(mesh=mesh, token_spec=Sharder(mesh).spec(("act_batch", "act_seq"), x.shape[:2]),
              swiglu_limit=cfg.swiglu_limit)
    six = jax.tree_util.tree_map(lambda a: a[:6], p["experts"])
    with pytest.raises(ValueError, match="6 expert slots cannot be split over an EP group of 4"):
        ep_experts(six, x, aux["router_indices"], aux["router_weights"], **kw)
    with pytest.raises(ValueError, match="expert map describes 8 experts"):
        ep_experts(p["experts"], x, aux["router_indices"], aux["router_weights"],
                   expert_map=eplb.initial_placement(8, 4, 4).expert_map(), **kw)
    with pytest.raises(ValueError, match="needs a mesh"):
        moe(p, x, None, cfg=cfg, hash_routed=False, impl="ep")
    with pytest.raises(ValueError, match="needs an expert-parallel moe_impl"):
        moe(p, x, None, cfg=cfg, hash_routed=False, impl="ragged", expert_map=eplb.identity_map(8))


# ---- placement algorithm -------------------------------------------------------------------------------------

def test_initial_placement_is_deepinfers():
    pl = eplb.initial_placement(8, 4, 4)
    assert pl.physical_to_logical.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    assert pl.logical_count.tolist() == [2, 2, 2, 2, 1, 1, 1, 1]
    assert pl.logical_to_physical[0].tolist() == [0, 8, -1, -1, -1]
    assert pl.rank_experts() == [[0, 1, 2], [3, 4, 5], [6, 7, 0], [1, 2, 3]]


def test_rebalance_hand_example():
    """E = 4 experts with loads [8, 4, 2, 2] on ep = 2 ranks (worked out by hand, docs/expert_parallel.md).

    Identity placement: ranks {0,1} = 12, {2,3} = 4 → balance (mean / peak) 8/12. Rebalanced without
    redundancy: slots [0, 3 | 1, 2] → 10 / 6 → 0.8. Two redundant slots: expert 0 (8 → 4 + 4), then expert 1
    (ties broken by the 1e-4·e offset) → per-replica loads 4, 2, 2, 2, 4, 2, placed heaviest first on the rank with
    the lowest resulting peak → [0, 1, 3 | 0, 2, 1], 8 / 8 → balance 1."""
    loads = np.array([8, 4, 2, 2])
    ident = eplb.initial_placement(4, 0, 2)
    assert eplb.balance(ident, loads) == pytest.approx(8 / 12)
    no_red = eplb.rebalance(loads, 0, 2)
    assert no_red.physical_to_logical.tolist() == [0, 3, 1, 2]
    assert eplb.rank_loads(no_red, loads).tolist() == [[10, 6]]
    assert eplb.balance(no_red, loads) == pytest.approx(0.8)
    red = eplb.rebalance(loads, 2, 2)
    assert red.physical_to_logical.tolist() == [0, 1, 3, 0, 2, 1]
    assert red.logical_count.tolist() == [2, 2, 1, 1]
    assert red.logical_to_physical.tolist() == [[0, 3, -1], [1, 5, -1], [4, -1, -1], [2, -1, -1]]
    assert eplb.rank_loads(red, loads).tolist() == [[8, 8]]
    assert eplb.balance(red, loads) == 1.0


def test_rebalance_properties_on_skewed_loads():
    """64 experts with power-law loads (±20% per step) over 8 ranks: the identity placement reaches a balance
    (mean / peak rank load) of 0.57, a rebalance without replicas 0.69, with 8–32 replicas > 0.95."""
    rng = np.random.default_rng(0)
    E, ep = 64, 8
    loads = rng.permutation(1000 / (1 + np.arange(E)) ** 0.8)[None] * rng.uniform(0.8, 1.2, (20, E))
    base = eplb.balance(eplb.initial_placement(E, 0, ep), loads)
    no_red = eplb.balance(eplb.rebalance(loads, 0, ep), loads)
    assert base < 0.6 and 0.65 < no_red
    for red in (8, 16, 32):
        pl = eplb.rebalance(loads, red, ep)        # Placement validates the two maps against each other
        assert (pl.logical_count >= 1).all() and pl.logical_count.sum() == E + red
        assert {len(r) for r in pl.rank_experts()} == {(E + red) // ep}
        assert sorted(set(pl.physical_to_logical.tolist())) == list(range(E))
        assert eplb.balance(pl, loads) > 0.95 > no_red
        assert eplb.balance(eplb.initial_placement(E, red, ep), loads) < 0.6   # replicas alone do not balance


def test_replica_choice_and_load_counting():
    pl = eplb.initial_placement(8, 8, 4)           # every expert has 2 replicas
    idx = jnp.asarray(np.random.default_rng(1).integers(0, 8, (50, 2)), jnp.int32)
    for rank in range(4):
        got = np.asarray(eplb.physical_slots(pl.expert_map(), idx, rank))
        t = np.arange(50)[:, None]
        want = pl.logical_to_physical[np.asarray(idx), (rank + t * eplb.REPLICA_PRIME) % 2]
        np.testing.assert_array_equal(got, want)
        assert (pl.physical_to_logical[got] == np.asarray(idx)).all()
    valid = jnp.arange(50) < 40
    np.testing.assert_array_equal(np.asarray(eplb.expert_loads(idx, 8, valid)),
                                  np.bincount(np.asarray(idx[:40]).reshape(-1), minlength=8))


# ---- model level ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dp,cp,ep,impl", [(8, 1, 8, "ep_allgather"), (2, 4, 4, "ep_alltoall")])
def test_model_forward_under_ep_mesh(tiny, dp, cp, ep, impl):
    cfg, model, *_ = tiny
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 30))
    ref = inspect(model, ids)
    sharded = random_model(cfg, seed=11, include_mtp=False, sharder=Sharder(make_mesh(dp=dp, cp=cp, ep=ep)))
    assert sharded.moe_impl == "ep"
    out = inspect(dataclasses.replace(sharded, moe_impl=impl), ids)
    for layer, picks in ref["router_indices"].items():
        np.testing.assert_array_equal(out["router_indices"][layer], picks)
    # fp32; attention and mHC reductions under the mesh may differ in order, the experts are exact (ep ≤ 4).
    assert rel_err(out["logits"], ref["logits"])[0] < 1e-5
    np.testing.assert_array_equal(out["logits"].argmax(-1), ref["logits"].argmax(-1))


def test_eplb_rebalance_mid_run_leaves_tokens_unchanged(tiny):
    """Greedy decoding (full causal forward over a fixed-length buffer, so one program serves every step) on an
    EP mesh with redundant experts: after 3 steps the measured per-layer loads drive a rebalance of every layer and
    decoding continues. Logits of every step equal the run without a rebalance bit for bit; tokens equal the
    single-device run."""
    cfg, model, *_ = tiny
    prompt, steps, ep, red = 6, 6, 4, 4
    rng = np.random.default_rng(3)
    buf0 = np.zeros((2, prompt + steps), np.int64)
    buf0[:, :prompt] = rng.integers(0, cfg.vocab_size, (2, prompt))
    sharded = random_model(cfg, seed=11, include_mtp=False, sharder=Sharder(make_mesh(dp=2, cp=4, ep=ep)))
    start = with_placements(sharded, [eplb.initial_placement(E_TINY, red, ep)] * cfg.num_layers)

    def decode(m, rebalance_at=None):
        buf, logits, window = buf0.copy(), [], []
        for s in range(steps):
            if s == rebalance_at:
                new = eplb.rebalance_layers(np.stack(window), red, ep)
                assert any(not np.array_equal(a.physical_to_logical, b.physical_to_logical)
                           for a, b in zip(new, [eplb.initial_placement(E_TINY, red, ep)] * len(new), strict=True))
                m = with_placements(m, new)
            out = inspect(m, buf)
            t = prompt + s
            window.append(np.asarray(measured_loads(
                {k: v[:, :t] for k, v in out["router_indices"].items()}, E_TINY)))
            logits.append(out["logits"][:, t - 1])
            buf[:, t] = out["logits"][:, t - 1].argmax(-1)
        return buf, np.stack(logits)

    ref_tokens, ref_logits = decode(model)
    plain_tokens, plain_logits = decode(start)
    reb_tokens, reb_logits = decode(start, rebalance_at=3)
    np.testing.assert_array_equal(reb_logits, plain_logits)
    np.testing.assert_array_equal(reb_tokens, plain_tokens)
    np.testing.assert_array_equal(plain_tokens, ref_tokens)
    assert rel_err(plain_logits, ref_logits)[0] < 1e-5
