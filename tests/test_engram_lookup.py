"""Engram lookups inside the compiled step (``dinfer_jax/models/engram_lookup.py``, issue 13 item 3).

References: TileKernels 2.1.0's ``engram_hash_ref`` (PyTorch, int64) for the 32-bit device hash; the host numpy hash
(itself checked against that reference in tests/test_engram.py) over every extreme id combination; the host table
gather ``EngramTable.gather`` (checked against a hand-written E4M3 decoder in tests/test_engram.py) for the device
and pinned-host gathers; the full forward for the engine's tokens.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax import LLM, SamplingParams
from dinfer_jax.engine.runner import Buckets
from dinfer_jax.loading.safetensors_io import CheckpointFiles
from dinfer_jax.models import forward_logits, load_config, random_model
from dinfer_jax.models.engram import EngramTable, engram_hash, engram_layout
from dinfer_jax.models.engram_lookup import EngramLookup, device_hash, place_tables
from provision import fixture_dir, require_module


def _jit_hash(cfg, ids: np.ndarray) -> np.ndarray:
    return np.asarray(jax.jit(lambda r: device_hash(cfg, r))(jnp.asarray(ids, jnp.int32)))


def test_device_hash_matches_tile_kernels():
    """The 32-bit device hash gives TileKernels' int64 ``engram_hash_ref`` ids on the V4.1-Flash layout (primes just
    above 16,000,000, multipliers below 2^47: products below 2^63)."""
    require_module("torch")
    import torch

    import deepinfer_refs

    deepinfer_refs.require_refs()
    hash_ref = deepinfer_refs.load_ref("tile_kernels/torch/engram.py", "engram_hash_ref")
    make_offsets = deepinfer_refs.load_ref("tile_kernels/torch/engram.py", "make_offsets")
    flash = load_config("deepseek-v4.1-flash")
    mult, primes, _ = engram_layout(flash)
    vc = flash.engram_compressed_vocab_size
    ngrams = np.random.default_rng(0).integers(0, vc, size=(4096, flash.engram_max_ngram_size))
    ngrams[:8] = vc - 1
    ngrams[8:16] = 0
    sizes = torch.tensor(primes, dtype=torch.int32)
    want = hash_ref(torch.tensor(ngrams, dtype=torch.int32), torch.tensor(mult), sizes, make_offsets(sizes))
    np.testing.assert_array_equal(_jit_hash(flash, ngrams), want.numpy().astype(np.int64))


@pytest.mark.parametrize("preset", ["deepseek-v4.1-flash", "tiny-v41"])
def test_device_hash_equals_host_hash_on_every_extreme_combination(preset):
    """Every n-gram over {0, 1, 2^16 − 1, 2^16, V_c − 2, V_c − 1} (limb and carry boundaries of the 16-bit split,
    clipped to the vocabulary), plus random rows, in a ``[B, Q, M]`` step layout."""
    cfg = load_config(preset)
    vc, m = cfg.engram_compressed_vocab_size, cfg.engram_max_ngram_size
    edges = sorted({min(max(v, 0), vc - 1) for v in (0, 1, 2**16 - 1, 2**16, vc - 2, vc - 1)})
    combos = np.array(list(itertools.product(edges, repeat=m)))
    rand = np.random.default_rng(1).integers(0, vc, size=(2048 - len(combos) % 2048, m))
    rows = np.concatenate([combos, rand]).reshape(-1, 64, m)
    np.testing.assert_array_equal(_jit_hash(cfg, rows), engram_hash(cfg, rows))


def test_device_hash_rejects_tables_beyond_its_range():
    cfg = load_config("tiny-v41")
    big = dataclasses.replace(cfg, engram_vocab_size=2**24)  # primes above 2^24: 256·r + 255 would pass 2^32
    with pytest.raises(ValueError, match="32-bit device hash"):
        device_hash(big, jnp.zeros((1, 1, cfg.engram_max_ngram_size), jnp.int32))


def _tables(kind: str):
    if kind == "fp8":  # the release format: E4M3 codes + UE8M0 scales, memory-mapped
        qdir = fixture_dir("v41-tiny-quant")
        cfg = load_config(qdir)
        return cfg, [EngramTable.from_checkpoint(CheckpointFiles(qdir), lid, cfg) for lid in cfg.engram_layer_ids]
    tdir = fixture_dir("v41-tiny")  # HF format: fp32 rows
    cfg = load_config(tdir)
    return cfg, [EngramTable.from_checkpoint(tdir, lid, cfg) for lid in cfg.engram_layer_ids]


@pytest.mark.parametrize("where", ["device", "host", "host-direct"])
@pytest.mark.parametrize("kind", ["fp8", "fp32"])
def test_lookup_equals_the_host_gather(kind, where):
    """Hash + gather + decode inside one jitted program = the host pipeline (numpy hash, ``EngramTable.gather``),
    bit for bit: the FP8 decode is exact in fp32. ``host``: the tables sit in pinned host memory and stay there.
    ``host-direct``: placed as line tables in pinned host memory; on this CPU the kernel's ``jnp`` contract gathers
    them (from a device-memory copy: XLA:CPU computes on device memory), so this checks the line layout, the row
    cut and the bit cast around the kernel (the kernel itself: tests/test_engram_gather_gpu.py)."""
    cfg, tables = _tables(kind)
    assert all(t.quantized == (kind == "fp8") for t in tables)
    placed = place_tables(tables, where)
    kinds = {a.sharding.memory_kind for a in jax.tree.leaves(placed)}
    assert kinds == {"device" if where == "device" else "pinned_host"}
    lookup = EngramLookup(cfg, placement=where)
    if where == "host-direct":
        assert {a.dtype for a in jax.tree.leaves(placed)} == {np.dtype(np.int32)}
        placed = jax.device_put(placed, jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="device"))
        lookup = EngramLookup(cfg, placement=where, line_gather="reference")
    rows = np.random.default_rng(2).integers(0, cfg.engram_compressed_vocab_size,
                                             size=(3, 5, cfg.engram_max_ngram_size))
    got = np.asarray(jax.jit(lookup)(placed, jnp.asarray(rows, jnp.int32)))
    ids = engram_hash(cfg, rows)
    want = np.stack([t.gather(ids[i]).reshape(*rows.shape[:-1], -1) for i, t in enumerate(tables)])
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_engine_steps_have_no_host_callback_and_host_tables_serve():
    """V4.1 engine steps hash and gather in the program: no Python callback in the lowered step for either
    placement (a callback lowers to a custom call naming it), the host placement's step reads pinned host memory,
    and greedy tokens with host tables equal the full forward's argmax (the device placement is the engine
    tests' default, tests/test_engine.py)."""
    model = random_model(load_config("tiny-v41"), seed=3, std=0.1, include_mtp=False)
    buckets = Buckets(decode_batch=(2,), prefill_batch=(2,), prefill_len=(32,), pages=(4,))
    kw = dict(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=32, progress=False, buckets=buckets)
    for where in ("device", "host"):
        llm = LLM(model, engram_tables=where, warmup=False, **kw)
        for decode, shape in ((True, (2, 1, 4)), (False, (2, 32, 4))):
            text = llm.runner._lower_step(shape, decode).as_text()
            assert "callback" not in text.lower(), f"{where}: a host callback in the compiled step"
            assert ('"pinned_host"' in text) == (where == "host")
    llm = LLM(model, engram_tables="host", **kw)
    assert llm.launch_thread   # the host-computation step blocks its launch: launched from a second thread
    compiled = llm.metrics()["compilations"]
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(4, model.config.vocab_size, size=n)] for n in (9, 30)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    seqs = [p + o.token_ids for p, o in zip(prompts, outs, strict=True)]
    S = max(len(s) for s in seqs)
    logits = forward_logits(model, np.array([s + [s[-1]] * (S - len(s)) for s in seqs]))
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        assert o.token_ids == [int(t) for t in logits[i, len(p) - 1: len(p) + 9].argmax(-1)], f"prompt {i}"
    # committed host tables commit the steps' outputs: warm-up must have compiled the committed variants
    assert llm.metrics()["compilations"] == compiled, "compiled outside warm-up"


def test_bad_engram_placement_is_named():
    model = random_model(load_config("tiny-v41"), seed=3, std=0.1, include_mtp=False)
    with pytest.raises(ValueError, match="engram_tables must be one of"):
        LLM(model, engram_tables="mmap", warmup=False, progress=False)
    with pytest.raises(ValueError, match="one-device engine only"):
        LLM(model, engram_tables="host", dp_size=2, warmup=False, progress=False)
    with pytest.raises(ValueError, match="launch_thread=True runs on the one-device engine only"):
        LLM(model, launch_thread=True, dp_size=2, warmup=False, progress=False)
    with pytest.raises(ValueError, match="'host-direct'.*needs a GPU"):   # this CPU: the kernel cannot run
        LLM(model, engram_tables="host-direct", warmup=False, progress=False)
    with pytest.raises(ValueError, match="one-device engine only"):
        LLM(model, engram_tables="host-direct", dp_size=2, warmup=False, progress=False)
    with pytest.raises(ValueError, match="line_gather must be one of"):
        EngramLookup(model.config, placement="host-direct", line_gather="triton")


@pytest.mark.parametrize("where", ["device", "host-direct"])
@pytest.mark.parametrize("kind", ["fp8", "fp32"])
def test_abstract_state_has_the_placed_tables_shapes(kind, where):
    """``abstract_state`` (lowering without tables) describes what ``place_tables`` builds: shapes, dtypes and, for
    line tables, the stored dtypes they stand for."""
    from dinfer_jax.models.engram_lookup import abstract_state

    cfg, tables = _tables(kind)
    placed = place_tables(tables, where)
    abstract = abstract_state(cfg, release_format=kind == "fp8", where=where).tables
    assert jax.tree.structure(abstract) == jax.tree.structure(placed)
    assert [(a.shape, a.dtype) for a in jax.tree.leaves(abstract)] == [(a.shape, a.dtype)
                                                                       for a in jax.tree.leaves(placed)]
