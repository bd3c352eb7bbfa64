"""Block manager behaviours, one at a time (the stateful property test mixes them all)."""
from __future__ import annotations

from services.scheduler.block_manager import BlockManager
from services.scheduler.contiguous import ContiguousBlockManager
from services.scheduler.sequence import Sequence, SequenceStatus

BS = 4


def make_seq(tokens, seq_id=0) -> Sequence:
    seq = Sequence(seq_id, None, list(tokens), len(tokens))
    seq.status = SequenceStatus.RUNNING
    return seq


def compute(bm: BlockManager, seq: Sequence, n: int | None = None) -> list[list[int]]:
    """Allocate and 'run' the next n tokens of seq (all the rest by default)."""
    n = len(seq.token_ids) - seq.num_computed_tokens if n is None else n
    copies = bm.allocate_slots(seq, n)
    seq.num_computed_tokens += n
    bm.cache_computed_blocks(seq)
    return copies


def computed_pair(bm: BlockManager, n: int) -> tuple[Sequence, Sequence]:
    """A seq of n computed tokens and a fork of it (sharing all its blocks)."""
    parent = make_seq(range(n))
    compute(bm, parent)
    child = make_seq(range(n), 1)
    bm.fork(parent, child)
    return parent, child


def test_fork_shares_blocks_until_write():
    bm = BlockManager(16, 4, BS)
    parent = make_seq(range(6))
    compute(bm, parent)
    child = make_seq(range(6), 1)
    assert bm.fork(parent, child) == []
    assert child.block_table == parent.block_table
    assert [bm.gpu.ref_count[b] for b in parent.block_table] == [2, 2]
    assert bm.gpu.num_used == 2 and bm.gpu.num_refs == 4

    child.token_ids.append(99)
    copies = compute(bm, child, 1)        # writes into the shared, partly filled block
    assert copies == [[parent.block_table[1], child.block_table[1]]]
    assert child.block_table[0] == parent.block_table[0]     # the full block stays shared
    assert bm.gpu.num_used == 3

    parent.token_ids.append(7)
    assert compute(bm, parent, 1) == []   # now the only owner: written in place


def test_copy_on_write_copies_once_per_extra_sharer():
    bm = BlockManager(16, 4, BS)
    seqs = [make_seq(range(5), i) for i in range(3)]
    compute(bm, seqs[0])
    for s in seqs[1:]:
        bm.fork(seqs[0], s)
    shared = seqs[0].block_table[1]
    copies = []
    for i, s in enumerate(seqs):
        s.token_ids.append(i)
        copies += compute(bm, s, 1)
    # the first two writers copy; the last finds the block unshared and writes in place
    assert [src for src, _ in copies] == [shared, shared]
    assert seqs[2].block_table[1] == shared
    assert len({s.block_table[1] for s in seqs}) == 3


def test_blocks_for_counts_growth_and_copy_on_write():
    bm = BlockManager(16, 4, BS)
    a = make_seq(range(4))
    assert bm.blocks_for([(a, 4)]) == 1 and bm.blocks_for([(a, 5)]) == 2
    compute(bm, a)
    b = make_seq(range(4), 1)
    bm.fork(a, b)
    b.token_ids.append(1)
    assert bm.blocks_for([(b, 1)]) == 1   # a fresh block, the full one stays shared
    c = make_seq(range(3), 2)
    compute(bm, c)
    d = make_seq(range(3), 3)
    bm.fork(c, d)
    d.token_ids.append(1)
    assert bm.blocks_for([(d, 1)]) == 1   # the copy of the shared partial block
    c.token_ids.append(2)
    # Both sharers write the shared partial block: one copy; the second finds it unshared.
    assert bm.blocks_for([(c, 1), (d, 1)]) == 1


def test_allocate_slots_changes_nothing_when_the_pool_is_short():
    bm = BlockManager(2, 0, BS)
    a = make_seq(range(9))
    assert bm.allocate_slots(a, 9) is None            # 3 blocks, 2 in the pool
    assert a.block_table == [] and bm.num_free_blocks == 2
    assert bm.allocate_slots(a, 8) == [] and len(a.block_table) == 2


def test_blocks_freed_by_counts_only_blocks_no_one_else_maps():
    bm = BlockManager(16, 4, BS)
    a, b = computed_pair(bm, 10)
    b.token_ids.append(3)
    compute(bm, b, 1)                                  # copy-on-write of the partial block
    assert bm.blocks_freed_by([b]) == 1 and bm.blocks_freed_by([a]) == 1
    assert bm.blocks_freed_by([a, b]) == 4


def test_prefix_cache_reuses_the_blocks_of_an_identical_prefix():
    bm = BlockManager(16, 4, BS)
    a = make_seq(range(10))
    compute(bm, a)
    first_blocks = a.block_table[:2]
    bm.free(a)
    assert bm.gpu.num_used == 0 and len(bm.gpu.cached) == 2   # free but revivable

    b = make_seq([*range(8), 50, 51])
    hit = bm.find_cached_prefix(b, len(b.token_ids) - 1)
    assert hit == first_blocks
    assert bm.num_revived(hit) == 2
    assert bm.use_cached_prefix(b, hit) == 8
    assert bm.gpu.num_used == 2

    c = make_seq([0, 1, 2, 3, 60, 61, 62, 63, 64])
    assert bm.find_cached_prefix(c, 8) == first_blocks[:1]


def test_a_prompt_never_hits_its_own_last_token():
    bm = BlockManager(16, 4, BS)
    a = make_seq(range(8))
    compute(bm, a)
    b = make_seq(range(8), 1)
    # the scheduler asks for at most len - 1 tokens: the last one must run to give logits
    assert len(bm.find_cached_prefix(b, len(b.token_ids) - 1)) == 1


def test_hash_collision_is_rejected_by_the_token_compare():
    bm = BlockManager(16, 4, BS, hash_fn=lambda parent, tokens: 42)   # everything collides
    a = make_seq([1, 2, 3, 4, 5])
    compute(bm, a)
    assert len(bm.gpu.cached) == 1
    other = make_seq([9, 9, 9, 9, 5], 1)
    assert bm.find_cached_prefix(other, 4) == []      # same hash, other tokens: a miss
    same = make_seq([1, 2, 3, 4, 5], 2)
    assert bm.find_cached_prefix(same, 4) == a.block_table[:1]


def test_equal_block_after_a_different_prefix_is_not_reused():
    # A hash blind to the parent: block (2, 2, 2, 2) collides whatever precedes it.
    bm = BlockManager(16, 4, BS, hash_fn=lambda parent, tokens: hash(tokens))
    a = make_seq([1, 1, 1, 1, 2, 2, 2, 2, 0])
    compute(bm, a)
    c = make_seq([3, 3, 3, 3, 9], 1)
    compute(bm, c)
    b = make_seq([3, 3, 3, 3, 2, 2, 2, 2, 0], 2)
    # block 0 is c's; block 1 has a's tokens but was computed after a's first block
    assert bm.find_cached_prefix(b, 8) == c.block_table[:1]


def test_unreferenced_cached_blocks_are_evicted_least_recently_freed_first():
    bm = BlockManager(4, 0, BS)
    a = make_seq(range(8))
    compute(bm, a)
    b = make_seq(range(100, 108), 1)
    compute(bm, b)
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 4 and len(bm.gpu.cached) == 4
    probe_a = make_seq(range(9), 2)
    assert len(bm.find_cached_prefix(probe_a, 8)) == 2
    # One new block evicts a's *last* block (a was freed first, its tail blocks first).
    x = make_seq(range(200, 203), 3)
    compute(bm, x)
    assert len(bm.find_cached_prefix(probe_a, 8)) == 1
    probe_b = make_seq(range(100, 109), 4)
    assert len(bm.find_cached_prefix(probe_b, 8)) == 2
    # Reviving b's blocks takes them out of the middle of the free list.
    bm.use_cached_prefix(probe_b, bm.find_cached_prefix(probe_b, 8))
    assert bm.num_free_blocks == 1


def test_swap_out_moves_a_block_shared_inside_a_group_once():
    bm = BlockManager(16, 8, BS)
    parent, child = computed_pair(bm, 6)
    group = [parent, child]
    assert bm.can_swap_out(group)
    pairs = bm.swap_out(group)
    assert len(pairs) == 2 and bm.cpu.num_used == 2 and bm.gpu.num_used == 0
    assert parent.block_table == child.block_table        # CPU ids, still shared
    for s in group:
        s.status = SequenceStatus.SWAPPED
    back = bm.swap_in(group)
    assert len(back) == 2 and bm.cpu.num_used == 0
    assert parent.block_table == child.block_table
    assert [bm.gpu.ref_count[b] for b in parent.block_table] == [2, 2]


def test_swapping_out_keeps_a_prefix_other_requests_still_map():
    bm = BlockManager(16, 8, BS)
    a = make_seq(range(9))
    compute(bm, a)
    b = make_seq([*range(8), 77])
    bm.use_cached_prefix(b, bm.find_cached_prefix(b, 8))
    compute(bm, b)
    shared = a.block_table[:2]
    assert b.block_table[:2] == shared
    gpu_table = list(b.block_table)
    pairs = bm.swap_out([b])
    assert [g for g, _ in pairs] == gpu_table       # b takes a CPU copy of all three
    assert [bm.gpu.ref_count[x] for x in shared] == [1, 1]     # a keeps them
    assert bm.cpu.num_used == 3


def test_contiguous_baseline_reserves_max_model_len_up_front():
    bm = ContiguousBlockManager(64, 0, BS, blocks_per_seq=8)
    seq = make_seq(range(3))
    assert bm.blocks_for([(seq, 3)]) == 8
    compute(bm, seq)
    assert len(seq.block_table) == 8
    assert bm.gpu.num_used * bm.block_size == 32 and bm.gpu.num_filled_slots == 3
    seq.token_ids.append(5)
    assert bm.blocks_for([(seq, 1)]) == 0
    compute(bm, seq, 1)
    assert bm.gpu.num_used == 8 and bm.gpu.num_filled_slots == 4
    child = make_seq(range(4), 1)
    pairs = bm.fork(seq, child)                       # no sharing: a copy of what is filled
    assert pairs == [[seq.block_table[0], child.block_table[0]]]
    assert bm.gpu.num_used == 16


def test_freeing_everything_leaves_no_block_in_use():
    bm = BlockManager(32, 8, BS)
    seqs = []
    for i in range(4):
        s = make_seq([*range(8), i, i], i)
        s_hit = bm.find_cached_prefix(s, 9)
        bm.use_cached_prefix(s, s_hit)
        compute(bm, s)
        seqs.append(s)
    for s in seqs:
        bm.free(s)
    assert bm.gpu.num_used == 0 and bm.gpu.num_refs == 0 and bm.gpu.num_filled_slots == 0
    assert len(bm.gpu.cached) > 0      # cached-but-unreferenced blocks count as free
