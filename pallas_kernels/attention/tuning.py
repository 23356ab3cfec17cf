"""Which organisation of the decode-attention kernel a call uses, by its number of query rows.

Measured on the H200 at the real size (64 heads × 512, L = 640 rows per query; ``docs/perf/attention_h200.md``):

* 64 queries: ``split_cta`` 21.4 µs of kernel (128 CTAs, two per query) against ``shared_qk`` 28.5 µs (64 CTAs)
  and ``shared_qk, l_split=2`` 21.6 µs of kernel plus 6 µs of XLA merge — ``split_cta`` is the choice;
* 1 query: ``split_cta`` 16.2 µs (its CTAs walk the ten KV blocks one after another) against ``shared_qk,
  l_split=10`` 6.8 µs of kernel and 10.4 µs for the whole call with the merge — one KV block per CTA.

* more than ``NUM_SMS / 2`` queries: ``split_cta``'s two CTAs per query no longer fit one wave, and ``shared_qk``
  (one CTA per query, QK computed once) wins at every size measured — H200 at 128 queries 31.9 against 51.2 µs
  (71% against 45% of copy); H100 at 72 / 96 / 128 / 256 / 512 queries 59 / 68 / 79 / 84 / 91% against 47 / 52 /
  48 / 51 / 53% (at 192, 74% against ``split_cluster``'s 76%; docs/perf/attention_h200.md, fourth session of
  2026-12-07).

So few queries take ``shared_qk`` with L split over as many CTAs as keep the grid within one wave of SMs, the
middle ``split_cta`` with ``early_release`` (the other CTA's column chunks refilled during the softmax and P·V:
25.1 against 26.5 µs at 64 queries on an H100, 17.3 against 17.5 at 16; docs/perf/attention_h200.md, sixth session
of 2026-12-05), and many queries ``shared_qk`` again (then ``l_split = 1``). :data:`SMALL_N_MAX` and ``NUM_SMS /
2`` are the boundaries; the sizes are measured by ``scripts/bench_kernels.py attention-kernel --batches 1 4 8 16 64
72 96 128 256`` (the ``model rule`` row).
"""

from __future__ import annotations

import jax

NUM_SMS = 132          # H200
SMALL_N_MAX = 8        # up to this many query rows a call: shared_qk with an L split (module docstring)
SPLIT_CTA_MAX = NUM_SMS // 2   # split_cta's two CTAs a query fit one wave up to this many; shared_qk above


def decode_options(n_queries: int, rows: int, block_kv: int = 64) -> dict:
    """Keyword arguments of ``sparse_decode_attention`` for ``n_queries`` query rows over ``rows`` KV rows each
    (a multiple of ``block_kv``): ``split_cta`` with early release from :data:`SMALL_N_MAX` + 1 to
    :data:`SPLIT_CTA_MAX` queries (two CTAs a query, one wave); otherwise ``shared_qk`` with the largest
    ``l_split`` dividing the ``rows / block_kv`` KV blocks such that ``n_queries · l_split ≤`` :data:`NUM_SMS`
    (``l_split = 1``, no merge, when only one block or no split fits — always above :data:`SPLIT_CTA_MAX`
    queries)."""
    if n_queries <= 0 or rows <= 0 or rows % block_kv:
        raise ValueError(f"need n_queries > 0 and rows a positive multiple of {block_kv}, got {n_queries}, {rows}")
    if SMALL_N_MAX < n_queries <= SPLIT_CTA_MAX:
        return dict(organisation="split_cta", early_release=True)
    blocks = rows // block_kv
    l_split = max((s for s in range(1, blocks + 1) if blocks % s == 0 and n_queries * s <= NUM_SMS), default=1)
    return dict(organisation="shared_qk", l_split=l_split)


def gather_options(n_queries: int, stored: str = "bf16", device_kind: str | None = None) -> dict:
    """Keyword arguments of ``sparse_decode_attention_rows`` (the kernel fetching its rows from the cache) for a call
    of ``n_queries`` query rows from a pool of ``stored`` rows (``"bf16"`` or ``"v41_fp4"``) on a GPU of
    ``device_kind`` (``jax.Device.device_kind``; None: the first device's). Measured at 64 heads × 512, 640 rows a
    query (docs/perf/attention_h200.md, 2026-12-06):

    * above :data:`SMALL_N_MAX` queries, early release. bf16 rows: on an **H100** 32-row steps in three stages (two
      steps of copies in flight instead of one: 31.0 against 32.8 µs at 64 queries, 55% against 53% of copy; four
      stages gain nothing more); on an **H200** (and any other card) 64-row steps in two stages, which the H200
      runs faster (27.5 against 30.0 µs, 43% against 40% of its 4.26 TB/s). ``v41_fp4`` rows keep 64-row steps in
      two stages on both (H100 37.8 µs, H200 36.6; 32-row steps 52.4 / 51.1, staged one step ahead 49.3 / 48.3 —
      the decode, not the copies, bounds those);
    * up to :data:`SMALL_N_MAX` queries, 64-row steps in two stages (at one query every 32-row form was slower:
      26.0 against 23.7 µs);
    * above :data:`SPLIT_CTA_MAX` queries, bf16 rows: ``shared_qk``'s gathering form, one CTA a query in one stage
      (two do not fit beside the index rows at d = 512), as for the kernel on gathered rows
      (:func:`decode_options`): on an H100 57.0 against 58.4 µs at 96 queries and 155.8 against 207.2 µs at 384
      (66% against 50% of copy; the H200 unmeasured; docs/perf/attention_h200.md, fourth session of 2026-12-07).
      ``v41_fp4`` rows keep ``split_cta``: ``shared_qk``'s gathering form is slower for them (H100: 91.8 against
      76.0 µs at 96 queries, 287 against 266 at 384; fifth session of 2026-12-07).

    ``shared_qk``'s gathering form (``organisation="shared_qk"``) measured the same as XLA's gather + that kernel at
    one query (H100 12.6 against 12.3 µs, H200 12.4 against 11.9), so the model keeps the latter for few queries
    (``pooled_kernel_pays``)."""
    if n_queries <= 0:
        raise ValueError(f"need n_queries > 0, got {n_queries}")
    if stored not in ("bf16", "v41_fp4"):
        raise ValueError(f"stored must be 'bf16' or 'v41_fp4', got {stored!r}")
    if n_queries <= SMALL_N_MAX:
        return dict(early_release=False)
    if stored == "bf16" and n_queries > SPLIT_CTA_MAX:
        return dict(organisation="shared_qk", num_stages=1)
    if device_kind is None:
        device_kind = jax.devices()[0].device_kind
    if stored == "bf16" and "H100" in device_kind:
        return dict(early_release=True, block_kv=32, num_stages=3)
    return dict(early_release=True)


__all__ = ["NUM_SMS", "SMALL_N_MAX", "SPLIT_CTA_MAX", "decode_options", "gather_options"]
