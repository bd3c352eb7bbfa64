"""CUDA graphs of the decode forward: one per padded batch size, replayed each decode step.

A decode step of a small model is bound by the host, not the GPU: SmolLM2's 30 layers
launch several hundred kernels per step, and their Python and launch overhead outlasts the
GPU's work (loadtest/profile_step.py shows the split; docs/executor.md). A graph replays
all of them with one launch.

A graph fixes every tensor address and shape, so the inputs live in static buffers sized
for the largest batch, and each step copies its values in:

    ids, positions [B]        the token and its position, per sequence
    slots [B]                 where the step's K/V go; padding rows get -1 (not written)
    tables [B, max_blocks]    block tables, as wide as the longest context a graph serves
    seq_lens [B]              context lengths; padding rows see one key (block 0)
    query_start_loc [B + 1]   0..B: one query per sequence

A batch of n runs the graph of the smallest captured size >= n (1, 2, 4, 8, then multiples
of 16); its extra rows are padding whose outputs are dropped. The attention kernel's launch
plan depends only on shapes, so it is the same at every replay: the context split count
comes from the fixed table width, and splits past a sequence's context exit at once.

Graphs are captured on first use of a size (two warm-up forwards and the capture), share
one memory pool, and are replayed one at a time: each replay's output is consumed before
the next. Steps with a prefill chunk, more sequences than the largest size, or a context
longer than the graph tables run eagerly.
"""
from __future__ import annotations

import logging

import torch

from services.executor.attention import AttentionMetadata

log = logging.getLogger(__name__)

GRAPH_MAX_CONTEXT = 8192   # tokens: wider tables cost every replay more split programs


class GraphCaptureError(RuntimeError):
    """Capturing a decode graph failed; the runner goes on without graphs."""


def graph_sizes(max_batch: int) -> list[int]:
    """The padded batch sizes: 1, 2, 4, 8, then every multiple of 16 up to max_batch."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, model, kv_cache: torch.Tensor, block_size: int, max_model_len: int,
                 max_batch: int) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.max_context = min(max_model_len, GRAPH_MAX_CONTEXT)
        self.max_blocks = -(-self.max_context // block_size)
        self.sizes = graph_sizes(max_batch)
        self.max_batch = max_batch
        dev = kv_cache.device
        self.ids = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.slots = torch.full((max_batch,), -1, dtype=torch.int64, device=dev)
        self.tables = torch.zeros((max_batch, self.max_blocks), dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.replays = 0            # decode steps served by a graph (tests, metrics)

    def fits(self, num_seqs: int, longest_context: int) -> bool:
        return num_seqs <= self.max_batch and longest_context <= self.max_context

    def forward(self, ids: list[int], positions: list[int],
                tables: list[list[int]]) -> torch.Tensor:
        """Hidden states [n, H] of n decodes: ids[i] at positions[i] of the sequence whose
        block table is tables[i] (covering that position)."""
        n = len(ids)
        size = next(s for s in self.sizes if s >= n)
        if size not in self.graphs:
            self._capture(size)
        bs = self.block_size
        pad = size - n
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)]
        width = max(p // bs for p in positions) + 1
        rows = [t[:width] + [0] * (width - min(len(t), width)) for t in tables]
        # Columns past `width` keep older values: the kernel never reads a table entry
        # past its sequence's context.
        self.tables[:n, :width].copy_(torch.tensor(rows, dtype=torch.int32))
        if pad:
            self.tables[n:size, 0] = 0
        self.ids[:size].copy_(torch.tensor(ids + [0] * pad, dtype=torch.int64))
        self.positions[:size].copy_(torch.tensor(positions + [0] * pad, dtype=torch.int64))
        self.slots[:size].copy_(torch.tensor(slots + [-1] * pad, dtype=torch.int64))
        self.seq_lens[:size].copy_(torch.tensor([p + 1 for p in positions] + [1] * pad,
                                                dtype=torch.int32))
        self.graphs[size].replay()
        self.replays += 1
        return self.outputs[size][:n]

    def _run_model(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(slot_mapping=self.slots[:size], block_tables=self.tables[:size],
                                 seq_lens=self.seq_lens[:size],
                                 query_start_loc=self.query_start_loc[:size + 1])
        meta.positions = self.positions[:size]
        return self.model.forward(self.ids[:size], meta.positions, meta, self.kv_cache)

    def _capture(self, size: int) -> None:
        """Warm up (compiles kernels, sets up cuBLAS) and capture the graph of `size` rows,
        on inputs that write nothing: every slot -1, every context one key of block 0."""
        self.slots[:size] = -1
        self.seq_lens[:size] = 1
        self.tables[:size] = 0
        self.ids[:size] = 0
        self.positions[:size] = 0
        stream = torch.cuda.Stream(self.kv_cache.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._run_model(size)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: another thread's CUDA calls (metrics, health) cannot break it
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                out = self._run_model(size)
        except RuntimeError as exc:
            raise GraphCaptureError(f"capturing the decode graph of {size} rows: {exc}") from exc
        self.pool = graph.pool()
        self.graphs[size] = graph
        self.outputs[size] = out
        log.info("captured the decode CUDA graph for %d sequences", size)
