"""Physical KV blocks: the GPU pool (with its prefix cache and LRU free list) and the CPU swap pool.

Every GPU block is in exactly one of two states:

    in use   ref_count > 0, mapped by that many block-table entries, not on the free list
    free     ref_count == 0, on the free list; it may still hold a cached prefix block
             (block_hash set) that a later prompt can revive until it is evicted

    free list (LRU order, constant time at both ends and in the middle)

        head ──▶ [7] ◀──▶ [2 #h] ◀──▶ [9 #h] ◀──▶ [4] ◀── tail
        allocate() pops here, evicting       release() appends here
        its cached hash first                touch() unlinks from anywhere

A physical block is an index into parallel arrays (ref_count[b], num_tokens[b], ...), not an
object. NOTE: a pool holds up to ~10^5 blocks; as objects they would all be tracked by
Python's garbage collector and every full collection would walk them (milliseconds, per
collection, on the scheduler's hot loop). A full collection still visits every item of every
list, and each block id above 256 in a list is an int object of its own, so the free list's
links (block ids, touched only on allocate / free) live in array.array, which holds raw
machine ints and is invisible to the collector; so does num_tokens, which the running
queue's lead writes for a whole step through a numpy view. ref_count stays a list: it holds
small ints (shared objects, cheap to visit) and the per-seq paths read it, which is quicker
on a list.

`num_tokens[b]` counts block b's filled token slots (0..block_size); the pool keeps the sum
over in-use blocks so that waste figures never scan the pool.
"""
from __future__ import annotations

from array import array
from typing import Callable, Iterator

import numpy as np

NO_PARENT = (-1, -1)   # the parent identity of a prompt's first block


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained hash of one full block: it names the whole prefix up to this block's end."""
    return hash((parent_hash, token_ids))


class FreeBlockQueue:
    """Doubly linked list of free block ids through two int arrays; every operation is O(1)."""

    def __init__(self, num_blocks: int) -> None:
        self.head = num_blocks          # sentinels live past the real ids: no None checks
        self.tail = num_blocks + 1
        self.prev = array("i", bytes(4 * (num_blocks + 2)))
        self.next = array("i", bytes(4 * (num_blocks + 2)))
        order = [self.head, *range(num_blocks), self.tail]
        for a, b in zip(order, order[1:]):
            self.next[a] = b
            self.prev[b] = a
        self.num_free = num_blocks

    def append(self, b: int) -> None:
        last = self.prev[self.tail]
        self.next[last] = b
        self.prev[b] = last
        self.next[b] = self.tail
        self.prev[self.tail] = b
        self.num_free += 1

    def popleft(self) -> int:
        b = self.next[self.head]
        if b == self.tail:
            raise IndexError("no free block")
        self.remove(b)
        return b

    def remove(self, b: int) -> None:
        p, n = self.prev[b], self.next[b]
        self.next[p] = n
        self.prev[n] = p
        self.num_free -= 1

    def __iter__(self) -> Iterator[int]:
        b = self.next[self.head]
        while b != self.tail:
            yield b
            b = self.next[b]


class BlockPool:
    """The GPU pool: reference counts, the LRU free list and the prefix cache (hash -> block)."""

    def __init__(self, num_blocks: int, block_size: int,
                 hash_fn: Callable[[int | None, tuple[int, ...]], int] = hash_block_tokens) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_count = [0] * num_blocks
        # Filled slots: raw ints, so that the running queue's lead (lead.py) updates a
        # step's blocks at once through the numpy view.
        self.num_tokens = array("q", bytes(8 * num_blocks))
        self.num_tokens_np = np.frombuffer(self.num_tokens, np.int64)
        # Prefix cache entry of each block (None while not registered):
        self.block_hash: list[int | None] = [None] * num_blocks
        self.token_ids: list[tuple[int, ...] | None] = [None] * num_blocks  # compared on a hit
        self.parent: list[tuple[int, int]] = [NO_PARENT] * num_blocks   # (id, generation)
        # NOTE: a block's generation changes each time it is registered, so a cached child
        # whose parent was evicted and re-registered with other tokens is never taken for a
        # child of the new content, even when the hash chain collides.
        self.generation = array("q", bytes(8 * num_blocks))
        self.free = FreeBlockQueue(num_blocks)
        self.cached: dict[int, int] = {}                 # block hash -> block id
        self.hash_fn = hash_fn
        self.num_refs = 0            # sum of ref counts == block-table entries pointing here
        self.num_filled_slots = 0    # sum of num_tokens over in-use blocks
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks allocatable now (cached-but-unreferenced ones included: they are evictable)."""
        return self.free.num_free

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.free.num_free

    def allocate(self) -> int:
        """A fresh block with ref_count 1, evicting the least recently freed one.
        Raises IndexError when no block is free."""
        b = self.free.popleft()
        if self.block_hash[b] is not None:
            self.uncache(b)
            self.num_evictions += 1
        self.ref_count[b] = 1
        self.num_tokens[b] = 0
        self.num_refs += 1
        return b

    def touch(self, b: int) -> None:
        """One more table entry maps block b (a fork, or a prefix-cache hit reviving it)."""
        if self.ref_count[b] == 0:
            self.free.remove(b)
            self.num_filled_slots += self.num_tokens[b]
        self.ref_count[b] += 1
        self.num_refs += 1

    def release(self, b: int) -> None:
        """One table entry stops mapping block b; at zero it goes to the free list's tail,
        keeping its cached contents (if any) until evicted."""
        rc = self.ref_count[b] - 1
        self.ref_count[b] = rc
        self.num_refs -= 1
        if rc == 0:
            self.num_filled_slots -= self.num_tokens[b]
            self.free.append(b)

    def fill(self, b: int, num_tokens: int) -> None:
        """Mark block b's first `num_tokens` slots as holding tokens."""
        old = self.num_tokens[b]
        if num_tokens > old:
            self.num_filled_slots += num_tokens - old
            self.num_tokens[b] = num_tokens

    # ------------------------------------------------------------ prefix cache
    def lookup(self, block_hash: int, token_ids: tuple[int, ...],
               parent: tuple[int, int]) -> int | None:
        """The cached block holding exactly `token_ids` after exactly the prefix `parent` names.

        A hash match alone is not trusted: the tokens and the parent identity are compared too,
        so a hash collision is a miss, never a wrong reuse.
        """
        b = self.cached.get(block_hash)
        if b is None or self.token_ids[b] != token_ids or self.parent[b] != parent:
            return None
        return b

    def register(self, b: int, block_hash: int, token_ids: tuple[int, ...],
                 parent: tuple[int, int]) -> bool:
        """Make a full, computed block findable. False if another block already owns the hash."""
        if block_hash in self.cached:
            return False
        self.block_hash[b] = block_hash
        self.token_ids[b] = token_ids
        self.parent[b] = parent
        self.generation[b] += 1
        self.cached[block_hash] = b
        return True

    def is_registered(self, b: int) -> bool:
        h = self.block_hash[b]
        return h is not None and self.cached.get(h) == b

    def identity(self, b: int) -> tuple[int, int]:
        """What a child block records as its parent: the id and the current generation."""
        return (b, self.generation[b])

    def uncache(self, b: int) -> None:
        """Forget block b's prefix-cache entry (its contents stay as they are)."""
        h = self.block_hash[b]
        if self.cached.get(h) == b:
            del self.cached[h]
        self.block_hash[b] = None
        self.token_ids[b] = None
        self.parent[b] = NO_PARENT

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (they stay allocated or free as they are)."""
        for b in list(self.cached.values()):
            self.uncache(b)


class CpuBlockPool:
    """The CPU swap pool: reference counts and a stack of free block ids (order is irrelevant:
    nothing is cached on the CPU side)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.num_tokens = [0] * num_blocks
        self.free_ids = array("i", range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def allocate(self) -> int:
        c = self.free_ids.pop()
        self.ref_count[c] = 1
        return c

    def share(self, c: int) -> None:
        """One more table entry maps CPU block c (a block shared inside a swapped group)."""
        self.ref_count[c] += 1

    def release(self, c: int) -> None:
        self.ref_count[c] -= 1
        if self.ref_count[c] == 0:
            self.num_tokens[c] = 0
            self.free_ids.append(c)
