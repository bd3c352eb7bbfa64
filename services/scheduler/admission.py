"""Admission control: refuse, with what to change, a request that could never run here.

A request is refused when it could not complete even alone in an empty pool; anything that
passes is guaranteed to run to the end eventually (the scheduler never deadlocks on it).
"""
from __future__ import annotations

from services.scheduler.block_manager import BlockManager
from services.scheduler.config import SchedulerConfig
from shared.messages import GenerationRequest


class AdmissionError(ValueError):
    """A request that can never run here; the message says what to change."""


def check_admission(req: GenerationRequest, config: SchedulerConfig,
                    block_manager: BlockManager) -> None:
    """Raise AdmissionError if `req` can never run on this configuration and pool."""
    sp = req.sampling
    L = len(req.prompt_token_ids)
    if L == 0:
        raise AdmissionError("the prompt is empty: send at least one token")
    if sp.max_tokens < 1:
        raise AdmissionError(f"max_tokens must be at least 1, got {sp.max_tokens}")
    if L + sp.max_tokens > config.max_model_len:
        raise AdmissionError(
            f"prompt ({L} tokens) + max_tokens ({sp.max_tokens}) = {L + sp.max_tokens} "
            f"exceeds the context length of {config.max_model_len} tokens: shorten the prompt "
            "or lower max_tokens")
    if sp.beam_width < 0 or sp.n < 1:
        raise AdmissionError("n must be >= 1 and beam_width >= 0")
    if sp.beam_width > 0 and sp.n > sp.beam_width:
        raise AdmissionError(f"n ({sp.n}) must not exceed beam_width ({sp.beam_width}): "
                             "beam search returns at most beam_width beams")
    if sp.beam_width > 0 and sp.constraint is not None:
        raise AdmissionError("beam search cannot follow an output constraint "
                             "(response_format, structured_outputs, tools): drop one")
    if sp.beam_width > 0 and config.contiguous:
        raise AdmissionError("beam search needs block sharing, which the contiguous baseline "
                             "does not have: run without --contiguous")
    width = sp.beam_width if sp.beam_width > 0 else sp.n
    limit = min(config.max_num_seqs, config.max_num_batched_tokens)
    if width > limit:
        raise AdmissionError(f"{'beam_width' if sp.beam_width else 'n'} = {width} exceeds the "
                             f"{limit} sequences this server batches in one step: lower it")
    need = block_manager.max_blocks(L, sp.max_tokens, width)
    num_gpu_blocks = block_manager.gpu.num_blocks
    if need > num_gpu_blocks:
        raise AdmissionError(
            f"this request may need {need} KV blocks of {config.block_size} tokens but the pool "
            f"has only {num_gpu_blocks}: lower max_tokens, n or beam_width, or give the "
            "executor more GPU memory")
