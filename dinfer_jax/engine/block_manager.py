"""Host-side pools for paged KV blocks and per-sequence state slots.

Semantics follow DeepInfer's ``csrc/engine/block_manager.hpp`` (``Blocks`` / ``BlockManager``) and
``docs/spec/engine.md`` §12: a fixed pool whose id 0 is reserved (the *null* block / slot that padding rows point at
and that is never handed out), reference counts (``pin`` / ``fork`` for sharing), and a FIFO free list: ``allocate``
pops from the front, and an id is pushed to the back when its reference count drops to 0, so recently freed ids are
reused last.

Both pools are pure Python bookkeeping; no device memory is touched here.

``BlockManager(num_blocks, block_size)``: ``num_blocks`` counts the null block, so ``num_blocks - 1`` blocks are
usable.  ``StateSlots(num_slots)``: likewise ``num_slots - 1`` usable slots (DeepInfer sizes it
``int(max_num_seqs * 1.2) + 1``: one slot per running sequence plus slack for sequences whose release is deferred).

Every mutating call validates all of its arguments before changing anything, so a rejected call (double free, bad id,
not enough free ids) leaves the pool untouched.
"""

from __future__ import annotations

import enum
import operator
from collections import Counter, deque
from collections.abc import Iterable

__all__ = ["NULL_BLOCK", "NULL_SLOT", "AllocStatus", "BlockManager", "StateSlots"]

NULL_BLOCK = 0
"""Reserved block id: never allocated; padding rows and unused block-table entries point at it."""
NULL_SLOT = 0
"""Reserved state slot: never allocated; padding rows use it."""


class AllocStatus(enum.Enum):
    """Answer to "can n ids be allocated?" (DeepInfer ``AllocStatus``)."""

    OK = "ok"  # enough free ids now
    LATER = "later"  # not now, but the pool is large enough once others free theirs
    NEVER = "never"  # more than the whole usable pool


def _as_int(value: object, what: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got bool {value!r}")
    try:
        return operator.index(value)  # accepts numpy integers, rejects floats/str
    except TypeError:
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}") from None


class _RefCountedPool:
    """Fixed pool of ids ``1 .. size-1`` with refcounts and a FIFO free list; id 0 is reserved."""

    _what = "id"

    def __init__(self, size: int) -> None:
        size = _as_int(size, f"number of {self._what}s")
        if size < 2:
            raise ValueError(f"need at least 2 {self._what}s (id 0 is the reserved null {self._what}), got {size}")
        self._size = size
        self._refcount = [0] * size
        # Invariant: an id is in _free iff its refcount is 0 (id 0 excepted: never in _free, refcount stays 0).
        self._free: deque[int] = deque(range(1, size))

    # ------------------------------------------------------------------ queries
    @property
    def capacity(self) -> int:
        """Number of allocatable ids (the pool size minus the null id)."""
        return self._size - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def refcount(self, i: int) -> int:
        return self._refcount[self._check_id(i)]

    def alloc_status(self, n: int) -> AllocStatus:
        n = _as_int(n, "n")
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of {self._what}s ({n})")
        if n > self.capacity:
            return AllocStatus.NEVER
        return AllocStatus.OK if n <= len(self._free) else AllocStatus.LATER

    def can_allocate(self, n: int = 1) -> bool:
        return self.alloc_status(n) is AllocStatus.OK

    def free_ids(self) -> list[int]:
        """The free list, front (next to be allocated) first. For tests and debugging."""
        return list(self._free)

    # ---------------------------------------------------------------- mutation
    def _check_id(self, i: object) -> int:
        i = _as_int(i, f"{self._what} id")
        if i == 0:
            raise ValueError(f"{self._what} 0 is the reserved null {self._what} and is never allocated or freed")
        if not 0 < i < self._size:
            raise ValueError(f"{self._what} id {i} out of range [1, {self._size})")
        return i

    def _allocate(self, n: int) -> list[int]:
        status = self.alloc_status(n)
        if status is not AllocStatus.OK:
            raise RuntimeError(
                f"cannot allocate {n} {self._what}s: {len(self._free)} free of {self.capacity} ({status.value})"
            )
        out = [self._free.popleft() for _ in range(n)]
        for i in out:
            self._refcount[i] = 1
        return out

    def _free_ids(self, ids: list[int]) -> None:
        checked = [self._check_id(i) for i in ids]
        for i, k in Counter(checked).items():
            if self._refcount[i] < k:
                raise ValueError(
                    f"double free of {self._what} {i}: refcount {self._refcount[i]}, freed {k} time(s) in this call"
                )
        for i in checked:
            self._refcount[i] -= 1
            if self._refcount[i] == 0:
                self._free.append(i)

    def _pin_ids(self, ids: list[int]) -> None:
        checked = [self._check_id(i) for i in ids]
        for i in checked:
            if self._refcount[i] == 0:
                raise ValueError(f"cannot pin free {self._what} {i} (refcount 0)")
        for i in checked:
            self._refcount[i] += 1

    def assert_all_free(self) -> None:
        """Raise AssertionError unless every usable id is back in the free list (leak check)."""
        used = [i for i in range(1, self._size) if self._refcount[i]]
        if used or len(self._free) != self.capacity:
            raise AssertionError(f"{len(used)} {self._what}(s) still referenced: {used[:16]}")


class BlockManager(_RefCountedPool):
    """Paged KV block pool: ``num_blocks`` ids (block 0 = null block, never allocated), ``block_size`` tokens each."""

    _what = "block"

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks)
        block_size = _as_int(block_size, "block_size")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = self._size
        self.block_size = block_size

    @property
    def num_usable_blocks(self) -> int:
        return self.capacity

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold positions ``[0, num_tokens)``."""
        num_tokens = _as_int(num_tokens, "num_tokens")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the front of the free list (refcount 1 each). All-or-nothing."""
        return self._allocate(n)

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; a block whose refcount reaches 0 goes to the back of the free list.

        Blocks are released in reverse table order (as DeepInfer): the tail of a sequence is recycled before its
        head. Raises ValueError (and changes nothing) on a bad id, the null block, or a double free.
        """
        self._free_ids(list(blocks)[::-1])

    def pin(self, blocks: Iterable[int]) -> None:
        """Add one reference to each (allocated) block, e.g. to share a prefix."""
        self._pin_ids(list(blocks))

    def fork(self, blocks: Iterable[int]) -> list[int]:
        """Share a block table: pin every block and return a copy of the table for the new owner."""
        table = list(blocks)
        self._pin_ids(table)
        return table


class StateSlots(_RefCountedPool):
    """Fixed per-sequence state slots (SWA rings, compressor state): slot 0 is the null slot for padding rows."""

    _what = "slot"

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self.num_slots = self._size

    def allocate(self) -> int:
        """Pop one slot from the front of the free list (refcount 1)."""
        return self._allocate(1)[0]

    def free(self, slot: int) -> None:
        """Drop one reference; at refcount 0 the slot goes to the back of the free list."""
        self._free_ids([slot])

    def pin(self, slot: int) -> None:
        self._pin_ids([slot])

    def fork(self, slot: int) -> int:
        """Share a slot (refcount + 1) and return it."""
        self._pin_ids([slot])
        return _as_int(slot, "slot id")
