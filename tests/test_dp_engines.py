"""Attention-DP engines on the 8 forced CPU devices (``docs/dp_engines.md``): greedy ``LLM.generate`` with
``(dp_size, cp_size, ep_size)`` must give exactly the one-device engine's tokens for mixed-length prompts (chunked
prefill, engines idle while others work, prefill and decode engines in one iteration); invalid layouts raise a
ValueError naming the rule; the scheduler's CP alignment (``cp_align``) chunks as DeepInfer does.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dinfer_jax import LLM, SamplingParams
from dinfer_jax.engine.block_manager import BlockManager, StateSlots
from dinfer_jax.engine.dp_runner import parallel_layout
from dinfer_jax.engine.runner import Buckets
from dinfer_jax.engine.scheduler import Scheduler, SchedulerConfig
from dinfer_jax.models import inspect, load_config, random_model
from dinfer_jax.models.ep_model import measured_loads

LENGTHS = [5, 23, 41, 12, 30]  # 41 > the 32-token budget: chunked; 5 prompts over dp engines: uneven work
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
GREEDY_LP = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
KW = dict(max_num_seqs=4, max_model_len=96, max_num_batched_tokens=32, progress=False,
          buckets=Buckets(decode_batch=(4,), prefill_batch=(4,), prefill_len=(32,)))


@pytest.fixture(scope="module")
def setup():
    cfg = load_config("tiny-v4")
    model = random_model(cfg, seed=3, std=0.1, include_mtp=False)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(4, cfg.vocab_size, size=n)] for n in LENGTHS]
    single = LLM(model, **KW)
    ref = [o.token_ids for o in single.generate(prompts, GREEDY, use_tqdm=False)]
    ref_lp = [o.logprobs for o in single.generate(prompts[:2], GREEDY_LP, use_tqdm=False)]
    ref_sampled = [o.token_ids for o in single.generate(prompts, _sampled(), use_tqdm=False)]
    return model, prompts, ref, ref_lp, ref_sampled


def _sampled() -> list[SamplingParams]:
    """Seeded sampled requests with filters, and one greedy row among them (every sampler branch of a step)."""
    kinds = [dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, top_k=20), dict(temperature=0.0),
             dict(temperature=0.7, min_p=0.05), dict(temperature=1.2)]
    return [SamplingParams(max_tokens=12, ignore_eos=True, seq_seed=1000 + i, **kw) for i, kw in enumerate(kinds)]


@pytest.mark.parametrize("dp,cp,ep", [(1, 1, 8), (2, 1, 4), (2, 2, 2), (4, 2, 8), (1, 2, 2)])
def test_dp_engines_equal_single_device(setup, dp, cp, ep):
    assert len(jax.devices()) >= 8
    model, prompts, ref, ref_lp, ref_sampled = setup
    llm = LLM(model, dp_size=dp, cp_size=cp, ep_size=ep, **KW)
    compiled = llm.metrics()["compilations"]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.finish_reason == "length" for o in outs)
    assert [o.token_ids for o in outs] == ref
    if (dp, cp, ep) == (2, 1, 4):
        # synchronous loop, and one prompt only (engine 1 runs padding every step): same tokens
        llm.configure(async_scheduling=False)
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == ref
        llm.configure(async_scheduling=True)
        assert llm.generate([prompts[2]], GREEDY, use_tqdm=False)[0].token_ids == ref[2]
        # logprobs of each engine's rows come back with its tokens
        for got, want in zip(llm.generate(prompts[:2], GREEDY_LP, use_tqdm=False), ref_lp, strict=True):
            assert [e["token"] for e in got.logprobs] == [e["token"] for e in want]
            np.testing.assert_allclose([e["logprob"] for e in got.logprobs], [e["logprob"] for e in want],
                                       rtol=1e-5, atol=1e-6)
            assert [[t for t, _ in e["top"]] for e in got.logprobs] == [[t for t, _ in e["top"]] for e in want]
    if (dp, cp, ep) in ((2, 1, 4), (2, 2, 2)):
        # seeded sampling with filters (the sampler's draw variant; a greedy row among the sampled): the one-device
        # engine's tokens, whichever engine a request lands on
        assert [o.token_ids for o in llm.generate(prompts, _sampled(), use_tqdm=False)] == ref_sampled
    assert llm.metrics()["compilations"] == compiled, "compiled outside warm-up"


@pytest.mark.parametrize("dp,cp,ep,rule", [
    (3, 1, 2, "does not divide the world size"),
    (2, 1, 3, "multiple of dp·cp"),
    (2, 3, 2, "no device mesh realises"),
    (8, 2, 1, "devices"),
    (0, 1, 1, "dp_size must be an integer"),
])
def test_invalid_layouts_raise(dp, cp, ep, rule):
    with pytest.raises(ValueError, match=rule):
        parallel_layout(dp, cp, ep)
    with pytest.raises(ValueError, match=rule):
        LLM("tiny-v4", dp_size=dp, cp_size=cp, ep_size=ep, warmup=False, progress=False)


def test_layout_mapping():
    assert parallel_layout(1, 1, 8).replicas == 8  # one engine, attention on 8 copies, experts over 8
    assert parallel_layout(2, 1, 4).replicas == 2
    lay = parallel_layout(4, 2, 8)
    assert (lay.replicas, lay.devices, lay.engine_copies) == (1, 8, 4)


def test_cp_align_chunks_like_deepinfer():
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=18, max_model_len=64, block_size=16, cp_align=4)
    sched = Scheduler(cfg, BlockManager(20, 16), StateSlots(4), vocab_size=100)
    sched.add_request(0, list(range(1, 6)))    # 5 tokens: charged 8 of the budget
    sched.add_request(1, list(range(1, 31)))   # 30 tokens: 10 left, chunk = 8 (multiple of cp_align)
    step = sched.schedule()
    assert [r.num_tokens for r in step.rows] == [5, 8]
    sched.process_step(step, [7, None])
    step = sched.schedule()  # the partial prompt first: 22 left > 16 (18 rounded down) -> 16
    assert [r.num_tokens for r in step.rows] == [16]
    sched.process_step(step, [None])
    step = sched.schedule()  # 6 left: the final chunk needs no alignment
    assert step.kind == "prefill" and [r.num_tokens for r in step.rows] == [6]
    with pytest.raises(ValueError, match="cp_align"):
        SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=4, max_model_len=64, block_size=16, cp_align=8)


def test_cp_tokenwise_owner_ranks_follow_cp_split():
    """Each CP rank computes exactly its mirrored rows (``sharding.cp_split`` per row's ``n``); the all-gather puts
    every result back at its position; positions ≥ n are zeros."""
    from functools import partial

    from jax.sharding import PartitionSpec

    from dinfer_jax.models.cp_rows import cp_tokenwise
    from sharding import cp_split, make_mesh

    cp, Q = 4, 19
    mesh = make_mesh(1, cp, 1)
    n = np.array([19, 7, 1, 0, 12], np.int32)
    x = np.arange(len(n) * Q * 2, dtype=np.float32).reshape(len(n), Q, 2) + 1

    def body(x, n):
        rank = jax.lax.axis_index(("cp_out", "cp_ep"))
        owner = partial(lambda x, rank: x * 10 + rank, rank=rank.astype(np.float32))
        return cp_tokenwise(owner, x, (), n, cp)

    fn = jax.shard_map(body, mesh=mesh, in_specs=(PartitionSpec(), PartitionSpec()), out_specs=PartitionSpec(),
                       check_vma=False)
    y = np.asarray(jax.jit(fn)(x, n))
    for b, nb in enumerate(n):
        want_owner = np.full(Q, -1)
        for r, rows in enumerate(cp_split(int(nb), cp)):
            want_owner[rows] = r
        real = want_owner >= 0
        np.testing.assert_array_equal(y[b, real] - x[b, real] * 10, np.repeat(want_owner[real, None], 2, 1))
        assert not y[b, ~real].any()


def test_group_tokenwise_splits_an_engines_tokens_over_its_copies_and_cp_ranks():
    """(dp, cp, ep) = (2, 2, 8): two engines, each on 2 copies × 2 CP ranks; the engine's B·Q tokens are split in 4
    contiguous shares, one per device, and come back in order, each engine getting its own tokens."""
    from dinfer_jax.models.cp_rows import group_tokenwise
    from sharding import make_mesh

    lay = parallel_layout(2, 2, 8)
    copies, cp = lay.replicas, lay.cp
    mesh = make_mesh(lay.engine_copies, cp, 8)
    B, Q, g = 3, 5, copies * cp
    x = np.arange(2 * B * Q * 2, dtype=np.float32).reshape(2, B, Q, 2) + 1
    x_copies = np.repeat(x, copies, axis=0)  # engine e at rows e·copies …

    def body(x):
        k = (jax.lax.axis_index(("dp_out", "dp_ep")) % copies) * cp + jax.lax.axis_index(("cp_out", "cp_ep"))
        return group_tokenwise(lambda x: x * 10 + k.astype(np.float32), x[0], (), copies, cp)[None]

    spec = jax.sharding.PartitionSpec(("dp_out", "dp_ep"))
    fn = jax.shard_map(body, mesh=mesh, in_specs=(spec,), out_specs=spec, check_vma=False)
    y = np.asarray(jax.jit(fn)(x_copies))
    share = -(-B * Q // g)
    owner = (np.arange(B * Q) // share).reshape(B, Q)
    for m in range(lay.engine_copies):
        e = m // copies
        np.testing.assert_array_equal(y[m] - x[e] * 10, np.repeat(owner[..., None], 2, -1))


def test_eplb_engine_rebalances_keep_tokens_and_loads_are_counted(setup):
    """EPLB in the engine, dp=2, ep=4 with 4 redundant slots (8 experts in 12 slots, 3 per rank):

    * DeepInfer's periodic EPLB (``eplb_interval=3``: every 3 mesh steps, from the loads measured since the last
      one, while requests are in flight) leaves the one-device tokens and compiles nothing;
    * a rebalance on given skewed loads really moves experts (more replicas for the hot one) and again leaves the
      tokens;
    * the loads the engine measures equal an independent count from the full forward's router indices over every
      token the engine fed (prompt, then each generated token but the last)."""
    model, prompts, ref, *_ = setup
    llm = LLM(model, dp_size=2, ep_size=4, num_redundant_experts=4, eplb_interval=3, **KW)
    compiled = llm.metrics()["compilations"]
    first = [p.physical_to_logical.tolist() for p in llm.runner.placements]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == ref
    assert llm.metrics()["eplb_rebalances"] >= 4
    assert [p.physical_to_logical.tolist() for p in llm.runner.placements] != first

    llm.configure(eplb_interval=0)
    llm.rebalance_experts()                             # from the loads since the last automatic one; resets them
    E, L = model.config.n_routed_experts, model.config.num_layers
    loads = np.ones((L, E), np.int64)
    loads[:, 0] = 50                                    # expert 0 is hot everywhere
    placements = llm.rebalance_experts(loads)
    assert all(int(p.logical_count[0]) > 1 for p in placements)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == ref
    want = sum(np.asarray(measured_loads(inspect(model, [p + r[:-1]])["router_indices"], E)) for p, r in
               zip(prompts, ref, strict=True))
    np.testing.assert_array_equal(llm.expert_loads(), want)
    assert llm.expert_loads().sum() == L * model.config.n_activated_experts * sum(
        len(p) + len(r) - 1 for p, r in zip(prompts, ref, strict=True))
    assert llm.metrics()["compilations"] == compiled, "a rebalance recompiled"

    with pytest.raises(ValueError, match=r"tokens_per_expert must be \[layers="):
        llm.rebalance_experts(np.ones((L + 1, E)))
    with pytest.raises(ValueError, match="ep_size > 1"):
        LLM(model, num_redundant_experts=4, warmup=False, progress=False)
    with pytest.raises(ValueError, match="eplb_interval"):
        LLM(model, dp_size=2, ep_size=4, eplb_interval=3, warmup=False, progress=False)


@pytest.mark.parametrize("cp,Q", [(2, 24), (4, 21), (2, 6)])
def test_cp_split_attention_equals_unsplit(cp, Q):
    """Balanced CP attention: inside the per-device step each CP rank attends only its mirrored query rows (over the
    window — per-query keys when the chunk exceeds it, shared keys otherwise — and the compressed rows, all masked
    or gathered top-k), optionally projected on the rank (``project``, the output projection in the model), and the
    outputs are all-gathered back into row order. Against the same function unsplit (one device, projected after):
    equal to fp32 rounding (each query's computation is the same; only XLA's batching differs; 1e-5 of the scale
    for the projected sums of H·d products), padding queries (≥ n) zero in the split result."""
    import types

    from jax.sharding import PartitionSpec

    from dinfer_jax.models import layers
    from dinfer_jax.models.cache_io import take_rows
    from sharding import make_mesh

    cfg = load_config("tiny-v4")
    W, R = cfg.sliding_window, cfg.sliding_window + 2
    B, H, d, T, K = 3, 4, 16, 10, 3
    rng = np.random.default_rng(cp * 100 + Q)
    start = np.array([0, 5, 30], np.int32)
    n = np.array([Q, Q - 3, 1], np.int32)
    pos = start[:, None] + np.arange(Q)[None]
    rpos = start[:, None] - 1 - np.mod(start[:, None] - 1 - np.arange(R)[None], R)
    kpos = np.concatenate([rpos, pos], axis=1)
    kvalid = np.concatenate([rpos >= 0, np.arange(Q)[None] < n[:, None]], axis=1)
    real = np.arange(Q)[None] < n[:, None]
    wmask = (kvalid[:, None] & (kpos[:, None] <= pos[..., None]) & (kpos[:, None] > pos[..., None] - W)
             & real[..., None])
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    q = f32(rng.standard_normal((B, Q, H, d)))
    keys = f32(rng.standard_normal((B, R + Q, d)))
    ckv = f32(rng.standard_normal((B, T, d)))
    sink = f32(rng.standard_normal(H))
    cmask = (rng.random((B, Q, T)) < 0.5) & real[..., None]
    idx = np.where(rng.random((B, Q, K)) < 0.8, np.sort(rng.integers(0, T, (B, Q, K)), axis=-1), -1).astype(np.int32)

    wo = f32(rng.standard_normal((H * d, 8)))

    def project(o, pos):   # a stand-in output projection that also reads each row's position
        return o.reshape(*o.shape[:2], H * d) @ wo + pos[..., None].astype(np.float32)

    def both(q, keys, wmask, ckv, cmask, idx, start, n, pos, cp_manual):
        ctx = layers.StepContext(inp=types.SimpleNamespace(start=start, n=n), pos=pos, ropes={})
        opts = layers.LayerOptions(cp_manual=cp_manual)
        out = []
        for proj in (None, project):   # with project, a split step projects each rank's rows before the gather
            out.append(layers._attend_all(q, keys, wmask, ckv, cmask, sink, ctx, cfg, opts, project=proj))
            out.append(layers._attend_rows(q, keys, wmask, lambda i: take_rows(ckv, i), idx, sink, ctx, cfg, opts,
                                           project=proj))
        return tuple(out)

    args = (q, keys, wmask, ckv, cmask, idx, start, n, pos)
    want = jax.jit(lambda *a: both(*a, cp_manual=0))(*args)
    # unsplit, the callers project (layers.layer_v4 / layer_v41): the same function applied afterwards
    want = (*want[:2], *(jax.jit(project)(w, pos) for w in want[:2]))
    mesh = make_mesh(1, cp, 1)
    split = jax.shard_map(lambda *a: both(*a, cp_manual=cp), mesh=mesh, in_specs=(PartitionSpec(),) * len(args),
                          out_specs=(PartitionSpec(),) * 4, check_vma=False)
    got = jax.jit(split)(*args)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        g, w = np.asarray(g), np.asarray(w)
        np.testing.assert_allclose(g[real], w[real], rtol=0, atol=(1e-6 if i < 2 else 1e-5) * np.abs(w).max())
        assert not g[~real].any()


def _query_projection_rows(llm: LLM, cfg, shape: tuple[int, int, int]) -> list[tuple[int, ...]]:
    """The left operands' shapes of every ``dot_general`` by a query up-projection (``wq_b`` of the attention,
    ``[H·d, q_lora]``, or of the indexer, ``[Hi·di, q_lora]``, applied to latents ``[B, rows, q_lora]``) in the
    per-device model program of bucket ``shape``, read from its StableHLO (other weights of the indexer's shape,
    applied to flattened tokens, are not counted)."""
    import re

    rhs = {f"{cfg.num_heads * cfg.head_dim}x{cfg.q_lora_rank}", f"{cfg.index_n_heads * cfg.index_head_dim}x"
           f"{cfg.q_lora_rank}"}
    text = llm.runner._lower_forward(shape).as_text()
    found = []
    for m in re.finditer(r"stablehlo\.dot_general .*?: \(tensor<([0-9x]+)x\w+>, tensor<([0-9x]+)x\w+>\)", text):
        lhs = tuple(int(v) for v in m.group(1).split("x"))
        if m.group(2) in rhs and len(lhs) == 3 and lhs[-1] == cfg.q_lora_rank:
            found.append(lhs)
    return found


@pytest.mark.parametrize("preset", ["tiny-v4", "tiny-v41"])
def test_cp_ranks_project_only_their_own_queries(preset):
    """On a CP prefill step each rank computes the query heads (``wq_b``, V4-Flash's largest attention projection:
    ``q_lora · H · d`` products a token) and the indexer's queries of its mirrored rows only, ``2·ceil(Q / 2C)`` a
    sequence, not all ``Q``: read from the lowered per-device program, against a control without CP whose
    projections take all the rows (so the pattern finds them)."""
    cfg = load_config(preset)
    model = random_model(cfg, seed=3, std=0.1, include_mtp=False)
    kw = {**KW, "warmup": False}
    b, q, p = 4, 32, 6
    split = _query_projection_rows(LLM(model, dp_size=1, cp_size=2, ep_size=2, **kw), cfg, (b, q, p))
    control = _query_projection_rows(LLM(model, dp_size=2, cp_size=1, ep_size=2, **kw), cfg, (b, q, p))
    assert control and set(control) == {(b, q, cfg.q_lora_rank)}
    assert len(split) == len(control)
    assert set(split) == {(b, 2 * -(-q // 4), cfg.q_lora_rank)}


def test_cp_engine_v41_equals_single_device():
    """V4.1 under CP (1, 2, 2): prefill rows' indexer scores and top-k (KV sources, index sources restricted to
    the candidate blocks, their consumers), attention core and MoE run on each rank's mirrored rows; greedy tokens
    equal one device's on prompts long enough that the indexer drops rows (41 tokens: 20 compressed rows of ratio
    2 > top-k 8) and chunked (32-token budget)."""
    cfg = load_config("tiny-v41")
    model = random_model(cfg, seed=3, std=0.1, include_mtp=False)
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(4, cfg.vocab_size, size=n)] for n in (41, 23, 30)]
    ref = [o.token_ids for o in LLM(model, **KW).generate(prompts, GREEDY, use_tqdm=False)]
    got = [o.token_ids for o in LLM(model, dp_size=1, cp_size=2, ep_size=2, **KW).generate(prompts, GREEDY,
                                                                                            use_tqdm=False)]
    assert got == ref


def test_checkpoint_loads_onto_the_mesh_in_scan_layout(tmp_path):
    """``LLM(path, dp_size=…, ep_size=…)`` reads the checkpoint straight onto the engines' mesh in scan layout: the
    loaded routed experts are split over the EP axes as read (each device holds ``E / ep`` experts of every stacked
    leaf; nothing else is split) with the values of a one-device load, and the engines — EPLB's start-up placement
    done on the stacked weights — give the one-device engine's greedy tokens; the engine keeps one copy of the
    weights (its Model's are the runner's)."""
    from dinfer_jax.engine.dp_runner import engine_sharder
    from dinfer_jax.loading.writer import write_release_checkpoint
    from dinfer_jax.models import load_model
    from dinfer_jax.models.layer_plan import StackedLayers
    from sharding.mesh import GROUP_AXES

    cfg = load_config("tiny-v4")
    write_release_checkpoint(cfg, random_model(cfg, seed=5, std=0.1, include_mtp=False).params, tmp_path)
    lay = parallel_layout(2, 1, 4)
    sharder = engine_sharder(lay)
    ep_axes = {a for a in GROUP_AXES["ep"] if sharder.mesh.shape[a] > 1}
    one = load_model(tmp_path, stacked=True, progress=False)
    meshed = load_model(tmp_path, stacked=True, sharder=sharder, progress=False)
    assert isinstance(meshed.params["layers"], StackedLayers)
    paths = jax.tree_util.tree_leaves_with_path(meshed.params)
    n_expert_leaves = 0
    for (path, got), want in zip(paths, jax.tree_util.tree_leaves(one.params), strict=True):
        split = {a for entry in got.sharding.spec if entry is not None
                 for a in (entry if isinstance(entry, tuple) else (entry,))}
        if "['experts']" in jax.tree_util.keystr(path):        # routed experts [repeats, E, ...]
            n_expert_leaves += 1
            assert split == ep_axes, jax.tree_util.keystr(path)
            assert {s.data.shape[1] for s in got.addressable_shards} == {cfg.n_routed_experts // 4}
        else:
            assert not split, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=jax.tree_util.keystr(path))
    assert n_expert_leaves > 0
    del one, meshed

    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(4, cfg.vocab_size, size=n)] for n in LENGTHS[:3]]
    ref = [o.token_ids for o in LLM(str(tmp_path), **KW).generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM(str(tmp_path), dp_size=2, ep_size=4, num_redundant_experts=4, **KW)
    assert llm.model.params is llm.runner.params
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == ref


def test_expert_moves_hold_one_layer_at_a_time():
    """EPLB's expert moves (the start-up placement and every rebalance, ``dp_runner._moved_experts``) gather along
    the EP-split expert axis, which XLA does by all-gathering the operand on every device. The repeats of a stacked
    leaf are gathered one after another, so the compiled program's temporary memory is about one layer's experts,
    not the whole stack's: 8 stacked layers of 64 experts × 4096 fp32 over 8 EP devices (batched over the repeats,
    the temporary was the whole 8.4 MB stack on every device; XLA's memory analysis of the CPU program)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from dinfer_jax.engine.dp_runner import _axes_spec, _moved_experts, engine_mesh
    from dinfer_jax.models.eplb import ExpertMap
    from dinfer_jax.models.layer_plan import StackedLayers

    mesh = engine_mesh(parallel_layout(1, 1, 8))
    R, E, P, D = 8, 64, 72, 4096
    split = NamedSharding(mesh, PartitionSpec(None, *_axes_spec(mesh, "ep")))
    whole = NamedSharding(mesh, PartitionSpec())
    experts = (({"w1": jax.ShapeDtypeStruct((R, E, D), np.float32, sharding=split)},),)
    tables = StackedLayers((((jax.ShapeDtypeStruct((R, P), np.int32, sharding=whole),    # one group, one position
                              jax.ShapeDtypeStruct((R, E, 2), np.int32, sharding=whole),
                              jax.ShapeDtypeStruct((R, E), np.int32, sharding=whole)),),))
    out = ((({"w1": split}, ExpertMap(whole, whole)),),)
    compiled = jax.jit(_moved_experts, out_shardings=out).lower(experts, tables).compile()
    one_layer = E * D * 4
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < 2 * one_layer, f"temporary {temp / 1e6:.2f} MB, one layer's experts {one_layer / 1e6:.2f} MB"


def test_mesh_engines_plan_their_pools_per_device(setup):
    """With ``device_memory_bytes`` (XLA:CPU reports no memory of its own) the mesh engines plan each engine's pool
    per device: utilisation × the memory offered, less the fullest device's weights — here computed independently
    from the model: every non-expert weight whole on each device plus 1/ep of the routed experts — less the mesh
    step's temporaries (XLA's memory analysis, > 0); the pools get that budget, and the tokens do not change.
    Without a memory figure the engines keep the fixed 256 MiB budget."""
    from dinfer_jax.engine.kv_cache import size_pools
    from dinfer_jax.engine.llm import DEFAULT_KV_BYTES

    model, prompts, ref, *_ = setup
    ep = 4
    leaves = jax.tree_util.tree_leaves_with_path(model.params)
    experts = sum(x.nbytes for p, x in leaves if "['experts']" in jax.tree_util.keystr(p))
    others = sum(x.nbytes for p, x in leaves if "['experts']" not in jax.tree_util.keystr(p))
    offered = 1 << 26   # 64 MiB a device: the pools are host memory on CPU devices (8 of them here)
    llm = LLM(model, dp_size=2, ep_size=ep, device_memory_bytes=offered, memory_utilization=0.5, **KW)
    plan = llm.memory_plan
    assert plan is not None and plan.device_bytes == offered
    assert plan.in_use_bytes == others + experts // ep
    assert plan.activation_bytes > 0
    assert plan.kv_bytes == offered // 2 - plan.in_use_bytes - plan.activation_bytes
    want = size_pools(model.config, memory_bytes=plan.kv_bytes, block_size=llm.block_size, max_num_seqs=4,
                      max_model_len=96, dtype=model.dtype)
    assert llm.cache_config == want
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == ref

    plain = LLM(model, dp_size=2, ep_size=ep, warmup=False, **KW)
    assert plain.memory_plan is None
    assert plain.cache_config == size_pools(model.config, memory_bytes=DEFAULT_KV_BYTES, block_size=plain.block_size,
                                            max_num_seqs=4, max_model_len=96, dtype=model.dtype)
