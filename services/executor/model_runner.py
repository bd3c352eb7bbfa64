"""ModelRunner: executes one StepPlan (cache ops, forward, sampling) and keeps per-seq state.

    execute(plan)
      1. drop finished_seq_ids, register new_seqs
      2. per row of the plan: append tokens, apply the block-table diff (keep, append)
      3. cache ops in order: swap_out, swap_in, copy
      4. one forward over the flat batch, rows in plan order (the plan puts decodes first);
         row r runs tokens[num_computed[r] : num_computed[r] + num_tokens[r]] of its seq
      5. LM head on the rows that sample (the first num_sampling_rows) or want prompt
         logprobs only; sample
      6. StepResult, positional: token_ids[r] is row r's sample

The runner never decides policy: it trusts the plan, checks it only enough to fail
with a clear StepResult.error instead of corrupting memory.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from services.executor.attention import (AttentionMetadata, pick_decode_heads,
                                         pick_prefill_paths)
from services.executor.config import ExecutorConfig, ExecutorConfigError
from services.executor.cpu_gemm import auto_cpu_dtype
from services.executor.cuda_graphs import DecodeGraphs, GraphCaptureError
from services.executor.kv_cache import GIB, KVCache, block_bytes, blocks_in, gpu_kv_budget_bytes
from services.executor.model_loader import ensure_hf_folder, load_model, read_args
from services.executor.parallel import ProcessGroup, Shard
from services.executor.sampler import Sampler, SampleRow, TokenMask
from shared.messages import NewSeq, SamplingParams, StepPlan, StepResult, TokenLogprob
from shared.model_source import resolve_model

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PlanError(ValueError):
    """The plan contradicts the executor's state (unknown seq, block table too short, ...)."""


@dataclass(slots=True)
class SeqState:
    """What the executor remembers about one sequence between steps."""

    request_id: str
    token_ids: list[int]           # prompt + outputs appended by the scheduler
    prompt_len: int
    block_table: list[int]         # logical block -> physical block of the GPU pool
    sampling: SamplingParams
    sample_index: int
    # Prompt logprob of position `pending_pos`, computed from the last row of the previous
    # chunk; reported with the chunk that computes that position.
    pending_prompt_lp: TokenLogprob | None = None
    pending_pos: int = -1
    # The token this rank sampled for it in its last step (-1: none, or that step failed):
    # a plan planned ahead appends -1 for it (shared/messages.py, StepPlan).
    last_sampled: int = -1


def host_memory_available() -> int | None:
    """Bytes of memory the host can give without swapping (MemAvailable of /proc/meminfo),
    or None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class ModelRunner:
    def __init__(self, config: ExecutorConfig) -> None:
        config.validate()
        self.config = config
        tp = config.tensor_parallel_size
        self.device = _resolve_device(config.device, config.rank)
        threads = config.num_threads
        if self.device.type == "cpu" and threads == 0 and tp > 1:
            threads = max(1, (os.cpu_count() or 1) // tp)   # the ranks share the cores
        if self.device.type == "cpu" and threads > 0:
            torch.set_num_threads(threads)
        shard = Shard(config.rank, tp)
        self.is_driver = config.rank == 0   # samples and replies; the other ranks only compute
        self.broken = False                 # TP: the group lost step; the process must restart
        source = resolve_model(config.model)
        self.model_name = source.served_name
        folder = ensure_hf_folder(source)
        self.model_dir = folder                       # config.json + safetensors (+ tokenizer)
        args = read_args(folder)
        shard.check(args.num_heads, args.num_kv_heads)      # refuse a bad split up front
        self.dtype = _resolve_dtype(config.dtype, self.device)
        self.kv_dtype = _resolve_kv_dtype(config.kv_cache_dtype, self.dtype, self.device)
        limit = args.max_position_embeddings
        if args.sliding_window:
            # NOTE: no windowed attention here; capping the length keeps every context
            # inside the window, where full attention is exact.
            limit = min(limit, args.sliding_window)
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ExecutorConfigError(f"max_model_len {config.max_model_len} exceeds what "
                                      f"{self.model_name} supports ({limit}): pass at most {limit}")
        self.max_model_len = config.max_model_len or limit
        self.block_size = config.block_size
        # Joins the other ranks (blocks until all are there); a no-op at TP=1.
        self.group = ProcessGroup.connect(shard, self.device, config.dist_host, config.dist_port,
                                          config.dist_timeout_s)
        self.model = load_model(folder, self.dtype, self.device, self.max_model_len,
                                shard=shard)
        if tp > 1:
            self.model.group = self.group
        self.packed_weights = self.model.pack_for_cpu()   # CPU: MKL or oneDNN packed GEMM
        self.args = self.model.args                       # this rank's slice of the heads
        # CPU: the C prefill attention kernel or SDPA, whichever is faster here (remembered)
        self.prefill_kernel = (pick_prefill_paths(
            self.args.num_heads, self.args.num_kv_heads, self.args.head_dim, self.dtype,
            self.kv_dtype, self.block_size) if self.device.type == "cpu" else (False, False))
        # CPU: the decode kernel's query heads together or one at a time (remembered)
        self.decode_heads = (pick_decode_heads(
            self.args.num_heads, self.args.num_kv_heads, self.args.head_dim, self.kv_dtype,
            self.block_size) if self.device.type == "cpu" else 1)
        self.eos_token_id = args.eos_token_ids[0] if args.eos_token_ids else None
        one = block_bytes(self.args.num_layers, self.block_size, self.args.num_kv_heads,
                          self.args.head_dim, self.kv_dtype)
        # One block id must mean the same block on every rank: the smallest pool wins.
        self.num_gpu_blocks = self.group.min_int(config.num_gpu_blocks or self._size_pool(one))
        self.num_cpu_blocks = self.group.min_int(blocks_in(config.swap_space_gib * GIB, one))
        if self.num_gpu_blocks < 1:
            raise ExecutorConfigError(
                f"no memory left for the KV cache after loading {self.model_name}: raise "
                "kv_cache_gib (CPU) or gpu_memory_utilization (GPU), or use a smaller model")
        self.kv = self._allocate_kv(one)
        # Decode steps on a GPU replay CUDA graphs (one process: the TP all-reduce is not
        # captured); everything else runs eagerly.
        self.graphs = None
        if self.device.type == "cuda" and config.cuda_graph_max_batch > 0 and tp == 1:
            self.graphs = DecodeGraphs(self.model, self.kv.gpu, self.block_size,
                                       self.max_model_len, config.cuda_graph_max_batch)
        self.sampler = Sampler(config.seed)
        self.seqs: dict[int, SeqState] = {}
        self.keep_logits = False                      # tests: keep each sampling row's logits
        self.last_logits: dict[int, torch.Tensor] = {}
        log.info("executor rank %d/%d ready: %s %s on %s, %d KV blocks (+%d swap) of %d "
                 "tokens in %s", config.rank, tp, self.model_name, self.dtype, self.device,
                 self.num_gpu_blocks, self.num_cpu_blocks, self.block_size, self.kv_dtype)

    # ------------------------------------------------------------------ the step

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one plan. Never raises: a failure comes back as StepResult.error."""
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                result = self._execute(plan)
        except Exception as exc:  # one bad plan must not take the executor down
            log.exception("step %s failed", plan.step_id)
            kind = "invalid plan" if isinstance(exc, PlanError) else type(exc).__name__
            for st in self.seqs.values():    # a plan planned ahead of this one fails too
                st.last_sampled = -1
            if self.group.size > 1 and not isinstance(exc, PlanError):
                # Every rank checks a plan the same way, but a failure past the checks (a
                # lost peer, out of memory on one rank) leaves the ranks out of step.
                self.broken = True
            return StepResult(plan.step_id, error=f"executor step {plan.step_id} failed "
                              f"({kind}): {exc}")
        result.forward_ms = (time.perf_counter() - t0) * 1e3
        return result

    def _execute(self, plan: StepPlan) -> StepResult:
        for sid in plan.finished_seq_ids:
            self.seqs.pop(sid, None)
        for ns in plan.new_seqs:
            self._add_seq(ns)
        if any(len(col) != len(plan.seq_ids) for col in (
                plan.num_computed_tokens, plan.num_tokens, plan.num_append_tokens,
                plan.block_keep, plan.block_append)):
            raise PlanError("the plan's row columns differ in length")
        try:
            appended = plan.appended_per_row()
        except ValueError as exc:
            raise PlanError(f"the plan's appended tokens: {exc}") from None
        columns = (plan.num_computed_tokens, plan.num_tokens, appended, plan.block_keep,
                   plan.block_append)
        if len(set(plan.seq_ids)) != len(plan.seq_ids):
            raise PlanError("a seq is scheduled twice in one step")
        if (len(plan.token_bitmask) != 4 * plan.bitmask_words * len(plan.bitmask_rows)
                or any(not 0 <= r < plan.num_sampling_rows for r in plan.bitmask_rows)):
            raise PlanError("the plan's token bitmask does not fit its constrained rows")
        states = [self._apply_diff(*row) for row in zip(plan.seq_ids, *columns)]
        self.kv.swap_out(plan.swap_out)
        self.kv.swap_in(plan.swap_in)
        self.kv.copy(plan.copy)
        if not states:
            return StepResult(plan.step_id)
        return self._run(plan, states)

    def _add_seq(self, ns: NewSeq) -> None:
        if not 0 < ns.prompt_len <= len(ns.token_ids):
            raise PlanError(f"seq {ns.seq_id}: prompt_len {ns.prompt_len} does not fit its "
                            f"{len(ns.token_ids)} tokens")
        self._check_blocks(ns.seq_id, ns.block_table)
        self.seqs[ns.seq_id] = SeqState(ns.request_id, list(ns.token_ids), ns.prompt_len,
                                        list(ns.block_table), ns.sampling, ns.sample_index)

    def _check_blocks(self, seq_id: int, blocks: list[int]) -> None:
        if any(not 0 <= b < self.num_gpu_blocks for b in blocks):
            raise PlanError(f"seq {seq_id}: block id outside the pool of {self.num_gpu_blocks} "
                            f"blocks in {blocks}")

    def _apply_diff(self, seq_id: int, computed: int, num_tokens: int, append: list[int],
                    keep: int, blocks: list[int]) -> SeqState:
        """Apply one row's diffs to its seq's state; returns the state."""
        st = self.seqs.get(seq_id)
        if st is None:
            raise PlanError(f"seq {seq_id} is scheduled but unknown to the executor "
                            "(send it as NewSeq first)")
        if append and append[0] < 0:
            if len(append) != 1 or st.last_sampled < 0:
                raise PlanError(f"seq {seq_id}: token -1 stands for the token this executor "
                                "sampled for it in its last step, and it sampled none")
            append = [st.last_sampled]
        st.token_ids.extend(append)
        if keep >= 0:
            del st.block_table[keep:]
        self._check_blocks(seq_id, blocks)
        st.block_table.extend(blocks)
        end = computed + num_tokens
        if num_tokens < 1 or computed < 0 or end > len(st.token_ids):
            raise PlanError(f"seq {seq_id}: tokens [{computed}, {end}) are not "
                            f"within its {len(st.token_ids)} tokens")
        if end > self.max_model_len:
            raise PlanError(f"seq {seq_id}: {end} tokens exceed max_model_len "
                            f"{self.max_model_len}")
        if len(st.block_table) * self.block_size < end:
            raise PlanError(f"seq {seq_id}: {len(st.block_table)} blocks cannot hold {end} "
                            "tokens")
        return st

    def _run(self, plan: StepPlan, states: list[SeqState]) -> StepResult:
        computed, num_tokens = plan.num_computed_tokens, plan.num_tokens
        num_sampling = plan.num_sampling_rows
        input_ids: list[int] = []
        for c, n, st in zip(computed, num_tokens, states):
            input_ids += st.token_ids[c:c + n]
        hidden = None
        if (self.graphs is not None and len(input_ids) == len(states)
                and self.graphs.fits(len(states), max(computed) + 1)):
            try:
                hidden = self.graphs.forward(input_ids, computed,
                                             [st.block_table for st in states])
            except GraphCaptureError as exc:
                log.warning("%s; decode steps run eagerly from now on", exc)
                self.graphs = None
        if hidden is None:
            meta = AttentionMetadata.build([st.block_table for st in states], computed,
                                           num_tokens, self.block_size, self.device)
            meta.prefill_kernel = self.prefill_kernel
            meta.decode_heads_at_once = self.decode_heads
            ids = torch.tensor(input_ids, dtype=torch.int64).to(self.device, non_blocking=True)
            hidden = self.model.forward(ids, meta.positions, meta, self.kv.gpu)
        if not self.is_driver:
            return StepResult(plan.step_id)      # rank 0 samples and replies

        # Which rows of `hidden` get logits: one per sampling row, then prompt-logprob rows.
        sample_rows: list[int] = []
        prompt_rows: list[tuple[int, int, int]] = []  # (plan row, first hidden row, count)
        row = 0
        for r, (c, n, st) in enumerate(zip(computed, num_tokens, states)):
            if (c + n == len(st.token_ids)) != (r < num_sampling):
                raise PlanError(f"row {r} (seq {plan.seq_ids[r]}): the plan's "
                                f"num_sampling_rows ({num_sampling}) disagrees with whether "
                                "the row reaches the end of its tokens")
            if r < num_sampling:
                sample_rows.append(row + n - 1)
            if st.sampling.prompt_logprobs is not None:
                # row x predicts position x + 1; prompt positions end at prompt_len - 1
                cnt = max(0, min(c + n, st.prompt_len - 1) - c)
                if cnt or st.pending_pos == c:
                    prompt_rows.append((r, row, cnt))
            row += n
        rows = sample_rows + [r0 + i for _, r0, cnt in prompt_rows for i in range(cnt)]
        logits = self.model.compute_logits(
            hidden.index_select(0, torch.tensor(rows, dtype=torch.int64, device=self.device)))
        result = self._sample(plan, logits[:num_sampling], states[:num_sampling])
        if prompt_rows:
            result.prompt_logprobs = self._prompt_logprobs(
                logits[num_sampling:], plan, states, prompt_rows)
        return result

    def _sample(self, plan: StepPlan, logits: torch.Tensor, states: list[SeqState]
                ) -> StepResult:
        if not states:
            return StepResult(plan.step_id)
        mask = None
        if plan.bitmask_rows:
            mask = TokenMask(plan.bitmask_rows, plan.bitmask_words, plan.token_bitmask)
        res = self.sampler(logits, [SampleRow(st.sampling, st.token_ids, st.prompt_len,
                                              st.sample_index) for st in states], mask)
        if self.keep_logits:
            self.last_logits = {sid: logits[i].cpu()
                                for i, sid in enumerate(plan.seq_ids[:len(states)])}
        for st, token in zip(states, res.token_ids):
            st.last_sampled = token
        top = res.top if any(res.top) else []
        return StepResult(plan.step_id, res.token_ids, res.logprobs, top)

    def _prompt_logprobs(self, logits: torch.Tensor, plan: StepPlan, states: list[SeqState],
                         prompt_rows: list[tuple[int, int, int]]) -> list[list[TokenLogprob]]:
        """Prompt logprobs for the prompt positions computed this step (position 0 has none),
        one list per plan row (empty for rows that did not ask).

        Row x of a chunk predicts position x + 1; the logprob of the first position of the
        next chunk is computed now and reported with that chunk.
        """
        lp = torch.log_softmax(logits, dim=-1)
        kmax = max(states[j].sampling.prompt_logprobs for j, _, _ in prompt_rows)
        k_vals, k_idx = (lp.topk(min(kmax, lp.shape[1]), dim=-1) if kmax and len(lp) else
                         (torch.empty(0, 0), torch.empty(0, 0)))
        targets = []
        for j, _, cnt in prompt_rows:
            c = plan.num_computed_tokens[j]
            targets += states[j].token_ids[c + 1:c + 1 + cnt]
        tgt = torch.tensor(targets, dtype=torch.int64, device=lp.device)
        chosen = lp.gather(1, tgt[:, None])[:, 0].tolist()
        k_vals, k_idx = k_vals.tolist(), k_idx.tolist()
        per_row: list[list[TokenLogprob]] = [[] for _ in states]
        i = 0
        for j, _, cnt in prompt_rows:
            st, c, n = states[j], plan.num_computed_tokens[j], plan.num_tokens[j]
            k = st.sampling.prompt_logprobs
            entries = per_row[j]
            if st.pending_pos == c and st.pending_prompt_lp is not None:
                entries.append(st.pending_prompt_lp)
            for x in range(cnt):
                top = [[t, v] for t, v in zip(k_idx[i + x][:k], k_vals[i + x][:k])] if k else []
                entries.append(TokenLogprob(targets[i + x], chosen[i + x], top))
            st.pending_prompt_lp, st.pending_pos = None, -1
            if c + n < st.prompt_len and entries and cnt:
                # the last entry is position c + num_tokens: it belongs to the next chunk
                st.pending_prompt_lp, st.pending_pos = entries.pop(), c + n
            i += cnt
        return per_row

    # ------------------------------------------------------------------ sizing

    def _allocate_kv(self, one_block: int) -> KVCache:
        """The KV pool and the swap space, or ExecutorConfigError where they do not fit: in
        the host's available memory (CPU pool and swap space), or where the allocation
        fails (a GPU pool too large, or the host refusing)."""
        pool, swap = self.num_gpu_blocks * one_block, self.num_cpu_blocks * one_block
        what = (f"the KV cache ({pool / GIB:.1f} GiB on {self.device.type}, "
                f"{swap / GIB:.1f} GiB of swap space)")
        fix = ("lower kv_cache_gib or swap_space_gib" if self.device.type == "cpu" else
               "lower gpu_memory_utilization, num_gpu_blocks or swap_space_gib")
        host = swap + (pool if self.device.type == "cpu" else 0)
        available = host_memory_available()
        problem, kv = None, None
        if available is not None and host > available:
            problem = (f"{what} needs {host / GIB:.1f} GiB of host memory and "
                       f"{available / GIB:.1f} GiB is available: {fix}")
        else:
            try:
                kv = KVCache(self.args.num_layers, self.num_gpu_blocks, self.num_cpu_blocks,
                             self.block_size, self.args.num_kv_heads, self.args.head_dim,
                             self.kv_dtype, self.device)
            except (RuntimeError, MemoryError) as exc:   # (torch.OutOfMemoryError included)
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                problem = f"{what} could not be allocated ({first[:200]}): {fix}"
        # Every rank ends its start alike: one rank refusing alone would leave the others
        # waiting in their next collective until the group's timeout.
        if self.group.min_int(0 if problem else 1) == 0:
            raise ExecutorConfigError(problem or f"{what} could not be allocated on another "
                                                 f"tensor-parallel rank: {fix}")
        return kv

    def _size_pool(self, one_block: int) -> int:
        if self.device.type == "cpu":
            return blocks_in(self.config.kv_cache_gib * GIB, one_block)
        return blocks_in(self._profile_gpu(), one_block)

    def _profile_gpu(self) -> int:
        """Run the largest forward this config allows on a scratch pool; return the KV budget."""
        a = self.args
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        nblocks = -(-n // self.block_size)
        scratch = KVCache(a.num_layers, nblocks, 0, self.block_size, a.num_kv_heads, a.head_dim,
                          self.kv_dtype, self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        meta = AttentionMetadata.build([list(range(nblocks))], [0], [n], self.block_size,
                                       self.device)
        with torch.inference_mode():
            ids = torch.zeros(n, dtype=torch.int64, device=self.device)
            hidden = self.model.forward(ids, meta.positions, meta, scratch.gpu)
            rows = min(n, 256)  # a step samples at most one row per sequence
            self.model.compute_logits(hidden[:rows])
        torch.cuda.synchronize(self.device)
        del scratch, hidden
        return gpu_kv_budget_bytes(self.device, self.config.gpu_memory_utilization)


def _resolve_device(name: str, rank: int = 0) -> torch.device:
    """The device of tensor-parallel rank `rank`: GPU `rank` (modulo the visible ones)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ExecutorConfigError("device 'cuda' requested but no CUDA GPU is visible: "
                                  "pass device='cpu' or 'auto'")
    if name == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device(name)


def _resolve_kv_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV pool's dtype: the model's, or bf16 under an fp32 model on the CPU (its kernels
    round K/V to bf16 as they store them and widen them as they read)."""
    if name == "auto":
        return model_dtype
    dtype = _DTYPES[name]
    if dtype == model_dtype:
        return dtype
    if device.type == "cpu" and model_dtype == torch.float32 and dtype == torch.bfloat16:
        return dtype
    hint = ("bfloat16 (under a float32 model) or auto" if device.type == "cpu"
            and model_dtype == torch.float32 else "auto")
    raise ExecutorConfigError(f"kv_cache_dtype {name} under a {str(model_dtype)[6:]} model "
                              f"on {device.type} is not supported: use {hint}")


def _resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cpu":   # bf16 where it is native and measured faster, else fp32
            return auto_cpu_dtype()
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    dtype = _DTYPES[name]
    if device.type == "cpu" and dtype == torch.float16:
        raise ExecutorConfigError("float16 is not supported on the CPU: use float32 or bfloat16")
    return dtype
