"""V4.1 Engram: compressed tokenizer, n-gram hashing, host-side tables and the gate (docs/spec/model-v41.md §3.3, §3.9).

Host side (numpy): raw ids → compressed ids → n-gram rows ``[..., S, M]`` (M = ``engram_max_ngram_size``, row r =
token at p−r) → table row ids ``[L, ..., S, H]`` (H = (M−1)·n_heads, flat column (n−1)·n_heads + j for n-gram size
n+1 and hash head j, offsets included) → rows gathered from memory-mapped tables → ``[L, ..., S, H·head_dim]`` fp32.
Device side (JAX): :func:`engram_gate` adds the gated projection of those rows to the mHC streams.

The hash is int64 arithmetic that never overflows (the multipliers are bounded by ``(2^63−1) // V_c // 2``), so
it runs in numpy on the host, where the tables and the token history live anyway; the device never needs x64.
"""

from __future__ import annotations

import functools
import mmap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dinfer_jax.loading.safetensors_io import CheckpointError, CheckpointFiles
from dinfer_jax.models.config import ModelConfig
from dinfer_jax.models.ops import F32, linear

HASH_SEED = 0
LAYER_SEED_STRIDE = 10007
GATE_CLAMP = 1e-6
SCALE_BLOCK = 32
PAD_TOKEN = "<｜▁pad▁｜>"

# ---------------------------------------------------------------------------------------------------------------------
# Primes and the hash layout
# ---------------------------------------------------------------------------------------------------------------------

# Deterministic Miller–Rabin witnesses: correct for every n < 3.3·10^24, so for all int64 values.
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def is_prime(n: int) -> bool:
    """Deterministic primality test for ``0 <= n < 2^64``."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_prime(n: int) -> int:
    """The smallest prime strictly greater than ``n`` (``sympy.nextprime`` semantics)."""
    c = max(n + 1, 2)
    while not is_prime(c):
        c += 1
    return c


def hash_bound(compressed_vocab_size: int) -> int:
    """Exclusive upper bound of the random draw behind each multiplier: ``(2^63 − 1) // V_c // 2`` (at least 1)."""
    return max(1, (2**63 - 1) // compressed_vocab_size // 2)


def _layer_multipliers(layer_id: int, max_ngram: int, bound: int) -> np.ndarray:
    """Odd multipliers int64 ``[max_ngram]``: ``2·x + 1``, x from ``default_rng(seed + 10007·layer_id)``."""
    rng = np.random.default_rng(HASH_SEED + LAYER_SEED_STRIDE * layer_id)
    return rng.integers(0, bound, size=(max_ngram,), dtype=np.int64) * 2 + 1


def _layer_primes(vocab_size: int, n_tables: int, n_heads: int, seen: set[int]) -> list[list[int]]:
    """``[n_tables][n_heads]`` primes; each table restarts above ``vocab_size − 1`` and skips primes in ``seen``."""
    per_table = []
    for _ in range(n_tables):
        start, heads = vocab_size - 1, []
        for _ in range(n_heads):
            prime = next_prime(start)
            while prime in seen:
                prime = next_prime(prime)
            seen.add(prime)
            heads.append(prime)
            start = prime
        per_table.append(heads)
    return per_table


@functools.lru_cache(maxsize=16)
def _layout(layer_ids: tuple[int, ...], vocab_size: int, compressed_vocab_size: int, max_ngram: int,
            n_heads: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    bound = hash_bound(compressed_vocab_size)
    multipliers = np.stack([_layer_multipliers(lid, max_ngram, bound) for lid in layer_ids])
    seen: set[int] = set()  # one set across all layers: no prime is used twice in the model
    primes = np.array([_layer_primes(vocab_size, max_ngram - 1, n_heads, seen) for _ in layer_ids], np.int64)
    flat = primes.reshape(len(layer_ids), -1)
    offsets = np.concatenate([np.zeros_like(flat[:, :1]), np.cumsum(flat[:, :-1], axis=1)], axis=1)
    for a in (multipliers, primes, offsets):
        a.flags.writeable = False  # cached: callers must not mutate the shared arrays
    return multipliers, primes, offsets


def engram_layout(config: ModelConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Hash layout of the Engram layers, in ``engram_layer_ids`` order (cached, read-only arrays).

    Returns ``(multipliers int64 [L, M], primes int64 [L, M−1, n_heads], offsets int64 [L, (M−1)·n_heads])``:
    per-layer odd multipliers, the table size of every (n-gram, head) pair, and the exclusive prefix sum of the
    sizes in flat order (n−1)·n_heads + j (each layer's table stacks its (M−1)·n_heads sub-tables).
    """
    if not config.engram_layer_ids:
        raise ValueError("config has no Engram layers (engram_layer_ids is empty)")
    return _layout(tuple(config.engram_layer_ids), int(config.engram_vocab_size),
                   int(config.engram_compressed_vocab_size), int(config.engram_max_ngram_size),
                   int(config.engram_n_heads))


def engram_table_sizes(config: ModelConfig) -> tuple[int, ...]:
    """Rows of each layer's table = Σ of that layer's primes (must equal ``engram_num_embeddings``)."""
    _, primes, _ = engram_layout(config)
    return tuple(int(s) for s in primes.reshape(primes.shape[0], -1).sum(axis=1))


# ---------------------------------------------------------------------------------------------------------------------
# Hash
# ---------------------------------------------------------------------------------------------------------------------

def engram_hash(config: ModelConfig, ngram_ids: np.ndarray) -> np.ndarray:
    """Table row ids int64 ``[L, ..., (M−1)·n_heads]`` of compressed n-gram rows ``[..., M]`` (usually ``[T, M]``).

    ``h = tok[0]·M[0]``, then for n = 1..M−1: ``h ^= tok[n]·M[n]`` and column (n−1)·n_heads + j gets
    ``h mod P[n−1][j] + off[(n−1)·n_heads + j]``. Ids must lie in ``[0, engram_compressed_vocab_size)``, which is what
    keeps every product below 2^63.
    """
    mult, primes, offsets = engram_layout(config)
    tok = np.asarray(ngram_ids)
    n_layers, max_ngram = mult.shape
    if tok.ndim < 1 or tok.shape[-1] != max_ngram:
        raise ValueError(f"ngram_ids must be [..., {max_ngram}] (engram_max_ngram_size), got shape {tok.shape}")
    if not np.issubdtype(tok.dtype, np.integer):
        raise ValueError(f"ngram_ids must be integers, got {tok.dtype}")
    if tok.size and (tok.min() < 0 or tok.max() >= config.engram_compressed_vocab_size):
        raise ValueError(f"compressed ids must lie in [0, {config.engram_compressed_vocab_size}), got range "
                         f"[{tok.min()}, {tok.max()}]")
    lead = tok.shape[:-1]
    flat = tok.reshape(-1, max_ngram).astype(np.int64)
    prod = flat[None, :, :] * mult[:, None, :]                            # [L, T, M]
    h = prod[:, :, 0]
    cols = []
    for n in range(1, max_ngram):
        h = h ^ prod[:, :, n]
        cols.append(h[:, :, None] % primes[:, None, n - 1, :])           # [L, T, n_heads]
    ids = np.concatenate(cols, axis=-1) + offsets[:, None, :]
    return ids.reshape((n_layers, *lead, ids.shape[-1]))


# ---------------------------------------------------------------------------------------------------------------------
# Compressed tokenizer and n-gram rows
# ---------------------------------------------------------------------------------------------------------------------

def _normalizer() -> Any:
    """NFKC → NFD → strip accents → lowercase → collapse ``[ \\t\\r\\n]+`` → lone space kept → strip."""
    from tokenizers import Regex, normalizers

    keep = "\ue000"  # placeholder that protects a token that is exactly one space from Strip
    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), keep),
        normalizers.Strip(),
        normalizers.Replace(keep, " "),
    ])


def build_compressed_token_map(tokenizer_json_path: str | Path, expected_size: int | None = None) -> np.ndarray:
    """Raw id → compressed id, int64 ``[n_tokens]`` (n_tokens = tokenizer size including added tokens).

    Each id is decoded alone (special tokens kept); text with U+FFFD (a partial UTF-8 piece) keys on the raw token
    string, otherwise on the normalised text (or the text itself if that normalises to ""). Compressed ids number the
    keys by first appearance. With ``expected_size`` (the config's ``engram_compressed_vocab_size``) a different
    number of keys raises ``ValueError``; see also :func:`load_compressed_token_map`.
    """
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json_path))
    norm = _normalizer()
    keys: dict[str, int] = {}
    out = np.empty(tok.get_vocab_size(with_added_tokens=True), np.int64)
    for token_id in range(out.shape[0]):
        text = tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(token_id)
            if key is None:
                raise ValueError(f"{tokenizer_json_path}: token id {token_id} has no vocabulary entry")
        else:
            key = norm.normalize_str(text) or text
        out[token_id] = keys.setdefault(key, len(keys))
    if expected_size is not None and len(keys) != expected_size:
        raise ValueError(f"{tokenizer_json_path}: the compressed Engram vocabulary has {len(keys)} entries, but the "
                         f"config says engram_compressed_vocab_size = {expected_size}")
    return out


def load_compressed_token_map(config: ModelConfig, tokenizer_json_path: str | Path) -> np.ndarray:
    """:func:`build_compressed_token_map` checked against ``config`` (size, and the pad id inside the vocabulary)."""
    table = build_compressed_token_map(tokenizer_json_path, expected_size=config.engram_compressed_vocab_size)
    if not 0 <= config.engram_pad_id < table.shape[0]:
        raise ValueError(f"engram_pad_id {config.engram_pad_id} is outside the tokenizer ({table.shape[0]} tokens)")
    return table


def compress_token_ids(token_ids: np.ndarray, compressed_map: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(compressed int64 [...], outside bool [...])`` for raw ids ``[...]``.

    Ids outside ``[0, len(compressed_map))`` (image ids sit above the text vocabulary) are reported in ``outside``
    and get compressed id 0; DeepInfer maps them to its image sentinel, which :func:`ngram_rows` treats as an image.
    """
    ids = np.asarray(token_ids)
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got {ids.dtype}")
    table = np.asarray(compressed_map, np.int64)
    outside = (ids < 0) | (ids >= table.shape[0])
    return np.where(outside, 0, table[np.where(outside, 0, ids)]), outside


def ngram_rows(compressed_ids: np.ndarray, max_ngram: int, pad_compressed_id: int,
               image_mask: np.ndarray | None = None) -> np.ndarray:
    """N-gram rows int64 ``[..., S, max_ngram]`` of compressed ids ``[..., S]`` for a sequence from position 0.

    Row r at position p is the id at p−r; positions < 0 are ``pad_compressed_id``. An image position (``image_mask``
    ``[..., S]`` bool) is pad and stops the look-back: once row r reaches an image, rows r, r+1, ... are pad.
    """
    ids = np.asarray(compressed_ids, np.int64)
    if ids.ndim < 1:
        raise ValueError("compressed_ids must be [..., S], got a scalar")
    S = ids.shape[-1]
    img = np.zeros(ids.shape, bool) if image_mask is None else np.broadcast_to(np.asarray(image_mask, bool), ids.shape)
    rows = np.full((*ids.shape, max_ngram), pad_compressed_id, np.int64)
    stopped = np.zeros(ids.shape, bool)  # an image lies in p−r..p
    for r in range(min(max_ngram, S)):
        stopped[..., r:] |= img[..., :S - r]
        rows[..., r:, r] = np.where(stopped[..., r:], pad_compressed_id, ids[..., :S - r])
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# Host-side tables
# ---------------------------------------------------------------------------------------------------------------------

_F8 = np.dtype(ml_dtypes.float8_e4m3fn)
_E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
_FLOATS = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float64))


def _is_file_backed(a: Any) -> bool:
    """Whether ``a`` is (a view of) a memory map, so reading it does not hold the whole tensor in RAM."""
    while a is not None:
        if isinstance(a, (np.memmap, mmap.mmap)):
            return True
        a = getattr(a, "base", None)
    return False


class EngramTable:
    """One layer's Engram table, kept as a (memory-mapped) view on the host; rows are decoded only when gathered.

    Release format: ``weight`` F8_E4M3 ``[rows, head_dim]`` + ``scale`` F8_E8M0 ``[rows, head_dim/32]``, row value
    ``e4m3 · 2^(scale − 127)`` per 32 columns (exact in fp32). HF format: a float ``weight`` returned as stored; its
    ``scale`` (``[rows, 1]``, used by HF only for float8 weights) is ignored.
    """

    def __init__(self, weight: np.ndarray, scale: np.ndarray | None = None, name: str = "engram table"):
        if weight.ndim != 2:
            raise CheckpointError(f"{name}: expected a 2-D table [rows, head_dim], got shape {weight.shape}")
        self.name = name
        self.weight = weight
        self.quantized = weight.dtype == _F8
        if self.quantized:
            self.scale = self._check_scale(weight, scale, name)
        elif weight.dtype in _FLOATS:
            self.scale = None
        else:
            raise CheckpointError(f"{name}: unsupported table dtype {weight.dtype} (want F8_E4M3 or a float type)")

    @staticmethod
    def _check_scale(weight: np.ndarray, scale: np.ndarray | None, name: str) -> np.ndarray:
        rows, head_dim = weight.shape
        if head_dim % SCALE_BLOCK:
            raise CheckpointError(f"{name}: FP8 table head_dim {head_dim} is not a multiple of {SCALE_BLOCK}")
        want = (rows, head_dim // SCALE_BLOCK)
        if scale is None:
            raise CheckpointError(f"{name}: FP8 table without its .scale tensor (E8M0 {list(want)})")
        if scale.dtype != _E8M0 or scale.shape != want:
            raise CheckpointError(f"{name}: scale must be F8_E8M0 {list(want)}, got {scale.dtype} {list(scale.shape)}")
        return scale

    @property
    def rows(self) -> int:
        return int(self.weight.shape[0])

    @property
    def head_dim(self) -> int:
        return int(self.weight.shape[1])

    @property
    def is_memory_mapped(self) -> bool:
        """True when the codes (and scales) are views of a memory-mapped file, not arrays in RAM."""
        return _is_file_backed(self.weight) and (self.scale is None or _is_file_backed(self.scale))

    def gather(self, row_ids: np.ndarray) -> np.ndarray:
        """Decoded rows float32 ``[..., head_dim]`` of int row ids ``[...]`` (each in ``[0, rows)``)."""
        ids = np.asarray(row_ids)
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"{self.name}: row ids must be integers, got {ids.dtype}")
        flat = ids.reshape(-1).astype(np.int64)
        if flat.size and (flat.min() < 0 or flat.max() >= self.rows):
            raise IndexError(f"{self.name}: row ids must lie in [0, {self.rows}), "
                             f"got range [{flat.min()}, {flat.max()}]")
        values = np.asarray(self.weight[flat]).astype(np.float32)          # reads only the selected rows
        if self.quantized:
            scale = np.asarray(self.scale[flat]).astype(np.float32)         # 2^(b − 127), exact
            values = (values.reshape(flat.size, -1, SCALE_BLOCK) * scale[:, :, None]).reshape(flat.size, -1)
        return values.reshape((*ids.shape, self.head_dim))

    @classmethod
    def from_checkpoint(cls, files: CheckpointFiles | str | Path, layer_id: int,
                        config: ModelConfig | None = None) -> EngramTable:
        """The table ``layers.{layer_id}.engram.embed.weight`` (optional ``model.`` prefix) of a checkpoint.

        With ``config``, the shape is checked against ``engram_num_embeddings`` and ``engram_head_dim``.
        """
        ckpt = files if isinstance(files, CheckpointFiles) else CheckpointFiles(files)
        names = set(ckpt.keys())
        base = f"layers.{layer_id}.engram.embed"
        prefix = next((p for p in ("", "model.") if f"{p}{base}.weight" in names), None)
        if prefix is None:
            raise CheckpointError(f"{ckpt.dir}: no Engram table {base}.weight (with or without 'model.')")
        w_name, s_name = f"{prefix}{base}.weight", f"{prefix}{base}.scale"
        weight = ckpt.file_of(w_name).get(w_name)
        scale = ckpt.file_of(s_name).get(s_name) if weight.dtype == _F8 and s_name in names else None
        table = cls(weight, scale, name=w_name)
        if config is not None:
            table.check_shape(config, layer_id)
        return table

    def check_shape(self, config: ModelConfig, layer_id: int) -> None:
        """Raise ``CheckpointError`` unless the table is ``[engram_num_embeddings[i], engram_head_dim]``."""
        if layer_id not in config.engram_layer_ids:
            raise CheckpointError(f"{self.name}: layer {layer_id} is not an Engram layer {config.engram_layer_ids}")
        rows = config.engram_num_embeddings[config.engram_layer_ids.index(layer_id)]
        if (self.rows, self.head_dim) != (rows, config.engram_head_dim):
            raise CheckpointError(f"{self.name}: shape [{self.rows}, {self.head_dim}], but the config expects "
                                  f"[{rows}, {config.engram_head_dim}] (engram_num_embeddings, engram_head_dim)")


def load_engram_tables(config: ModelConfig, files: CheckpointFiles | str | Path) -> list[EngramTable]:
    """One memory-mapped :class:`EngramTable` per Engram layer, in ``engram_layer_ids`` order, shape-checked."""
    ckpt = files if isinstance(files, CheckpointFiles) else CheckpointFiles(files)
    return [EngramTable.from_checkpoint(ckpt, lid, config) for lid in config.engram_layer_ids]


# ---------------------------------------------------------------------------------------------------------------------
# Host pipeline
# ---------------------------------------------------------------------------------------------------------------------

def engram_embeddings(config: ModelConfig, tables: Sequence[EngramTable], token_ids: np.ndarray,
                      compressed_map: np.ndarray, image_mask: np.ndarray | None = None) -> np.ndarray:
    """Concatenated Engram rows float32 ``[L, B, S, (M−1)·n_heads·head_dim]`` of raw ids ``[B, S]`` (from position 0).

    Raw ids → compressed ids → n-gram rows (image positions, and ids outside the tokenizer, stop the look-back) →
    hash → gather; head h's rows occupy columns ``h·head_dim : (h+1)·head_dim`` with h = (n−1)·n_heads + j.
    Any leading shape works in place of ``[B]``.
    """
    if len(tables) != len(config.engram_layer_ids):
        raise ValueError(f"need one table per Engram layer {config.engram_layer_ids}, got {len(tables)}")
    sizes = engram_table_sizes(config)
    for table, rows, lid in zip(tables, sizes, config.engram_layer_ids, strict=False):
        if (table.rows, table.head_dim) != (rows, config.engram_head_dim):
            raise ValueError(f"{table.name}: shape [{table.rows}, {table.head_dim}] but layer {lid}'s hash layout "
                             f"needs [{rows}, {config.engram_head_dim}]")
    cmp, outside = compress_token_ids(token_ids, compressed_map)
    stop = outside if image_mask is None else outside | np.asarray(image_mask, bool)
    pad = int(np.asarray(compressed_map)[config.engram_pad_id])
    rows = ngram_rows(cmp, config.engram_max_ngram_size, pad, stop)
    ids = engram_hash(config, rows)                                              # [L, ..., S, H]
    lead = ids.shape[1:-1]
    return np.stack([t.gather(ids[i]).reshape((*lead, -1)) for i, t in enumerate(tables)])


# ---------------------------------------------------------------------------------------------------------------------
# Gate (device)
# ---------------------------------------------------------------------------------------------------------------------

def engram_gate_scores(streams: jax.Array, k: jax.Array, w: jax.Array, norm_eps: float,
                       image_mask: jax.Array | None = None) -> jax.Array:
    """Gate g float32 ``[..., n]`` of streams ``[..., n, D]`` and keys ``k [..., n, D]`` (fp32), ``w [n, D]``.

    ``d = Σ_D X·w·k · rsqrt(mean X² + eps) · rsqrt(mean k² + eps) · D^−½`` (norms over D, per stream);
    ``g = sigmoid(sign(d) · sqrt(max(|d|, 1e−6)))``, 0 on image rows (``image_mask [...]``).
    """
    x, k = streams.astype(F32), k.astype(F32)
    dim = x.shape[-1]
    rstd_x = jax.lax.rsqrt(jnp.mean(x * x, axis=-1) + norm_eps)
    rstd_k = jax.lax.rsqrt(jnp.mean(k * k, axis=-1) + norm_eps)
    d = jnp.sum(x * w * k, axis=-1) * rstd_x * rstd_k * (dim ** -0.5)
    g = jax.nn.sigmoid(jnp.sign(d) * jnp.sqrt(jnp.maximum(jnp.abs(d), GATE_CLAMP)))
    if image_mask is not None:
        g = jnp.where(image_mask[..., None], 0.0, g)
    return g


def engram_gate(streams: jax.Array, emb: jax.Array, p: Mapping[str, jax.Array], *, norm_eps: float,
                image_mask: jax.Array | None = None) -> jax.Array:
    """Engram update of the mHC streams ``[B, S, n, D]`` from the concatenated rows ``emb [B, S, E_in]``.

    ``p``: ``wkv [(n+1)·D, E_in]``, ``q_weight``, ``k_weight [n, D]``. ``kv = emb·wkvᵀ`` (fp32 accumulation, rounded
    to the streams' dtype like the bf16 GEMM output of both references), ``k = kv[:n·D]`` viewed ``[n, D]`` (one key
    per stream), ``v = kv[n·D:]`` shared; ``X[m] += g[m]·v`` in fp32 (g from :func:`engram_gate_scores`), result in
    the streams' dtype. ``image_mask [B, S]`` bool zeroes the gate.
    """
    n, dim = streams.shape[-2:]
    kv = linear(emb.astype(streams.dtype), p["wkv"])   # in the streams' dtype, as the references round it
    kv = kv.astype(F32).reshape((*kv.shape[:-1], n + 1, dim))
    k, v = kv[..., :n, :], kv[..., n, :]
    w = p["q_weight"].astype(F32) * p["k_weight"].astype(F32)
    g = engram_gate_scores(streams, k, w, norm_eps, image_mask)
    return (streams.astype(F32) + g[..., None] * v[..., None, :]).astype(streams.dtype)


__all__ = [
    "EngramTable", "build_compressed_token_map", "compress_token_ids", "engram_embeddings", "engram_gate",
    "engram_gate_scores", "engram_hash", "engram_layout", "engram_table_sizes", "hash_bound", "is_prime",
    "load_compressed_token_map", "load_engram_tables", "next_prime", "ngram_rows",
]
