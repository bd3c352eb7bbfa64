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

Every "how many free blocks would this take" question is answered here, and only here:
`blocks_for` (a step's work), `blocks_to_admit`, `blocks_to_swap_in`, `blocks_to_fork`,
`blocks_freed_by` (a preemption victim) and `max_blocks` (admission control); the
contiguous baseline overrides them (contiguous.py). The allocator knows nothing of the
executors or the wire: what they have seen of a table is the plan builder's business
(services/scheduler/plan.py).
"""
from __future__ import annotations

from itertools import islice
from typing import Callable, Iterable

from services.scheduler.block_pool import NO_PARENT, BlockPool, CpuBlockPool, hash_block_tokens
from services.scheduler.sequence import Sequence, SequenceGroup, SequenceStatus

# NOTE: nearly every allocation is a decode writing into a block its seq owns: no copy. They
# all return this one empty list instead of a new one each; callers never append to it.
_NO_COPIES: list[list[int]] = []


class BlockManager:
    """Paged allocation: a seq takes blocks one at a time, as its tokens need them."""

    # Admission keeps headroom for running seqs to grow (a reserving baseline has none to keep).
    grows_on_demand = True

    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True,
                 hash_fn: Callable[[int | None, tuple[int, ...]], int] = hash_block_tokens) -> None:
        self.block_size = block_size
        self.gpu = BlockPool(num_gpu_blocks, block_size, hash_fn)
        self.cpu = CpuBlockPool(num_cpu_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.swapped_out_blocks_total = 0
        self.swapped_in_blocks_total = 0

    # ------------------------------------------------------------ figures
    # The pools' own figures (used, cached, filled slots, references) are read from `gpu`
    # and `cpu` directly (stats.py); this one is the scheduler's every-step question.
    @property
    def num_free_blocks(self) -> int:
        return self.gpu.num_free

    # ------------------------------------------------------------ counting
    def max_blocks(self, prompt_len: int, max_tokens: int, width: int) -> int:
        """Blocks a group of `width` seqs can hold at its largest (admission control).

        The prompt's full blocks are shared by all its seqs (they fork after them); every other
        block may be private to one seq. A seq never computes its last token (it is sampled,
        then the seq ends), so it needs prompt_len + max_tokens - 1 slots.
        """
        bs = self.block_size
        per_seq = -(-(prompt_len + max_tokens - 1) // bs)
        shared = (prompt_len - 1) // bs
        return shared + width * (per_seq - shared)

    def blocks_for(self, work: list[tuple[Sequence, int]], ref_count: list[int] | None = None
                   ) -> int:
        """Free blocks that `allocate_slots` takes for every (seq, tokens) of `work`: new blocks
        plus exact copy-on-writes. `ref_count`: the pool the tables point into (the GPU's
        unless the seqs are swapped out)."""
        bs = self.block_size
        if ref_count is None:
            ref_count = self.gpu.ref_count
        need = 0
        writers: dict[int, int] | None = None
        for seq, t in work:
            table = seq.block_table
            c = seq.num_computed_tokens
            n = -(-(c + t) // bs) - len(table)
            if n > 0:
                need += n
            j = c // bs
            if j < len(table) and ref_count[table[j]] > 1:
                if writers is None:
                    writers = {}
                writers[table[j]] = writers.get(table[j], 0) + 1
        if writers:
            # A block shared r ways and written by w of them is copied min(w, r - 1) times:
            # the last sharer to write finds it unshared and writes in place.
            for b, w in writers.items():
                need += min(w, ref_count[b] - 1)
        return need

    def blocks_to_admit(self, group: SequenceGroup, budget: int) -> tuple[list[int], int]:
        """(cached prefix blocks, free blocks taken) to admit a waiting group with a first
        chunk of at most `budget` tokens. Looks the prefix up; references nothing yet."""
        bs = self.block_size
        leader = group.seqs[0]
        multi = len(group.seqs) > 1
        target = group.fork_point if multi else len(leader.token_ids)
        cached = []
        if self.enable_prefix_caching and group.prompt_logprobs is None:
            # At least one token is computed: its logits are what we sample from.
            cached = self.find_cached_prefix(leader, min(target, len(leader.token_ids) - 1))
        start = len(cached) * bs
        if multi and start == target:
            # The fork happens right away: every seq computes from the fork point.
            need = 0
            for s in group.seqs:
                t = min(len(s.token_ids) - start, budget)
                budget -= t
                need += -(-(start + t) // bs) - len(cached)
        else:
            t = min(target - start, budget)
            need = -(-(start + t) // bs) - len(cached)
        return cached, need + self.num_revived(cached)

    def blocks_to_swap_in(self, seqs: list[Sequence], work: list[tuple[Sequence, int]]) -> int:
        """Free GPU blocks that swapping `seqs` back in and running `work` take. The blocks
        come back shared as they were: copy-on-write is counted on the CPU side."""
        return self.num_unique_blocks(seqs) + self.blocks_for(work, self.cpu.ref_count)

    def blocks_to_fork(self, group: SequenceGroup) -> int:
        """Free blocks that forking a group's other seqs from its leader takes (none: they map
        the leader's blocks)."""
        return 0

    def blocks_freed_by(self, seqs: list[Sequence]) -> int:
        """GPU blocks that freeing `seqs` returns: those no other seq maps (a cached prefix
        shared with another group stays)."""
        refs: dict[int, int] = {}
        for seq in seqs:
            for b in seq.block_table:
                refs[b] = refs.get(b, 0) + 1
        ref_count = self.gpu.ref_count
        return sum(1 for b, r in refs.items() if ref_count[b] == r)

    # ------------------------------------------------------------ growth and copy-on-write
    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[list[int]] | None:
        """Give slots to positions [num_computed, num_computed + num_new_tokens) of `seq`.

        Returns the copy-on-write pairs [[src, dst]] the executors must apply before writing
        (empty when the written block was not shared; a copy replaces table entry
        num_computed // block_size), or None, changing nothing, when the free blocks do not
        cover it.
        """
        bs = self.block_size
        gpu = self.gpu
        table = seq.block_table
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        j = start // bs
        last = j if num_new_tokens == 1 else (end - 1) // bs
        if last == j < len(table):
            b = table[j]
            if gpu.ref_count[b] == 1:
                gpu.fill(b, end - j * bs)        # most calls: a decode into a block it owns
                return _NO_COPIES
        grow = last + 1 - len(table)
        shared = j < len(table) and gpu.ref_count[table[j]] > 1
        if grow + shared > gpu.free.num_free:
            return None
        copies = _NO_COPIES
        if shared:                 # copy-on-write: never write into a block another seq maps
            old = table[j]
            new = gpu.allocate()
            gpu.fill(new, gpu.num_tokens[old])
            gpu.release(old)
            table[j] = new
            copies = [[old, new]]
        for _ in range(grow):
            table.append(gpu.allocate())
        if last == j:                       # a decode, or a chunk inside one block
            gpu.fill(table[j], end - j * bs)
        else:
            for k in range(j, last + 1):
                gpu.fill(table[k], bs if k < last else end - k * bs)
        return copies

    def decode_slots(self, running: list[SequenceGroup], start: int, limit: int
                     ) -> list[Sequence]:
        """The bulk of a step, in one pass: from running[start] on, at most `limit` groups
        that are one seq with one token to compute, each writing into a block it maps alone
        or opening a fresh one, get that slot (allocate_slots(seq, 1), no copy-on-write),
        and a block the step fills goes into the prefix cache (cache_computed_blocks: its
        earlier blocks are in already, or the seq's chain is broken). Returns their seqs;
        the group after them, if any, takes allocate_slots' way."""
        bs = self.block_size
        gpu = self.gpu
        ref_count = gpu.ref_count
        num_tokens = gpu.num_tokens
        served: list[Sequence] = []
        filled = 0
        for group in islice(running, start, start + limit):
            seqs = group.seqs
            if len(seqs) != 1:
                break
            seq = seqs[0]
            c = seq.num_computed_tokens
            if len(seq.token_ids) - c != 1:
                break
            table = seq.block_table
            j = c // bs
            if j < len(table):
                b = table[j]
                if ref_count[b] != 1:
                    break                      # shared: the write copies it first
                n = c % bs + 1
                if n > num_tokens[b]:
                    filled += n - num_tokens[b]
                    num_tokens[b] = n
            elif self.grows_on_demand and gpu.free.num_free:
                b = gpu.allocate()
                table.append(b)
                n = num_tokens[b] = 1
                filled += 1
            else:
                break
            if n == bs:                        # the step fills the block
                self.cache_computed_blocks(seq, c + 1)
            served.append(seq)
        gpu.num_filled_slots += filled
        return served

    def fork(self, parent: Sequence, child: Sequence) -> list[list[int]]:
        """`child` continues from `parent`'s computed tokens, mapping the same blocks: no data
        moves, so no copy pairs (returns [])."""
        child.num_computed_tokens = parent.num_computed_tokens
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
        gpu, cpu = self.gpu, self.cpu

        def to_cpu(b: int) -> int:
            c = cpu.allocate()
            cpu.num_tokens[c] = gpu.num_tokens[b]
            return c

        # NOTE: tail blocks released first, as in free(): a prompt's last blocks leave the
        # prefix cache before its first ones.
        pairs = self._move(seqs, to_cpu, cpu.share, gpu.release)
        for seq in seqs:
            seq.num_cached_blocks = 0
            seq.cache_chain_broken = False
        self.swapped_out_blocks_total += len(pairs)
        return pairs

    def swap_in(self, seqs: list[Sequence]) -> list[list[int]]:
        """Move a swapped group back into fresh GPU blocks; returns [[cpu, gpu], ...]."""
        gpu, cpu = self.gpu, self.cpu

        def to_gpu(c: int) -> int:
            b = gpu.allocate()
            gpu.fill(b, cpu.num_tokens[c])
            return b

        pairs = self._move(seqs, to_gpu, gpu.touch, cpu.release)
        self.swapped_in_blocks_total += len(pairs)
        return pairs

    @staticmethod
    def _move(seqs: list[Sequence], copy: Callable[[int], int], share: Callable[[int], None],
              release: Callable[[int], None]) -> list[list[int]]:
        """Re-map the seqs' tables into the other pool: each distinct block is copied once
        (`copy` returns its new id; a block shared inside the group stays shared: `share`),
        then the old entries are released, tail first. Returns the [old, new] pairs."""
        mapping: dict[int, int] = {}
        pairs: list[list[int]] = []
        for seq in seqs:
            new_table = []
            for old in seq.block_table:
                new = mapping.get(old)
                if new is None:
                    new = mapping[old] = copy(old)
                    pairs.append([old, new])
                else:
                    share(new)
                new_table.append(new)
            for old in reversed(seq.block_table):
                release(old)
            seq.block_table = new_table
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
        it; if the step fails, the scheduler takes the registrations back (`uncache_scheduled`).

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
            h = gpu.block_hash[b]
            if h is None:                       # not in the cache yet: register it
                parent = gpu.identity(table[j - 1]) if j else NO_PARENT
                if not gpu.register(b, hashes[j], tuple(tokens[j * bs:(j + 1) * bs]), parent):
                    seq.cache_chain_broken = True
                    break
            elif h != hashes[j] or gpu.cached.get(h) != b:      # it holds another prefix
                seq.cache_chain_broken = True
                break
            j += 1
        seq.num_cached_blocks = j

    def uncache_scheduled(self, seq: Sequence) -> None:
        """Take back the prefix-cache entries of the blocks seq's step in flight fills: that
        step failed, or seq was aborted while it runs, so their K/V may never be written."""
        if not seq.num_scheduled_tokens:
            return
        bs = self.block_size
        start = seq.num_computed_tokens // bs
        end = (seq.num_computed_tokens + seq.num_scheduled_tokens) // bs
        gpu = self.gpu
        table = seq.block_table
        for j in range(start, min(end, len(table))):
            if gpu.is_registered(table[j]):
                gpu.uncache(table[j])
        seq.num_cached_blocks = min(seq.num_cached_blocks, start)
