"""The block manager: maps each sequence's logical blocks to physical KV blocks.

    seq A  block_table [7, 2, 9]        physical GPU pool (block: ref_count, contents)
    seq B  block_table [7, 2, 4]        7: 2  prompt tokens 0..15   (A, B)
                                        2: 2  prompt tokens 16..31  (A, B)
    B was forked from A, then wrote     9: 1  A's last block, partly filled
    into its last block: copy-on-write  4: 1  B's copy of block 9, then B's token
    gave B its own copy (block 4).

Sharing is by reference count: a fork maps the same physical blocks; the first write into a
shared block copies it first (copy-on-write) and the copy is handed to the executors as a
[src, dst] pair. Full blocks whose KV is computed are registered in the prefix cache under a
chained hash, so a later prompt with the same prefix maps them instead of recomputing.

Preemption moves a group's blocks to the CPU pool (swap) or drops them (recompute). Every
operation here is constant time per block touched; nothing scans the pool.
"""
from __future__ import annotations

from typing import Callable, Iterable

from services.scheduler.block_pool import NO_PARENT, BlockPool, CpuBlockPool, hash_block_tokens
from services.scheduler.sequence import Sequence, SequenceStatus


class BlockManager:
    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True, reserve_blocks_per_seq: int = 0,
                 hash_fn: Callable[[int | None, tuple[int, ...]], int] = hash_block_tokens) -> None:
        self.block_size = block_size
        self.gpu = BlockPool(num_gpu_blocks, block_size, hash_fn)
        self.cpu = CpuBlockPool(num_cpu_blocks)
        self.enable_prefix_caching = enable_prefix_caching and reserve_blocks_per_seq == 0
        # Contiguous baseline: a seq's first allocation reserves this many blocks (max_model_len),
        # as systems before PagedAttention did. 0 = paged.
        self.reserve = reserve_blocks_per_seq
        self.swapped_out_blocks_total = 0
        self.swapped_in_blocks_total = 0

    # ------------------------------------------------------------ figures
    @property
    def num_free_blocks(self) -> int:
        return self.gpu.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.gpu.num_used

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (referenced or free-but-revivable)."""
        return len(self.gpu.cached)

    @property
    def num_allocated_slots(self) -> int:
        return self.gpu.num_used * self.block_size

    @property
    def num_filled_slots(self) -> int:
        return self.gpu.num_filled_slots

    @property
    def num_logical_blocks(self) -> int:
        """Block-table entries over all sequences: the blocks needed if nothing were shared."""
        return self.gpu.num_refs

    # ------------------------------------------------------------ growth and copy-on-write
    def num_new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Free blocks that `allocate_slots(seq, num_new_tokens)` will take, at most.

        Counts a copy-on-write whenever the block written first is shared; the last sharer to
        write finds it unshared, so this may exceed the true need by one per shared block.
        """
        table = seq.block_table
        if self.reserve:
            return 0 if table else self.reserve
        start = seq.num_computed_tokens
        need = -(-(start + num_new_tokens) // self.block_size) - len(table)
        j = start // self.block_size
        if j < len(table) and self.gpu.ref_count[table[j]] > 1:
            need += 1
        return need if need > 0 else 0

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[list[int]]:
        """Give slots to positions [num_computed, num_computed + num_new_tokens) of `seq`.

        Returns the copy-on-write pairs [[src, dst]] the executors must apply before writing
        (empty when the written block was not shared). Raises IndexError when the pool runs
        dry: callers check `num_new_blocks` against `num_free_blocks` first.
        """
        bs = self.block_size
        gpu = self.gpu
        table = seq.block_table
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        copies: list[list[int]] = []
        if self.reserve and not table:
            table.extend(gpu.allocate() for _ in range(self.reserve))
        j = start // bs
        if j < len(table):
            old = table[j]
            if gpu.ref_count[old] > 1:   # copy-on-write: never write into a block another seq maps
                new = gpu.allocate()
                gpu.fill(new, gpu.num_tokens[old])
                gpu.release(old)
                table[j] = new
                copies.append([old, new])
                if seq.num_blocks_synced > j:
                    seq.num_blocks_synced = j
        while len(table) * bs < end:
            table.append(gpu.allocate())
        last = (end - 1) // bs
        for k in range(j, last + 1):
            gpu.fill(table[k], bs if k < last else end - k * bs)
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> list[list[int]]:
        """`child` continues from `parent`'s computed tokens, mapping the same blocks.

        Paged: no data moves; returns []. Contiguous baseline: the child gets its own reserved
        region and the parent's filled blocks are copied into it (returned as [src, dst] pairs).
        """
        child.num_computed_tokens = parent.num_computed_tokens
        if self.reserve:
            if child.block_table:
                raise ValueError(f"seq {child.seq_id} already has blocks")
            n_filled = -(-parent.num_computed_tokens // self.block_size)
            child.block_table = [self.gpu.allocate() for _ in range(self.reserve)]
            pairs = []
            for src, dst in zip(parent.block_table[:n_filled], child.block_table):
                self.gpu.fill(dst, self.gpu.num_tokens[src])
                pairs.append([src, dst])
            return pairs
        for b in parent.block_table:
            self.gpu.touch(b)
        child.block_table = list(parent.block_table)
        n_full = parent.num_computed_tokens // self.block_size
        child.block_hashes = parent.block_hashes[:n_full]
        child.num_cached_blocks = min(parent.num_cached_blocks, n_full)
        child.cache_chain_broken = parent.cache_chain_broken
        return []

    def free(self, seq: Sequence) -> None:
        """Drop every block `seq` maps (GPU or, when swapped, CPU). Idempotent."""
        table = seq.block_table
        if table:
            if seq.status == SequenceStatus.SWAPPED:   # the table holds CPU block ids
                for cpu in table:
                    self.cpu.release(cpu)
            else:
                # NOTE: tail blocks first, so that the free list evicts a prompt's last blocks
                # before its first ones (a shorter shared prefix stays cached longer).
                for b in reversed(table):
                    self.gpu.release(b)
        seq.block_table = []
        seq.num_cached_blocks = 0
        seq.cache_chain_broken = False

    # ------------------------------------------------------------ swapping
    def num_unique_blocks(self, seqs: Iterable[Sequence]) -> int:
        """Distinct blocks a group maps: what a swap moves (a block shared inside it moves once)."""
        seen: set[int] = set()
        for s in seqs:
            seen.update(s.block_table)
        return len(seen)

    def can_swap_out(self, seqs: list[Sequence]) -> bool:
        return self.num_unique_blocks(seqs) <= self.cpu.num_free

    def swap_out(self, seqs: list[Sequence]) -> list[list[int]]:
        """Move a group's GPU blocks to the CPU pool; returns [[gpu, cpu], ...]. The tables then
        hold CPU ids. A GPU block also mapped by other groups (a cached prefix) stays for them."""
        mapping: dict[int, int] = {}
        pairs: list[list[int]] = []
        cpu = self.cpu
        for seq in seqs:
            new_table = []
            for b in seq.block_table:
                c = mapping.get(b)
                if c is None:
                    c = mapping[b] = cpu.allocate()
                    cpu.num_tokens[c] = self.gpu.num_tokens[b]
                    pairs.append([b, c])
                else:
                    cpu.ref_count[c] += 1
                new_table.append(c)
            for b in reversed(seq.block_table):
                self.gpu.release(b)
            seq.block_table = new_table
            seq.num_cached_blocks = 0
            seq.cache_chain_broken = False
        self.swapped_out_blocks_total += len(pairs)
        return pairs

    def swap_in(self, seqs: list[Sequence]) -> list[list[int]]:
        """Move a swapped group back into fresh GPU blocks; returns [[cpu, gpu], ...]."""
        mapping: dict[int, int] = {}
        pairs: list[list[int]] = []
        cpu = self.cpu
        for seq in seqs:
            new_table = []
            for c in seq.block_table:
                b = mapping.get(c)
                if b is None:
                    b = mapping[c] = self.gpu.allocate()
                    self.gpu.fill(b, cpu.num_tokens[c])
                    pairs.append([c, b])
                else:
                    self.gpu.touch(b)
                new_table.append(b)
            for c in seq.block_table:
                cpu.release(c)
            seq.block_table = new_table
            seq.num_blocks_synced = 0    # the executors' table is stale: resend it whole
        self.swapped_in_blocks_total += len(pairs)
        return pairs

    # ------------------------------------------------------------ prefix cache
    def _extend_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """Chained hashes of seq's first `num_blocks` full blocks (computed once, then kept)."""
        hashes = seq.block_hashes
        bs = self.block_size
        tokens = seq.token_ids
        hash_fn = self.gpu.hash_fn
        parent = hashes[-1] if hashes else None
        for j in range(len(hashes), num_blocks):
            parent = hash_fn(parent, tuple(tokens[j * bs:(j + 1) * bs]))
            hashes.append(parent)
        return hashes

    def find_cached_prefix(self, seq: Sequence, max_tokens: int) -> list[int]:
        """The longest run of cached blocks holding exactly seq.token_ids[:k * block_size],
        k * block_size <= max_tokens. Pure lookup: nothing is referenced yet."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        n = min(max_tokens, len(seq.token_ids)) // bs
        hashes = self._extend_hashes(seq, n)
        tokens = seq.token_ids
        found: list[int] = []
        parent = NO_PARENT
        for j in range(n):
            b = self.gpu.lookup(hashes[j], tuple(tokens[j * bs:(j + 1) * bs]), parent)
            if b is None:
                break
            found.append(b)
            parent = self.gpu.identity(b)
        return found

    def num_revived(self, blocks: list[int]) -> int:
        """How many of these cached blocks sit on the free list (using them shrinks it)."""
        ref = self.gpu.ref_count
        return sum(1 for b in blocks if ref[b] == 0)

    def use_cached_prefix(self, seq: Sequence, blocks: list[int]) -> int:
        """Map a found cached prefix into `seq` (which holds no blocks yet); returns its tokens."""
        if seq.block_table:
            raise ValueError(f"seq {seq.seq_id} already has blocks")
        for b in blocks:
            self.gpu.touch(b)
        seq.block_table = list(blocks)
        seq.num_computed_tokens = len(blocks) * self.block_size
        seq.num_cached_blocks = len(blocks)
        seq.cache_chain_broken = False
        return seq.num_computed_tokens

    def cache_computed_blocks(self, seq: Sequence, num_tokens: int | None = None) -> None:
        """Register seq's full blocks among its first `num_tokens` tokens (default: its
        computed ones) in the prefix cache.

        The scheduler registers a step's blocks when it schedules the step, with num_tokens =
        the tokens computed once the step has run, so that a prompt admitted later in the same
        step already maps them. NOTE: that is sound because the executors write the K/V of
        every token of the step into the cache before any attention of the same layer reads
        it; if the step fails, the scheduler takes the registrations back (`uncache_blocks`).

        A block is registered only under a registered parent, so a chain in the cache is
        always a real prefix; when that fails (an identical block is already cached, or the
        parent was not), the seq stops trying: later blocks could not be found anyway.
        """
        if not self.enable_prefix_caching or seq.cache_chain_broken:
            return
        bs = self.block_size
        n_full = (seq.num_computed_tokens if num_tokens is None else num_tokens) // bs
        j = seq.num_cached_blocks
        if j >= n_full:
            return
        gpu = self.gpu
        table = seq.block_table
        hashes = self._extend_hashes(seq, n_full)
        tokens = seq.token_ids
        while j < n_full:
            b = table[j]
            if not gpu.is_registered(b) or gpu.block_hash[b] != hashes[j]:
                parent = gpu.identity(table[j - 1]) if j else NO_PARENT
                if gpu.block_hash[b] is not None or not gpu.register(
                        b, hashes[j], tuple(tokens[j * bs:(j + 1) * bs]), parent):
                    seq.cache_chain_broken = True
                    break
            j += 1
        seq.num_cached_blocks = j

    def uncache_blocks(self, seq: Sequence, start: int, end: int) -> None:
        """Take back the prefix-cache entries of seq's blocks [start, end): the step that
        registered them failed (or may fail), so their K/V may never be written."""
        gpu = self.gpu
        table = seq.block_table
        for j in range(start, min(end, len(table))):
            if gpu.is_registered(table[j]):
                gpu.uncache(table[j])
        seq.num_cached_blocks = min(seq.num_cached_blocks, start)
