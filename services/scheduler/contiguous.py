"""The contiguous baseline PagedAttention is measured against, and the choice between it
and the paged block manager (block_manager.py) that a SchedulerConfig asks for."""
from __future__ import annotations

from services.scheduler.block_manager import BlockManager
from services.scheduler.config import SchedulerConfig
from services.scheduler.sequence import Sequence, SequenceGroup


class ContiguousBlockManager(BlockManager):
    """The baseline PagedAttention is measured against: a seq's first allocation reserves a
    contiguous region for its whole context (max_model_len), as systems before it did. No
    sharing, so no prefix cache and no copy-on-write; a fork copies the filled blocks."""

    grows_on_demand = False

    def __init__(self, num_gpu_blocks: int, num_cpu_blocks: int, block_size: int,
                 blocks_per_seq: int) -> None:
        super().__init__(num_gpu_blocks, num_cpu_blocks, block_size, enable_prefix_caching=False)
        self.blocks_per_seq = blocks_per_seq

    def max_blocks(self, prompt_len: int, max_tokens: int, width: int) -> int:
        return width * self.blocks_per_seq

    def blocks_for(self, work: list[tuple[Sequence, int]], ref_count: list[int] | None = None
                   ) -> int:
        return sum(self.blocks_per_seq for s, _ in work if not s.block_table)

    def blocks_to_admit(self, group: SequenceGroup, budget: int) -> tuple[list[int], int]:
        forks_now = len(group.seqs) > 1 and group.fork_point == 0
        return [], self.blocks_per_seq * (len(group.seqs) if forks_now else 1)

    def blocks_to_fork(self, group: SequenceGroup) -> int:
        return self.blocks_per_seq * (len(group.seqs) - 1)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[list[int]] | None:
        if not seq.block_table:
            if self.blocks_per_seq > self.gpu.num_free:
                return None
            seq.block_table = [self.gpu.allocate() for _ in range(self.blocks_per_seq)]
        return super().allocate_slots(seq, num_new_tokens)    # only fills: the region is there

    def fork(self, parent: Sequence, child: Sequence) -> list[list[int]]:
        """The child gets its own region; the parent's filled blocks are copied into it
        (returned as [src, dst] pairs)."""
        if child.block_table:
            raise ValueError(f"seq {child.seq_id} already has blocks")
        child.num_computed_tokens = parent.num_computed_tokens
        n_filled = -(-parent.num_computed_tokens // self.block_size)
        child.block_table = [self.gpu.allocate() for _ in range(self.blocks_per_seq)]
        pairs = []
        for src, dst in zip(parent.block_table[:n_filled], child.block_table):
            self.gpu.fill(dst, self.gpu.num_tokens[src])
            pairs.append([src, dst])
        return pairs


def block_manager_for(config: SchedulerConfig, num_gpu_blocks: int,
                      num_cpu_blocks: int) -> BlockManager:
    """The block manager `config` asks for, over pools of these sizes: the paged one, or
    the contiguous baseline. Raises ValueError when there is no GPU block at all."""
    if num_gpu_blocks < 1:
        raise ValueError("the executor reported no GPU KV blocks: give it more memory")
    num_cpu_blocks = max(0, num_cpu_blocks)
    if config.contiguous:
        return ContiguousBlockManager(num_gpu_blocks, num_cpu_blocks, config.block_size,
                                      config.max_blocks_per_seq)
    return BlockManager(num_gpu_blocks, num_cpu_blocks, config.block_size,
                        config.enable_prefix_caching)
