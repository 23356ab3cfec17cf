"""Shape buckets of the serving step: the padded ``[B, Q]`` batch and the page-table width ``P`` it is compiled for.

One jitted program exists per bucket ``(B, Q, P)`` (the JAX analogue of DeepInfer's CUDA-graph sizes,
``docs/spec/engine.md`` §13), all compiled at warm-up. ``P`` is the number of pages of each row's page table
``pages [B, P]``; every per-sequence gather of compressed KV, index keys and candidate blocks covers ``P`` pages,
so a step's attention cost follows ``P``. A step gets the smallest ``P`` bucket covering its batch's largest
context after the step (``start + n`` tokens, DeepInfer's ``seqlen_k − seqlen_q + max_seqlen_q`` for the real
tokens), not ``ceil(max_model_len / block_size)``.

Trade-off of the page buckets: every page bucket multiplies the number of compiled programs (warm-up time), while
a coarser set makes a step read up to ``growth``× more pages than it needs. The default is geometric with growth
4 from the pages of ``min_tokens`` (256) tokens up to the pages of ``max_model_len`` (always included): 3 buckets
for ``max_model_len`` 4096 with 16-token pages, 4 for 8192; a single one when ``max_model_len ≤ 256``. The
persistent compilation cache makes later start-ups cheap.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable


def pow2_buckets(limit: int, start: int = 1) -> tuple[int, ...]:
    """Powers of two from ``start`` below ``limit``, then ``limit`` itself (sorted, unique)."""
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    out.append(limit)
    return tuple(sorted(set(out)))


def page_buckets(max_pages: int, block_size: int, min_tokens: int = 256, growth: int = 4) -> tuple[int, ...]:
    """Default page-table widths: ``ceil(min_tokens / block_size)·growth^k`` below ``max_pages``, then
    ``max_pages`` (the pages of one ``max_model_len`` sequence). Anchored at ``min_tokens`` so that short batches
    get the same bucket whatever ``max_model_len`` is."""
    if max_pages < 1 or block_size < 1 or growth < 2:
        raise ValueError(f"need max_pages ≥ 1, block_size ≥ 1, growth ≥ 2 (got {max_pages}, {block_size}, "
                         f"{growth})")
    out, p = [], max(1, -(-min_tokens // block_size))
    while p < max_pages:
        out.append(p)
        p *= growth
    out.append(max_pages)
    return tuple(out)


def pages_needed(contexts: Iterable[int], block_size: int) -> int:
    """Pages a step must expose: ``max ceil(context / block_size)`` over its rows (at least 1), where a row's
    context is its sequence length after the step (``start + n``)."""
    return max([1, *(-(-int(c) // block_size) for c in contexts)])


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Padded shapes the step is compiled for: decode ``[B, decode_len]`` (or ``[B, Q]`` for every Q of
    ``decode_widths``), prefill ``[B, Q]``, each with every page-table width in ``pages``. ``pages=None`` until
    :meth:`resolve` fills in the default (:func:`page_buckets`)."""

    decode_batch: tuple[int, ...]
    prefill_batch: tuple[int, ...]
    prefill_len: tuple[int, ...]
    pages: tuple[int, ...] | None = None
    decode_len: int = 1  # query tokens of a decode row: 1, or 1 + num_speculative_tokens (verify rows)
    # speculative decoding with confidence-scheduled verification: the decode widths compiled (each ≤ decode_len,
    # the largest = decode_len); None: decode_len only (every verify row checks all its drafts)
    decode_widths: tuple[int, ...] | None = None

    @classmethod
    def default(cls, max_num_seqs: int, max_num_batched_tokens: int, max_prefill_batch: int = 4,
                short_prefill: int = 64) -> Buckets:
        """Lean defaults (each shape is one compilation per page bucket): decode batches in powers of two up to
        ``max_num_seqs``; prefill batches {1, min(max_num_seqs, max_prefill_batch)}; prefill lengths {short,
        budget}; page buckets left to :meth:`resolve`."""
        pb = min(max_num_seqs, max_prefill_batch)
        return cls(decode_batch=pow2_buckets(max_num_seqs),
                   prefill_batch=tuple(sorted({1, pb})),
                   prefill_len=tuple(sorted({min(short_prefill, max_num_batched_tokens), max_num_batched_tokens})))

    def resolve(self, max_pages: int, block_size: int) -> Buckets:
        """These buckets with page buckets for sequences of up to ``max_pages`` pages of ``block_size`` tokens:
        the default set if ``pages`` is None, else ``pages`` checked (sorted, positive, largest ≥ ``max_pages``)."""
        if self.pages is None:
            return dataclasses.replace(self, pages=page_buckets(max_pages, block_size))
        pages = tuple(int(p) for p in self.pages)
        if not pages or pages != tuple(sorted(set(pages))) or pages[0] < 1:
            raise ValueError(f"page buckets {self.pages} must be distinct positive sizes in increasing order")
        if pages[-1] < max_pages:
            raise ValueError(f"the largest page bucket {pages[-1]} does not cover max_model_len: a sequence can "
                             f"need {max_pages} pages")
        return dataclasses.replace(self, pages=pages)

    def _pages(self) -> tuple[int, ...]:
        if self.pages is None:
            raise ValueError("page buckets are not resolved yet: call Buckets.resolve(max_pages, block_size)")
        return self.pages

    def shapes(self) -> list[tuple[int, int, int]]:
        """Every compiled ``(B, Q, P)``: decode ones first (:meth:`decode_shapes`), then prefill."""
        pages = self._pages()
        return self.decode_shapes() + [(b, q, p) for b in self.prefill_batch for q in self.prefill_len for p in pages]

    def widths(self) -> tuple[int, ...]:
        """The decode widths ``Q`` compiled, increasing: ``decode_widths``, or ``(decode_len,)``."""
        return self.decode_widths if self.decode_widths is not None else (self.decode_len,)

    def decode_shapes(self) -> list[tuple[int, int, int]]:
        """The decode steps' ``(B, Q, P)``: every decode batch size with every width (:meth:`widths`) at every page
        bucket."""
        return [(b, q, p) for b in self.decode_batch for q in self.widths() for p in self._pages()]

    def pick_pages(self, n: int) -> int:
        """The smallest page bucket ≥ ``n`` pages."""
        return self.pick(self._pages(), n, "page table of")

    def pages_for(self, contexts: Iterable[int], block_size: int) -> int:
        """The page bucket of a step whose rows reach ``contexts`` tokens (:func:`pages_needed`)."""
        return self.pick_pages(pages_needed(contexts, block_size))

    @staticmethod
    def pick(sizes: tuple[int, ...], n: int, what: str) -> int:
        """The smallest size ≥ ``n``; ValueError if none."""
        for s in sizes:
            if s >= n:
                return s
        raise ValueError(f"{what} {n} exceeds the largest compiled bucket {sizes[-1]}")
