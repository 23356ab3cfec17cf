"""Random parameters built on the device with ``jax.random``, quantised weights directly in their released format.

For real-dimension experiments (a V4-Flash slice is tens of GB): nothing is generated on the host, each parameter
is one small jitted program (cached per shape/recipe) whose output lands on the device, sharded when a sharder is
given. Distributions follow :func:`~dinfer_jax.models.params.init_params` (matrices ~ N(0, std²), norms ~ 1 + N(0,
0.1²), biases/sinks ~ N(0, 0.5²) or N(0, 0.1²), ``tid2eid`` k distinct experts per token); the draws differ.

Quantised weights, chosen so the dequantised standard deviation is close to ``std`` and no path is all-zero:

* FP8: per 2-D block a power-of-two scale ``2^e`` with ``e`` drawn from ``{k-1, k}``, ``2^k`` the power of two with
  ``std / 2^k`` in [16, 32); codes = e4m3(N(0, std²) / scale), so |code| stays far below the e4m3 maximum 448.
* FP4: uniformly random bytes (every e2m1 code equally likely: E[v²] = 68.5/8) and UE8M0 scales ``2^e``, ``e`` from
  ``{k-1, k}`` per 1×32 block, with ``k = round(log2(std / 2.31))`` (2.31 = sqrt(8.5625 · (1/4 + 1)/2)).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from dinfer_jax.models.config import ModelConfig
from dinfer_jax.models.params import ParamSpec, map_specs, param_specs
from dinfer_jax.models.qweights import QuantizedWeight, expand_scale, expected_scale_shape
from sharding.rules import Sharder

_FP4_RMS_PER_UNIT_SCALE = math.sqrt(68.5 / 8 * (0.25 + 1.0) / 2)


def _scale_exponents(key: jax.Array, shape: tuple[int, ...], k: int) -> jax.Array:
    """Random exponents in {k-1, k} as float8_e8m0fnu powers of two."""
    e = k - jax.random.bernoulli(key, 0.5, shape).astype(jnp.int32)
    return jnp.exp2(e.astype(jnp.float32)).astype(jnp.float8_e8m0fnu)


def _random_fp8(key: jax.Array, shape: tuple[int, ...], block: tuple[int, int], std: float) -> QuantizedWeight:
    k_scale, k_val = jax.random.split(key)
    k = math.floor(math.log2(std / 16.0))
    scale = _scale_exponents(k_scale, expected_scale_shape("fp8", shape, block), k)
    placeholder = QuantizedWeight(jnp.zeros(shape, jnp.float8_e4m3fn), scale, "fp8", block)
    x = std * jax.random.normal(k_val, shape, jnp.float32) / expand_scale(placeholder)
    return QuantizedWeight(jnp.clip(x, -448.0, 448.0).astype(jnp.float8_e4m3fn), scale, "fp8", block)


def _random_fp4(key: jax.Array, shape: tuple[int, ...], block: tuple[int, int], std: float) -> QuantizedWeight:
    k_scale, k_val = jax.random.split(key)
    dshape = (*shape[:-1], shape[-1] // 2)
    k = round(math.log2(std / _FP4_RMS_PER_UNIT_SCALE))
    scale = _scale_exponents(k_scale, expected_scale_shape("fp4", dshape, block), k)
    return QuantizedWeight(jax.random.bits(k_val, dshape, jnp.uint8), scale, "fp4", block)


def _value(key: jax.Array, recipe: tuple) -> Any:
    kind, shape, dtype, extra = recipe
    if kind == "fp8":
        return _random_fp8(key, shape, extra[0], extra[1])
    if kind == "fp4":
        return _random_fp4(key, shape, extra[0], extra[1])
    if kind == "tid2eid":
        n_experts, k = extra
        return jnp.argsort(jax.random.uniform(key, (shape[0], n_experts)), axis=1)[:, :k].astype(dtype)
    if kind == "zeros":
        return jnp.zeros(shape, dtype)
    x = jax.random.normal(key, shape, jnp.float32)
    if kind == "ones":
        x = 1.0 + 0.1 * x
    else:  # "bias" or "normal": extra is the standard deviation
        x = extra * x
    return x.astype(dtype)


@functools.partial(jax.jit, static_argnames=("recipe", "shardings"))
def _leaf(key: jax.Array, *, recipe: tuple, shardings: Any = None) -> Any:
    """One parameter; compiled once per (recipe, shardings), so equal layers share the program."""
    value = _value(key, recipe)
    return value if shardings is None else jax.lax.with_sharding_constraint(value, shardings)


def _recipe(spec: ParamSpec, cfg: ModelConfig, dtype: Any, std: float) -> tuple:
    if spec.quant is not None:
        return spec.quant, spec.shape, None, (spec.block, std)
    dt = jnp.dtype(spec.dtype(dtype))
    if spec.init == "tid2eid":
        return "tid2eid", spec.shape, dt, (cfg.n_routed_experts, cfg.n_activated_experts)
    if spec.init == "bias":
        return "bias", spec.shape, dt, 0.1 if "gate.bias" in spec.ckpt else 0.5
    if spec.init in ("ones", "zeros"):
        return spec.init, spec.shape, dt, None
    return "normal", spec.shape, dt, std


def init_params_native(c: ModelConfig, seed: int = 0, dtype: Any = jnp.float32, include_mtp: bool = True,
                       std: float = 0.02, sharder: Sharder | None = None, stacked: bool = False) -> Any:
    """Random parameter pytree on the device; weights declared quantised (``ParamSpec.quant``) are
    :class:`QuantizedWeight`, the rest dense in their usual dtypes. Placed by ``sharder``'s rules when given.

    ``stacked``: the backbone layers directly in scan layout (:class:`~dinfer_jax.models.layer_plan.StackedLayers`,
    each leaf drawn for all of a group's repeats at once), with the same values as stacking the checkpoint layout
    afterwards (every parameter's key is the same in both) but without ever holding both: the engine stacks the
    checkpoint layout into a second copy of every layer weight, which a caller that keeps its Model holds on to."""
    from dinfer_jax.models.layer_plan import StackedLayers, plan_layers
    from dinfer_jax.models.params import is_spec

    base = jax.random.key(seed)
    specs = param_specs(c, include_mtp)
    counter = iter(range(1 << 30))
    keys = map_specs(lambda spec: jax.random.fold_in(base, next(counter)), specs)   # spec order: as before

    def shardings_of(spec: ParamSpec, recipe: tuple, lead: tuple[int, ...] = ()) -> Any:
        if sharder is None:
            return None
        shape = jax.eval_shape(functools.partial(_value, recipe=recipe), jax.random.key(0))
        shape = jax.tree.map(lambda x: jax.ShapeDtypeStruct(lead + x.shape, x.dtype), shape)
        return sharder.named_tree((None,) * len(lead) + tuple(spec.axes), shape)

    def make(spec: ParamSpec, key: jax.Array) -> Any:
        recipe = _recipe(spec, c, dtype, std)
        return _leaf(key, recipe=recipe, shardings=shardings_of(spec, recipe))

    if not stacked:
        return jax.tree_util.tree_map(make, specs, keys, is_leaf=is_spec)
    params = jax.tree_util.tree_map(make, {k: v for k, v in specs.items() if k != "layers"},
                                    {k: v for k, v in keys.items() if k != "layers"}, is_leaf=is_spec)

    def make_stacked(layer_specs: list[Any], layer_keys: list[Any]) -> Any:
        def leaf(*pairs: Any) -> Any:
            spec_list, key_list = pairs[: len(pairs) // 2], pairs[len(pairs) // 2:]
            recipe = _recipe(spec_list[0], c, dtype, std)
            if any(_recipe(s, c, dtype, std) != recipe for s in spec_list):
                raise ValueError(f"layers of one scan group draw {spec_list[0].ckpt} differently")
            return _stacked_leaf(jnp.stack(key_list), recipe=recipe,
                                 shardings=shardings_of(spec_list[0], recipe, (len(spec_list),)))

        return jax.tree_util.tree_map(leaf, *layer_specs, *layer_keys, is_leaf=is_spec)

    params["layers"] = StackedLayers(tuple(
        tuple(make_stacked([specs["layers"][g.layer(r, j)] for r in range(g.repeats)],
                           [keys["layers"][g.layer(r, j)] for r in range(g.repeats)]) for j in range(g.period))
        for g in plan_layers(c)))
    return params


@functools.partial(jax.jit, static_argnames=("recipe", "shardings"))
def _stacked_leaf(keys: jax.Array, *, recipe: tuple, shardings: Any = None) -> Any:
    """One parameter for every repeat of a scan group: ``_value`` of each key, stacked (``vmap``: each row is the
    value :func:`_leaf` draws from that key)."""
    value = jax.vmap(functools.partial(_value, recipe=recipe))(keys)
    return value if shardings is None else jax.lax.with_sharding_constraint(value, shardings)
