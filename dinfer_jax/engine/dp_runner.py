"""Device side of attention-DP engines: one jitted model step over the whole mesh (then the sampler), each engine's
rows and KV pool on its own devices, the routed experts over the EP group (``docs/dp_engines.md``).
DeepInfer's mechanism: ``docs/spec/engine.md`` §2, §3, §10.

**Layout.** ``dp`` engines of ``cp`` CP ranks make ``dp·cp`` workers (:func:`sharding.layout`). When
``ep > dp·cp`` (DeepInfer has no such layout: its EP groups are blocks of the same workers) the engines'
attention is *replicated*: every engine runs on ``r = ep / (dp·cp)`` copies of its devices, so the mesh has
``ep`` devices, EP spans all of them, and ``ep`` must be a multiple of ``dp·cp``. Anything else that
:func:`sharding.make_mesh` refuses is refused here with its message. The mesh is ``make_mesh(dp·r, cp, ep)``;
mesh DP rank ``m`` (row-major over ``dp_out``, ``dp_ep``) holds engine ``m // r``.

**One step for all engines.** Every array of the step has a leading *engine-copy* dimension of size ``dp·r``,
split over the DP mesh axes, and the step body runs per device under ``jax.shard_map`` over the whole mesh: each
device sees its engine's rows ``[B, Q]``, its engine's cache (the pool of blocks and state slots, replicated over
the engine's CP ranks and its copies) and its EP rank's experts; the MoE layers exchange tokens over the EP axes
(:func:`~dinfer_jax.models.expert_parallel.ep_experts_manual`). All engines therefore run the same program with
the same bucket ``(B, Q, P)`` — the largest any engine needs this step — and an engine with no work runs an
all-padding batch (it writes nowhere), so the EP collectives line up (DeepInfer's DP vote runs a placeholder step
on ranks without work). An idle engine keeps its previous sampled tokens on the device, so its next step can still
read in-flight input tokens from its own last real step.

**CP.** The ``cp`` ranks of an engine hold the same rows. The per-token projections before attention and the
cache writes run replicated over CP, so every CP rank has the complete compressed KV and index keys; in prefill
steps the attention core (the indexer's scores and top-k, each query's window and compressed rows) with the output
projection, and the MoE sublayer, run on each rank's mirrored share of every row (:func:`sharding.cp_split`'s
rule, :mod:`dinfer_jax.models.cp_rows`) and are all-gathered over CP. Splitting the whole layer with the
projected KV all-gathered, as DeepInfer does, is not done. Where an engine has copies (``ep > dp·cp``), and for
decode rows under CP, the MoE tokens are split contiguously over the engine's devices instead
(``cp_rows.group_tokenwise``), so no token's experts run twice in an engine.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dinfer_jax.engine.buckets import Buckets
from dinfer_jax.engine.compile_pool import (
    CompilerOptions,
    CompileTiming,
    LoweringJob,
    compile_programs,
    default_compile_threads,
)
from dinfer_jax.engine.kv_cache import CacheConfig
from dinfer_jax.engine.memory_plan import MemoryPlan, device_memory, temp_bytes
from dinfer_jax.engine.runner import (
    SAMPLER_VARIANTS,
    InFlight,
    _device_forward,
    _device_sample,
    _program_name,
    _sampler_name,
    empty_inputs,
    fill_step_inputs,
    sampler_program_options,
)
from dinfer_jax.engine.scheduler import ScheduledStep
from dinfer_jax.loading import place_host_value
from dinfer_jax.models import Model
from dinfer_jax.models.engram_lookup import EngramLookup
from dinfer_jax.models.eplb import ExpertMap, Placement, initial_placement, rebalance_layers
from dinfer_jax.models.layer_plan import StackedLayers, plan_layers, stack_params
from dinfer_jax.models.moe import EP_IMPLS
from dinfer_jax.models.step_state import StepInput, cache_shapes
from dinfer_jax.progress import PhaseProgress
from dinfer_jax.sampling import SamplingTensors
from sharding.layout import layout
from sharding.mesh import GROUP_AXES, make_mesh, mesh_shape
from sharding.rules import Sharder

__all__ = ["DPModelRunner", "DPStepOutput", "ParallelLayout", "engine_mesh", "engine_sharder", "parallel_layout"]


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """``dp`` engines of ``cp`` CP ranks, EP over ``ep`` devices; every engine on ``replicas`` copies of its
    devices (``replicas > 1`` only when ``ep > dp·cp``). ``devices = dp·cp·replicas``."""

    dp: int
    cp: int
    ep: int
    replicas: int

    @property
    def devices(self) -> int:
        return self.dp * self.cp * self.replicas

    @property
    def engine_copies(self) -> int:
        """Size of the leading dimension of every step array (the DP mesh size): ``dp · replicas``."""
        return self.dp * self.replicas


def parallel_layout(dp: int, cp: int, ep: int, num_devices: int | None = None) -> ParallelLayout:
    """Validate ``(dp, cp, ep)`` for the engine. Rules (each violation is a ValueError naming it):

    * every size an integer ≥ 1;
    * ``ep ≤ dp·cp``: DeepInfer's rules — ``ep`` divides ``dp·cp`` (EP groups are blocks of the workers) and one of
      ``cp``, ``ep`` divides the other (an EP group is whole engines or a slice of one engine's CP ranks);
    * ``ep > dp·cp``: ``ep`` is a multiple of ``dp·cp``; each engine is replicated ``ep / (dp·cp)`` times;
    * the devices needed (``max(dp·cp, ep)``) exist.
    """
    for name, v in (("dp_size", dp), ("cp_size", cp), ("ep_size", ep)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    world = dp * cp
    if ep > world:
        if ep % world:
            raise ValueError(f"ep_size={ep} > dp_size·cp_size = {world}: ep must then be a multiple of dp·cp (each "
                             f"engine's attention is replicated ep/(dp·cp) times so that EP spans whole copies)")
        replicas = ep // world
    else:
        layout(dp, cp, ep)  # ep divides dp·cp
        mesh_shape(dp, cp, ep)  # cp | ep or ep | cp
        replicas = 1
    out = ParallelLayout(dp, cp, ep, replicas)
    n = len(jax.devices()) if num_devices is None else num_devices
    if out.devices > n:
        raise ValueError(f"dp_size={dp} cp_size={cp} ep_size={ep} needs max(dp·cp, ep) = {out.devices} devices, "
                         f"{n} available")
    return out


@dataclasses.dataclass
class DPStepOutput:
    """Device futures of one step of all engines: ``steps[e]`` is engine ``e``'s step (None: it ran padding);
    ``tokens [dp·r, max_rows]``."""

    steps: list[ScheduledStep | None]
    tokens: jax.Array
    logprobs: Any
    replicas: int
    dispatched_at: float
    shape: tuple[int, int, int] = (0, 0, 0)

    @property
    def kind(self) -> str:
        return next(s.kind for s in self.steps if s is not None)

    def engine_index(self, e: int) -> int:
        """Row of the leading dimension that holds engine ``e`` (its first copy)."""
        return e * self.replicas


def engine_mesh(lay: ParallelLayout, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The mesh the engines of ``lay`` run on: ``make_mesh(dp·replicas, cp, ep)`` over the first of ``devices``
    (default ``jax.devices()``); mesh DP rank ``m`` holds engine ``m // replicas``."""
    return make_mesh(lay.dp * lay.replicas, lay.cp, lay.ep, devices)


def engine_sharder(lay: ParallelLayout, devices: Sequence[jax.Device] | None = None) -> Sharder:
    """A :class:`~sharding.rules.Sharder` over :func:`engine_mesh` with the default rules, which place parameters
    as :class:`DPModelRunner` keeps them (routed experts split over the EP axes, the rest replicated): a
    checkpoint loaded with it (``load_model(..., sharder=, stacked=True)``) goes from the host straight to its
    shards, and the runner's placement of it moves nothing."""
    return Sharder(engine_mesh(lay, devices))


def _is_expert_leaf(path: tuple[Any, ...]) -> bool:
    return any(isinstance(k, jax.tree_util.DictKey) and k.key == "experts" for k in path)


def _first_slots(cfg: Any, layers: StackedLayers) -> list[np.ndarray]:
    """Per backbone layer, the slot holding replica 0 of each logical expert ``[E]``: from the layer's
    ``ffn["expert_map"]`` when it is placed already, else ``arange(E)`` (experts in logical order)."""
    E = cfg.n_routed_experts
    out: list[np.ndarray] = [np.arange(E)] * cfg.num_layers
    for g, group in zip(plan_layers(cfg), layers.groups, strict=True):
        for j, tree in enumerate(group):
            emap = tree["ffn"].get("expert_map")
            if emap is None:
                continue
            first = np.asarray(emap.logical_to_physical)[..., 0]        # [repeats, E]
            for r in range(g.repeats):
                out[g.layer(r, j)] = first[r]
    return out


def _replacement_tables(cfg: Any, first_slots: Sequence[np.ndarray], new: Sequence[Placement]) -> StackedLayers:
    """Per stacked layer (scan layout, as ``params["layers"]``): ``(src [repeats, P], logical_to_physical
    [repeats, E, R+1], logical_count [repeats, E])`` int32, where ``src[r, p]`` is the slot that now holds the
    expert the new placement puts in slot ``p``: ``first_slots[l] [E]``, layer ``l``'s slot of each logical
    expert (the current placement's replica 0; ``arange(E)`` for layers in logical order, not yet placed)."""
    groups = []
    for g in plan_layers(cfg):
        per_pos = []
        for j in range(g.period):
            layers = [g.layer(r, j) for r in range(g.repeats)]
            src = np.stack([np.asarray(first_slots[i])[new[i].physical_to_logical] for i in layers])
            l2p = np.stack([new[i].logical_to_physical for i in layers])
            cnt = np.stack([new[i].logical_count for i in layers])
            per_pos.append(tuple(a.astype(np.int32) for a in (src, l2p, cnt)))
        groups.append(tuple(per_pos))
    return StackedLayers(tuple(groups))


def _moved_experts(experts: tuple, tables: StackedLayers) -> tuple:
    """Per stacked layer of :func:`_routed_experts`' tuple: ``(experts, ExpertMap)`` with the experts gathered into
    their new slots (:func:`_replacement_tables`) and the new expert map.

    The repeats are gathered one after another (``lax.map``), not batched: a gather along the EP-split expert axis
    all-gathers its operand on every device, and batched over the repeats that operand is the whole stacked leaf
    (every layer's experts of the group on each device at once; one layer's at a time here — compiled temporary
    memory checked in tests/test_dp_engines.py)."""
    def take(a: jax.Array, idx: jax.Array) -> jax.Array:
        return jax.lax.map(lambda pair: jnp.take(pair[0], pair[1], axis=0), (a, idx))

    return tuple(tuple((jax.tree.map(lambda a, src=src: take(a, src), e), ExpertMap(l2p, cnt))
                       for e, (src, l2p, cnt) in zip(group, group_tables, strict=True))
                 for group, group_tables in zip(experts, tables.groups, strict=True))


def _routed_experts(layers: StackedLayers) -> tuple:
    """The routed-expert weights of every stacked layer, ``groups[g][j] = ffn["experts"]``."""
    return tuple(tuple(tree["ffn"]["experts"] for tree in group) for group in layers.groups)


def _with_experts(layers: StackedLayers, moved: tuple) -> StackedLayers:
    """``layers`` with each stacked layer's experts and expert map from :func:`_moved_experts`."""
    return StackedLayers(tuple(
        tuple({**tree, "ffn": {**tree["ffn"], "experts": e, "expert_map": emap}}
              for tree, (e, emap) in zip(group, moved_group, strict=True))
        for group, moved_group in zip(layers.groups, moved, strict=True)))


def _move_experts(layers: StackedLayers, tables: StackedLayers) -> StackedLayers:
    """Stacked layers with every layer's experts gathered into its new slots and its expert map replaced
    (:func:`_replacement_tables`); jitted by :class:`DPModelRunner` with the parameters' shardings."""
    return _with_experts(layers, _moved_experts(_routed_experts(layers), tables))


class DPModelRunner:
    """Owns the mesh, the engines' caches and the compiled whole-mesh steps (see the module docstring)."""

    def __init__(self, model: Model, cache_config: CacheConfig, max_model_len: int, buckets: Buckets,
                 lay: ParallelLayout, max_logprobs: int = 0, devices: Sequence[jax.Device] | None = None,
                 num_redundant_experts: int | None = None, compiler_options: CompilerOptions = (),
                 donate_params: bool = False):
        """``donate_params``: the runner may free ``model``'s weights once it has its own placement of them (the
        engine built the Model itself; ``self.model`` then holds the runner's weights)."""
        self.model = model
        self.cfg = model.config
        self.layout = lay
        self.cache_config = cache_config
        self.max_pages = math.ceil(max_model_len / cache_config.block_size)
        self.buckets = buckets.resolve(self.max_pages, cache_config.block_size)
        self.max_rows = max(max(buckets.decode_batch), max(buckets.prefill_batch))
        self.max_logprobs = max_logprobs
        self.mesh: Mesh = engine_mesh(lay, devices)
        self._copies_spec = _axes_spec(self.mesh, "dp")
        self._copies = NamedSharding(self.mesh, self._copies_spec)
        self._replicated = NamedSharding(self.mesh, PartitionSpec())
        # Several processes (jax.distributed): every process holds the same host values (same checkpoint or seed,
        # same requests, same scheduler decisions) and places them on the global mesh; a process reads the step's
        # outputs from a replicated copy (``host_replicated``), the only arrays it must see whole.
        self.multi_process = jax.process_count() > 1
        # EPLB (ep > 1 and num_redundant_experts given): every layer's experts in the physical slots of its
        # placement, DeepInfer's start-up layout first; rebalance() moves them (same shapes: nothing recompiles).
        self.placements: list[Placement] | None = None
        if num_redundant_experts is not None and lay.ep < 2:
            raise ValueError("num_redundant_experts (EPLB) needs expert parallelism: ep_size > 1")
        # The weights go to the mesh without passing through one device: host values are stacked on the host and
        # placed shard by shard; a Model loaded onto this mesh in scan layout (LLM does, engine_sharder) is already
        # where it belongs, and device_put leaves it there.
        params = model.params
        host = all(isinstance(x, np.ndarray) for x in jax.tree_util.tree_leaves(params))
        self._set_params(stack_params(self.cfg, params, on_host=host))
        # every placement and load copy done before the first program with collectives (the expert move, then the
        # steps): with several processes on XLA:CPU, collectives dispatched behind many in-flight copies have
        # deadlocked before (the rebalance note in docs/dp_engines.md)
        jax.block_until_ready(self.params)
        if num_redundant_experts is not None:
            E = self.cfg.n_routed_experts
            placements = [initial_placement(E, num_redundant_experts, lay.ep)] * self.cfg.num_layers
            self._place_experts(placements, donate=donate_params or host)   # host values: the copies are ours
        self.model = dataclasses.replace(model, params=self.params)
        if lay.ep > 1:
            moe_impl, ep_manual = model.moe_impl if model.moe_impl in EP_IMPLS else "ep", lay.ep
        else:
            moe_impl, ep_manual = ("ragged" if model.moe_impl in EP_IMPLS else model.moe_impl), 0
        self.moe_impl = moe_impl
        # Caches: every leaf gets a leading engine-copy dimension split over the DP mesh axes.
        self.cache = self._empty_cache(cache_config)
        engram = lookup = None
        if self.cfg.engram_layer_ids:  # tables replicated in every device's memory (the lookup runs per device)
            engram = model.engram.state("device", self._replicated)
            lookup = EngramLookup(self.cfg)
        self._engram = engram
        count = self.placements is not None
        forward_fn = functools.partial(_device_forward, cfg=self.cfg, dtype=model.dtype, moe_impl=moe_impl,
                                       engram_fn=lookup, ep_manual=ep_manual, cp_manual=lay.cp if lay.cp > 1 else 0,
                                       copies_manual=lay.replicas, count_experts=count, mhc_impl=model.mhc_impl,
                                       linear_impl=model.linear_impl, attention_impl=model.attention_impl)
        # A step is two programs, as in the one-device engine: the model over the mesh, then the sampler (its
        # variant decided on the host from every engine's rows, runner.SAMPLER_VARIANTS), whose data-dependent
        # conditionals would otherwise block the host on a GPU (runner.GPU_SAMPLER_OPTIONS).
        self._forward = jax.jit(functools.partial(_mesh_forward, forward_fn=forward_fn, mesh=self.mesh,
                                                  param_specs=self._param_specs, copies=self._copies_spec,
                                                  replicas=lay.replicas),
                                donate_argnums=(1, 6), compiler_options=dict(compiler_options) or None)
        sampler_options = sampler_program_options(compiler_options, jax.default_backend())
        self._sample = jax.jit(functools.partial(_mesh_sample, mesh=self.mesh, copies=self._copies_spec,
                                                 max_rows=self.max_rows, host_replicated=self.multi_process),
                               compiler_options=dict(sampler_options) or None)
        # EPLB: tokens per (layer, logical expert) since the engine started or last rebalanced, summed on the device
        self._loads = (jax.device_put(np.zeros((self.cfg.num_layers, self.cfg.n_routed_experts), np.int32),
                                      self._replicated) if count else None)
        self._prev_tokens = jax.device_put(np.zeros((lay.engine_copies, self.max_rows), np.int32), self._copies)
        self._prev_step_id: list[int | None] = [None] * lay.dp
        self.compiled_shapes: set[tuple[int, int, int]] = set()
        self.compiled_samplers: set[tuple[int, bool, bool]] = set()  # (batch, use_filters, all_greedy)
        self.num_compilations = 0
        self.warmup_timings: tuple[CompileTiming, ...] = ()  # per program of the last threaded warm-up

    def _empty_cache(self, cache_config: CacheConfig) -> Any:
        """Every engine's empty pool and state slots of ``cache_config``: each cache leaf with a leading
        engine-copy dimension split over the DP mesh axes."""
        copies = self.layout.engine_copies
        shapes = cache_shapes(self.cfg, cache_config, self.model.dtype)
        return jax.jit(lambda: jax.tree.map(lambda s: jnp.zeros((copies, *s.shape), s.dtype), shapes),
                       out_shardings=self._copies)()

    def resize_cache(self, cache_config: CacheConfig) -> None:
        """Replace the engines' (empty) caches by ones of ``cache_config`` — after :meth:`plan_memory`, before
        warm-up and serving (each compiled step is for one pool size)."""
        for leaf in jax.tree_util.tree_leaves(self.cache):
            leaf.delete()
        self.cache_config = cache_config
        self.cache = self._empty_cache(cache_config)

    def plan_memory(self, shapes: Sequence[tuple[int, int, int]], utilization: float,
                    device_memory_bytes: int | None = None) -> MemoryPlan | None:
        """The KV budget of each engine, per device (an engine's pool is whole on each of its devices): what a
        device offers (its ``bytes_limit``, the smallest over this process's mesh devices, or
        ``device_memory_bytes``) times ``utilization``, less what the fullest device holds (its ``bytes_in_use``;
        where the backend reports none, the largest per-device bytes of the placed weights and Engram tables),
        less the mesh step's temporary bytes per device for each of ``shapes`` (compiled against the current,
        minimal caches: XLA's memory analysis of the SPMD program). None when the devices report no memory and
        ``device_memory_bytes`` is not given. With several processes every process must plan alike, so the
        weights' bytes are computed from their shardings there (the same in every process), not read."""
        local = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
        stats = [device_memory(d) for d in local]
        limits = [lim for lim, _ in stats if lim is not None]
        limit = device_memory_bytes or (min(limits) if limits else None)
        if limit is None:
            return None
        used = [u for _, u in stats if u is not None]
        if used and not self.multi_process:
            in_use = max(used)
        else:
            in_use = _bytes_per_device((self.params, self._engram))
        # the sampler runs after the model (its own program): a step's peak is the larger of the two; the variant
        # that filters and draws is the larger sampler
        samplers = {b: temp_bytes(self._lower_sampler(b, True, False).compile()) for b in {s[0] for s in shapes}}
        by_shape = {tuple(s): max(temp_bytes(self._lower_forward(tuple(s)).compile()), samplers[s[0]])
                    for s in shapes}
        return MemoryPlan(device_bytes=int(limit), in_use_bytes=int(in_use), activation_bytes=max(by_shape.values()),
                          activation_by_shape=by_shape, utilization=float(utilization)).check()

    def _specs(self, stacked: Any) -> Any:
        """PartitionSpecs of stacked parameters on the mesh: routed experts (physical slots when placed) split over
        the EP axes (stacked layout ``[repeats, P, ...]``), everything else (expert maps included) replicated."""
        ep_spec = PartitionSpec(None, *_axes_spec(self.mesh, "ep"))
        return jax.tree_util.tree_map_with_path(
            lambda path, _: ep_spec if _is_expert_leaf(path) else PartitionSpec(), stacked)

    def _set_params(self, stacked: Any) -> None:
        """Place stacked parameters on the mesh by :meth:`_specs` (arrays already placed so stay as they are)."""
        self._param_specs = self._specs(stacked)
        shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), self._param_specs)
        if self.multi_process:
            # host values, or arrays local to this process, are identical host copies in every process: each
            # process fills its own devices' shards from its copy (no cross-process transfer or equality check)
            self.params = jax.tree.map(
                lambda x, s: jax.device_put(x, s) if isinstance(x, jax.Array) and not x.is_fully_addressable
                else place_host_value(np.asarray(x), s), stacked, shardings)
        else:
            self.params = jax.device_put(stacked, shardings)
        self._replace_experts = jax.jit(_move_experts, out_shardings=shardings["layers"], donate_argnums=0)

    def _place_experts(self, placements: list[Placement], donate: bool) -> None:
        """EPLB's start: every layer's routed experts gathered into ``placements``' physical slots on the mesh, in
        scan layout (one compiled program, as :meth:`rebalance`; the layers are never unstacked), the expert maps
        set. ``donate``: the unplaced experts are freed as they are consumed (else the caller's Model keeps them)."""
        layers = self.params["layers"]
        tables = jax.device_put(_replacement_tables(self.cfg, _first_slots(self.cfg, layers), placements),
                                self._replicated)
        experts = _routed_experts(layers)
        # only the experts go through the program (the other weights are not copied); the physical slots outnumber
        # the logical experts, so no input buffer could be reused: they are freed afterwards instead of donated.
        # Out: every expert leaf split over the EP axes as before (its slot count changes, not its spec), maps
        # replicated.
        emap = ExpertMap(self._replicated, self._replicated)
        out_shardings = jax.tree.map(lambda e: (jax.tree.map(lambda a: a.sharding, e), emap), experts,
                                     is_leaf=lambda x: isinstance(x, dict))
        moved = jax.jit(_moved_experts, out_shardings=out_shardings)(experts, tables)
        if donate:
            for a in jax.tree_util.tree_leaves(experts):
                a.delete()
        self._set_params({**self.params, "layers": _with_experts(layers, moved)})
        self.placements = placements

    def expert_loads(self) -> np.ndarray:
        """Tokens routed to each (layer, logical expert) ``[L, E]`` int64 since the engine started or last
        rebalanced (waits for the steps in flight)."""
        if self._loads is None:
            raise ValueError("this engine counts no expert loads: create it with num_redundant_experts")
        return np.asarray(self._loads).astype(np.int64)

    def take_expert_loads(self) -> np.ndarray:
        """Tokens routed to each (layer, logical expert) ``[L, E]`` int64 since the engine started or last
        rebalanced (real tokens of every engine; prefill and decode), and reset the count. Waits for the steps
        in flight."""
        loads = self.expert_loads()
        self._loads = jax.device_put(np.zeros(loads.shape, np.int32), self._replicated)
        return loads

    def rebalance(self, tokens_per_expert: Any) -> list[Placement]:
        """EPLB rebalance: new placements from per-layer expert loads ``tokens_per_expert`` (``[layers, E]`` or
        ``[steps, layers, E]`` token counts; :func:`~dinfer_jax.models.eplb.rebalance_layers`), experts moved into
        them. Outputs do not change (tokens go to a replica of the same expert, computed the same way) and nothing
        recompiles (same shapes). Steps already dispatched keep the weights they were launched with. Returns the
        new placements."""
        if self.placements is None:
            raise ValueError("this engine has no EPLB placements: create it with num_redundant_experts")
        loads = np.asarray(tokens_per_expert)
        if loads.ndim == 2:
            loads = loads[None]
        if loads.shape[1:] != (self.cfg.num_layers, self.cfg.n_routed_experts):
            raise ValueError(f"tokens_per_expert must be [layers={self.cfg.num_layers}, E={self.cfg.n_routed_experts}]"
                             f" (or [steps, layers, E]), got shape {np.shape(tokens_per_expert)}")
        placements = list(rebalance_layers(loads, self.placements[0].num_redundant, self.layout.ep))
        # One compiled program moves every layer's experts (same shapes each time: compiled once). Dispatching the
        # move as many small eager ops on mesh-wide arrays deadlocked two processes (XLA CPU: a device's share of
        # one op waited for an in-flight slot that later ops held, while the other devices sat in its all-reduce).
        first = [p.logical_to_physical[:, 0] for p in self.placements]
        tables = jax.device_put(_replacement_tables(self.cfg, first, placements), self._replicated)
        self.params = {**self.params, "layers": self._replace_experts(self.params["layers"], tables)}
        self.placements = placements
        return placements

    # ------------------------------------------------------------------ compile
    def warmup(self, progress: bool = False, compile_threads: int | None = None, staged: bool | None = None) -> float:
        """Compile every bucket, then run each with all engines idle (writes nothing). Returns seconds spent. As
        :meth:`ModelRunner.warmup <dinfer_jax.engine.runner.ModelRunner.warmup>`: on ``compile_threads`` threads
        (default :func:`default_compile_threads`) the programs are lowered one after another and each compiled as
        soon as it is lowered (:func:`lower_then_compile`), one program of each ``(rows, tokens)`` shape first,
        ``staged`` (default :func:`default_staged`: on a GPU) holding a shape's other page widths behind its first
        compile; per-program times in :attr:`warmup_timings`. 1 thread (always, with several processes) compiles
        each bucket by running it, one after another."""
        t0 = time.perf_counter()
        shapes = list(self.buckets.shapes())
        n_decode = len(self.buckets.decode_shapes())  # shapes() lists decode first
        samplers = [(b, *variant) for b in sorted({b for b, _, _ in shapes}) for variant in SAMPLER_VARIANTS]
        threads = default_compile_threads() if compile_threads is None else compile_threads
        if self.multi_process:
            # the processes must build their programs in one order: out-of-order compiles paired mismatched
            # collectives across processes (gloo on CPU: "Received data size doesn't match expected size")
            threads = 1
        with PhaseProgress("compile buckets", len(shapes) + len(samplers), enabled=progress) as bar:
            if threads > 1:
                jobs = [LoweringJob(_program_name(s, i < n_decode, False), functools.partial(self._lower_forward, s),
                                    s[:2]) for i, s in enumerate(shapes)]
                tail = [LoweringJob(_sampler_name(*smp), functools.partial(self._lower_sampler, *smp), smp)
                        for smp in samplers]
                self.warmup_timings = tuple(compile_programs(jobs, threads, staged, tail=tail, on_done=bar.advance))
            for shape in shapes:
                self._run(*self._idle(), shape).tokens.block_until_ready()
                if threads <= 1:
                    bar.advance()
            for smp in samplers:
                self._sample_step(*self._sampler_args(*smp))[0].block_until_ready()
                if threads <= 1:
                    bar.advance()
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ dispatch
    def bucket(self, steps: Sequence[ScheduledStep | None]) -> tuple[int, int, int]:
        """The bucket every engine runs this step in: the smallest covering every engine's rows (the DP vote on
        the shape). All non-None steps must be of one kind."""
        real = [s for s in steps if s is not None]
        kinds = {s.kind for s in real}
        if len(kinds) != 1:
            raise ValueError(f"one mesh step runs one step kind, got {sorted(kinds)}")
        rows = max(len(s.rows) for s in real)
        if kinds == {"decode"}:
            b, q = Buckets.pick(self.buckets.decode_batch, rows, "decode batch"), 1
        else:
            b = Buckets.pick(self.buckets.prefill_batch, rows, "prefill batch")
            q = Buckets.pick(self.buckets.prefill_len, max(r.num_tokens for s in real for r in s.rows),
                             "prefill chunk")
        bs = self.cache_config.block_size
        p = self.buckets.pages_for((r.start_pos + r.num_tokens for s in real for r in s.rows), bs)
        return b, q, p

    def dispatch(self, steps: Sequence[ScheduledStep | None], params: Sequence[list[Any]],
                 seeds: Sequence[list[int]]) -> DPStepOutput:
        """Launch one step of every engine (``steps[e]`` None: engine ``e`` runs padding). ``params[e]`` /
        ``seeds[e]``: one per row of ``steps[e]``."""
        return self._run(list(steps), params, seeds, self.bucket(steps))

    def _run(self, steps: list[ScheduledStep | None], params: Sequence[list[Any]], seeds: Sequence[list[int]],
             shape: tuple[int, int, int]) -> DPStepOutput:
        self.compiled_shapes.add(shape)
        (inp, feed, active), samp = self._step_args(steps, params, seeds, shape)
        logits, self.cache, self._loads = self._forward(*self._forward_args(inp, feed))
        toks, logprobs, host_view = self._sample_step(logits, samp, active, self._prev_tokens)
        self._prev_tokens = toks
        for e, step in enumerate(steps):
            if step is not None:
                self._prev_step_id[e] = step.step_id
        if host_view is not None:
            toks, logprobs = host_view
        return DPStepOutput(steps, toks, logprobs, self.layout.replicas, time.perf_counter(), shape)

    def _sample_step(self, logits: jax.Array, samp: Any, active: jax.Array, prev: jax.Array) -> tuple[Any, ...]:
        self.compiled_samplers.add((logits.shape[1], samp.use_filters, samp.all_greedy))
        out = self._sample(logits, samp, active, prev)
        sizes = [getattr(f, "_cache_size", None) for f in (self._forward, self._sample)]
        self.num_compilations = (sum(f() for f in sizes) if all(callable(f) for f in sizes)
                                 else len(self.compiled_shapes) + len(self.compiled_samplers))
        return out

    def _idle(self) -> tuple[list[None], list[list[Any]], list[list[int]]]:
        """``(steps, params, seeds)`` of a mesh step in which every engine runs padding."""
        dp = self.layout.dp
        return [None] * dp, [[]] * dp, [[]] * dp

    def _lower_forward(self, shape: tuple[int, int, int]) -> Any:
        """The model program of bucket ``shape`` lowered on an all-padding step (warm-up, memory planning)."""
        (inp, feed, _), _ = self._step_args(*self._idle(), shape)
        return self._forward.lower(*self._forward_args(inp, feed))

    def _lower_sampler(self, b: int, use_filters: bool, all_greedy: bool) -> Any:
        """The sampler program of batch ``b`` and one variant, lowered (warm-up, memory planning)."""
        return self._sample.lower(*self._sampler_args(b, use_filters, all_greedy))

    def _forward_args(self, inp: StepInput, feed: InFlight) -> tuple[Any, ...]:
        return self.params, self.cache, inp, feed, self._prev_tokens, self._engram, self._loads

    def _step_args(self, steps: list[ScheduledStep | None], params: Sequence[list[Any]],
                   seeds: Sequence[list[int]], shape: tuple[int, int, int]) -> tuple[tuple[Any, ...], Any]:
        """Every engine's step (None: padding) in bucket ``shape`` on the mesh: ``((inputs, in-flight feed,
        active engines), sampling tensors)``. The sampler variant (``use_filters`` / ``all_greedy``) is one for all
        engines, decided from every engine's rows."""
        b, q, p = shape
        bs = self.cache_config.block_size
        greedy = all(sp.greedy for rows in params for sp in rows)
        inps, feeds, samps, active = [], [], [], []
        for e, step in enumerate(steps):
            if step is None:
                inp, feed = empty_inputs(b, q, p)
                rows = []
            else:
                inp, feed = fill_step_inputs(step, b, q, p, bs, self._prev_step_id[e])
                rows = step.rows
            samps.append(SamplingTensors.from_params(params[e], seeds[e], [r.end_pos for r in rows], pad_to=b,
                                                     num_top_logprobs=self.max_logprobs, use_filters=not greedy,
                                                     all_greedy=greedy))
            inps.append(inp)
            feeds.append(feed)
            active.append(step is not None)
        host = (StepInput(**jax.tree.map(self._stack, *inps)), InFlight(**jax.tree.map(self._stack, *feeds)),
                self._stack(*active))
        return jax.device_put(host, self._copies), jax.device_put(jax.tree.map(self._stack, *samps), self._copies)

    def _stack(self, *xs: Any) -> np.ndarray:
        """Per-engine host values → the engine-copy dimension: engine ``e`` at rows ``e·r … e·r + r − 1``."""
        r = self.layout.replicas
        return np.stack([np.asarray(x) for x in xs for _ in range(r)])

    def _sampler_args(self, b: int, use_filters: bool, all_greedy: bool) -> tuple[Any, ...]:
        """Arguments of the sampler program for batch ``b`` and one variant, every engine idle (warm-up)."""
        copies = self.layout.engine_copies
        logits = jax.device_put(np.zeros((copies, b, self.cfg.vocab_size), np.float32), self._copies)
        samp = SamplingTensors.from_params([], [], [], pad_to=b, num_top_logprobs=self.max_logprobs,
                                           use_filters=use_filters, all_greedy=all_greedy)
        samp = jax.device_put(jax.tree.map(lambda x: self._stack(*[x] * self.layout.dp), samp), self._copies)
        active = jax.device_put(np.zeros((copies,), bool), self._copies)
        return logits, samp, active, self._prev_tokens


def _bytes_per_device(tree: Any) -> int:
    """The most bytes any one of this process's devices holds of the arrays in ``tree`` (their shards on it;
    evenly split or replicated arrays put the same on every device of the mesh, so other processes' are alike)."""
    per_device: dict[Any, int] = {}
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, jax.Array):
            for shard in leaf.addressable_shards:
                per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values(), default=0)


def _axes_spec(mesh: Mesh, kind: str) -> PartitionSpec:
    """A one-dimension PartitionSpec over ``kind``'s mesh axes of size > 1 (as XLA reports output shardings, so
    that a step's outputs fed back in hit the same compiled program)."""
    axes = tuple(a for a in GROUP_AXES[kind] if mesh.shape[a] > 1)
    if not axes:
        return PartitionSpec()
    return PartitionSpec(axes[0] if len(axes) == 1 else axes)


def _mesh_forward(params: Any, cache: Any, inp: StepInput, feed: InFlight, prev_tokens: jax.Array, engram: Any,
                  loads: jax.Array | None, *, forward_fn: Any, mesh: Mesh, param_specs: Any, copies: PartitionSpec,
                  replicas: int):
    """All engines' model step: ``forward_fn`` (:func:`~dinfer_jax.engine.runner._device_forward`) per device under
    ``shard_map``; every argument but ``params`` / ``engram`` / ``loads`` has the leading engine-copy dimension.
    Returns ``(logits [copies, B, V] f32, cache, loads)``: ``loads`` (EPLB engines, else None) is the ``[L, E]``
    accumulator plus this step's tokens per expert over all engines."""
    count = loads is not None

    def body(params, cache, inp, feed, prev, engram):
        local = functools.partial(jax.tree.map, lambda x: x[0])
        cache, inp, feed, prev = local((cache, inp, feed, prev))
        out = forward_fn(params, cache, inp, feed, prev, engram)
        logits, cache = out[:2]
        step_loads = out[2] if count else jnp.zeros((), jnp.int32)
        return jax.tree.map(lambda x: x[None], (logits, cache, step_loads))

    # check_vma=False: the CP ranks (and replicas) of an engine compute the same values; the outputs take one copy.
    fn = jax.shard_map(body, mesh=mesh, in_specs=(param_specs, copies, copies, copies, copies, PartitionSpec()),
                       out_specs=(copies, copies, copies), check_vma=False)
    logits, cache, step_loads = fn(params, cache, inp, feed, prev_tokens, engram)
    if count:  # one row per engine copy: count each engine once (copy 0 of its `replicas`)
        loads = loads + step_loads[::replicas].sum(axis=0)
    return logits, cache, loads


def _mesh_sample(logits: jax.Array, samp: Any, active: jax.Array, prev_tokens: jax.Array, *, mesh: Mesh,
                 copies: PartitionSpec, max_rows: int, host_replicated: bool = False):
    """All engines' sampler (:func:`~dinfer_jax.engine.runner._device_sample`) per device under ``shard_map``, on
    ``logits [copies, B, V]``. Returns ``(tokens [copies, max_rows], logprobs, host_view)``: an idle engine keeps
    its previous tokens (``prev_tokens``), so its next step can still read in-flight inputs from its last real
    step; ``host_view`` is ``(tokens, logprobs)`` replicated on every device when ``host_replicated`` (several
    processes: each must read every engine's tokens), else None."""

    def body(logits, samp, active, prev):
        local = functools.partial(jax.tree.map, lambda x: x[0])
        logits, samp, active, prev = local((logits, samp, active, prev))
        toks, logprobs = _device_sample(logits, samp, max_rows=max_rows)
        toks = jnp.where(active, toks, prev)
        return jax.tree.map(lambda x: x[None], (toks, logprobs))

    fn = jax.shard_map(body, mesh=mesh, in_specs=(copies, copies, copies, copies), out_specs=(copies, copies),
                       check_vma=False)
    toks, logprobs = fn(logits, samp, active, prev_tokens)
    host_view = None
    if host_replicated:
        host_view = jax.lax.with_sharding_constraint((toks, logprobs), NamedSharding(mesh, PartitionSpec()))
    return toks, logprobs, host_view
