"""Property-based stateful tests of the block manager: every invariant, after every step.

The machine drives a real BlockManager with random allocate / append / a decode step of every
sequence / fork / free / swap out / swap in / prefix hit / evict / abort, and keeps a shadow
of the KV pools, copies and swaps applied as the executors would. Like real K/V, a shadow slot depends on the whole prefix: it
holds the tuple of tokens up to and including its position. After every step:

- a block is on the free list iff its ref count is 0 and no table maps it, and each block's
  ref count equals the table entries mapping it (so their sums agree);
- only the last block of a sequence is partly filled;
- reading any sequence back through its table gives exactly its tokens, so no write ever
  landed in a block another sequence still maps (copy-on-write), no swap lost a block, and no
  cached prefix was reused for different tokens (a second machine forces hash collisions);
- when every sequence is gone, no block is in use.
"""
from __future__ import annotations

import itertools
from types import SimpleNamespace

from hypothesis import HealthCheck, assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.scheduler.block_manager import BlockManager
from services.scheduler.sequence import Sequence, SequenceStatus

BS = 4
NUM_GPU = 24
NUM_CPU = 12
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=20)   # tiny alphabet: many hits


class BlockManagerMachine(RuleBasedStateMachine):
    hash_fn = None   # None: the real chained hash

    def __init__(self) -> None:
        super().__init__()
        kw = {} if self.hash_fn is None else {"hash_fn": type(self).hash_fn}
        self.bm = BlockManager(NUM_GPU, NUM_CPU, BS, enable_prefix_caching=True, **kw)
        self.gpu_data = [[None] * BS for _ in range(NUM_GPU)]
        self.cpu_data = [[None] * BS for _ in range(NUM_CPU)]
        self.running: list[list[Sequence]] = []     # families: a seq and its forks
        self.swapped: list[list[Sequence]] = []
        self.history: list[list[int]] = []
        self.next_id = 0
        self.hits = 0

    # ------------------------------------------------------------ helpers
    def _seq(self, tokens: list[int]) -> Sequence:
        s = Sequence(self.next_id, None, tokens, len(tokens))
        s.status = SequenceStatus.RUNNING
        self.next_id += 1
        return s

    def _compute(self, seq: Sequence, n: int) -> bool:
        """Allocate slots for n more tokens, apply copy-on-write, write the tokens."""
        if self.bm.blocks_for([(seq, n)]) > self.bm.num_free_blocks:
            return False
        start = seq.num_computed_tokens
        j = start // BS
        shared_before = (j < len(seq.block_table)
                         and self.bm.gpu.ref_count[seq.block_table[j]] > 1)
        old = seq.block_table[j] if j < len(seq.block_table) else None
        copies = self.bm.allocate_slots(seq, n)
        if shared_before:   # the write must go to a fresh copy, never to the shared block
            assert copies == [[old, seq.block_table[j]]] and seq.block_table[j] != old
        else:
            assert copies == []
        for src, dst in copies:
            self.gpu_data[dst] = list(self.gpu_data[src])
        for pos in range(start, start + n):
            self.gpu_data[seq.block_table[pos // BS]][pos % BS] = tuple(seq.token_ids[:pos + 1])
        seq.num_computed_tokens = start + n
        self.bm.cache_computed_blocks(seq)
        return True

    def _all_running(self):
        return [s for fam in self.running for s in fam]

    # ------------------------------------------------------------ rules
    @rule(tokens=tokens_st, reuse=st.integers(0, 99), use_cache=st.booleans())
    def allocate(self, tokens, reuse, use_cache):
        if self.history and reuse < 60:   # start from an earlier prompt: a prefix hit
            base = self.history[reuse % len(self.history)]
            tokens = base[:len(base) * (reuse % 4 + 1) // 4] + tokens
        seq = self._seq(list(tokens))
        cached = self.bm.find_cached_prefix(seq, len(tokens) - 1) if use_cache else []
        for j, b in enumerate(cached):   # a hit holds exactly this prefix
            assert self.gpu_data[b] == [tuple(tokens[:p + 1])
                                                 for p in range(j * BS, (j + 1) * BS)]
        need = -(-len(tokens) // BS) - len(cached) + self.bm.num_revived(cached)
        assume(need <= self.bm.num_free_blocks)
        self.bm.use_cached_prefix(seq, cached)
        self.hits += len(cached)
        assert self._compute(seq, len(tokens) - seq.num_computed_tokens)
        self.history.append(list(tokens))
        self.running.append([seq])

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 99), new=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def append(self, i, new):
        fam = self.running[i % len(self.running)]
        seq = fam[i % len(fam)]
        seq.token_ids.extend(new)
        assume(self._compute(seq, len(new)))

    @precondition(lambda self: self.running)
    @rule(new=st.lists(st.integers(0, 2), min_size=1, max_size=8), limit=st.integers(1, 8))
    def decode_step(self, new, limit):
        """One token for every running seq, as the scheduler runs a step: decode_slots
        serves runs of one-seq families; the family it stops at (several seqs, a shared
        block, no free block) goes through allocate_slots. Writes land where they say."""
        groups = [SimpleNamespace(seqs=fam) for fam in self.running]
        for fam, token in zip(self.running, itertools.cycle(new)):
            for s in fam:
                s.token_ids.append(token)
        i = 0
        while i < len(groups):
            served = self.bm.decode_slots(groups, i, limit)
            assert len(served) <= limit
            for k, seq in enumerate(served):
                assert groups[i + k].seqs == [seq]
                pos = seq.num_computed_tokens
                self.gpu_data[seq.block_table[pos // BS]][pos % BS] = tuple(seq.token_ids)
                seq.num_computed_tokens = pos + 1
                self.bm.cache_computed_blocks(seq)
            i += len(served)
            if i < len(groups):
                for s in groups[i].seqs:
                    if not self._compute(s, 1):
                        s.token_ids.pop()          # no room: this seq sits the step out
                i += 1

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 99), apart=st.booleans())
    def fork(self, i, apart):
        """`apart`: the child is a family of its own (two one-seq families share a partly
        filled block: a decode into it must copy it first)."""
        fam = self.running[i % len(self.running)]
        parent = fam[i % len(fam)]
        child = self._seq(list(parent.token_ids))
        before = list(parent.block_table)
        assert self.bm.fork(parent, child) == []          # sharing moves no data
        assert child.block_table == before
        if apart:
            self.running.append([child])
        else:
            fam.append(child)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 99))
    def free_one(self, i):
        fam = self.running[i % len(self.running)]
        seq = fam.pop(i % len(fam))
        self.bm.free(seq)
        if not fam:
            self.running.remove(fam)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 99))
    def swap_out(self, i):
        fam = self.running[i % len(self.running)]
        unique = {b for s in fam for b in s.block_table}
        assume(self.bm.can_swap_out(fam))
        pairs = self.bm.swap_out(fam)
        assert sorted(g for g, _ in pairs) == sorted(unique)   # a shared block moves once
        for g, c in pairs:
            self.cpu_data[c] = list(self.gpu_data[g])
        for s in fam:
            s.status = SequenceStatus.SWAPPED
        self.running.remove(fam)
        self.swapped.append(fam)

    @precondition(lambda self: self.swapped)
    @rule(i=st.integers(0, 99))
    def swap_in(self, i):
        fam = self.swapped[i % len(self.swapped)]
        assume(self.bm.num_unique_blocks(fam) <= self.bm.num_free_blocks)
        pairs = self.bm.swap_in(fam)
        for c, g in pairs:
            self.gpu_data[g] = list(self.cpu_data[c])
        for s in fam:
            s.status = SequenceStatus.RUNNING
        self.swapped.remove(fam)
        self.running.append(fam)

    @precondition(lambda self: self.running or self.swapped)
    @rule(i=st.integers(0, 99))
    def abort(self, i):
        fams = self.running + self.swapped
        fam = fams[i % len(fams)]
        for s in fam:
            self.bm.free(s)
        (self.running if fam in self.running else self.swapped).remove(fam)

    @precondition(lambda self: self.bm.num_free_blocks > 0)
    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def evict(self, tokens):
        """A seq that takes every free block: cached blocks on the free list get evicted."""
        free = self.bm.num_free_blocks
        seq = self._seq((tokens * (free * BS))[:free * BS])
        assert self._compute(seq, free * BS)
        assert self.bm.num_free_blocks == 0
        self.bm.free(seq)

    # ------------------------------------------------------------ invariants
    @invariant()
    def tables_and_ref_counts_agree(self):
        gpu = self.bm.gpu
        maps = [0] * NUM_GPU
        for s in self._all_running():
            for b in s.block_table:
                maps[b] += 1
        on_free_list = list(gpu.free)
        assert len(on_free_list) == len(set(on_free_list)) == gpu.num_free
        for b in range(NUM_GPU):
            assert gpu.ref_count[b] == maps[b]
            assert (b in on_free_list) == (gpu.ref_count[b] == 0) == (maps[b] == 0)
        assert gpu.num_refs == sum(maps) == sum(gpu.ref_count)
        assert gpu.num_filled_slots == sum(n for n, r in zip(gpu.num_tokens, gpu.ref_count) if r)
        for h, b in gpu.cached.items():
            assert gpu.block_hash[b] == h and gpu.num_tokens[b] == BS

    @invariant()
    def cpu_pool_agrees(self):
        cpu = self.bm.cpu
        maps = [0] * NUM_CPU
        for fam in self.swapped:
            for s in fam:
                for c in s.block_table:
                    maps[c] += 1
        assert cpu.ref_count == maps
        assert set(cpu.free_ids) == {c for c in range(NUM_CPU) if maps[c] == 0}

    @invariant()
    def only_last_block_partly_filled(self):
        filled = self.bm.gpu.num_tokens
        for s in self._all_running():
            t = s.block_table
            assert len(t) == -(-s.num_computed_tokens // BS)
            for b in t[:-1]:
                assert filled[b] == BS
            if t:
                assert filled[t[-1]] == s.num_computed_tokens - (len(t) - 1) * BS

    @invariant()
    def every_seq_reads_back_its_prefix(self):
        def expected(s):
            return [tuple(s.token_ids[:p + 1]) for p in range(s.num_computed_tokens)]
        for s in self._all_running():
            got = [kv for b in s.block_table for kv in self.gpu_data[b]]
            assert got[:s.num_computed_tokens] == expected(s)
        for fam in self.swapped:
            for s in fam:
                got = [kv for c in s.block_table for kv in self.cpu_data[c]]
                assert got[:s.num_computed_tokens] == expected(s)

    def teardown(self):
        for fam in self.running + self.swapped:
            for s in fam:
                self.bm.free(s)
        assert self.bm.gpu.num_used == 0
        assert self.bm.gpu.num_refs == 0 and self.bm.gpu.num_filled_slots == 0
        assert self.bm.cpu.num_used == 0


class CollidingHashMachine(BlockManagerMachine):
    """A hash that ignores the parent and the block's first token: equal blocks after
    different prefixes collide, and so do blocks differing in their first token. Only the
    token and parent comparison on a hit stands between a lookup and a wrong reuse.
    (Checked: dropping either comparison from BlockPool.lookup makes this machine fail.)"""

    @staticmethod
    def hash_fn(parent, tokens):
        return hash(tokens[1:])


_settings = settings(max_examples=100, stateful_step_count=50, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestBlockManagerInvariants = BlockManagerMachine.TestCase
TestBlockManagerInvariants.settings = _settings
TestPrefixCacheUnderHashCollisions = CollidingHashMachine.TestCase
TestPrefixCacheUnderHashCollisions.settings = _settings
