"""The engine in one process: the scheduler core driving a ModelRunner directly.

No Redis, no ZeroMQ: the same Scheduler and ModelRunner the services use, called in a loop.
It is the reference the full stack is compared against (token-for-token greedy output, and
throughput in loadtest/bench_overhead.py), and a convenient offline API.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace

from services.executor.config import ExecutorConfig
from services.executor.model_runner import ModelRunner
from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from shared.messages import GenerationRequest, RequestOutput, SamplingParams


@dataclass(slots=True)
class Completion:
    """The finished result of one request: per output sequence, its tokens and finish reason."""

    request_id: str
    token_ids: list[list[int]] = field(default_factory=list)
    finish_reasons: list[str | None] = field(default_factory=list)
    error: str | None = None
    first_token_s: float = 0.0     # seconds from submission to the first token
    done_s: float = 0.0            # seconds from submission to the last token


class OfflineEngine:
    def __init__(self, executor: ExecutorConfig, scheduler: SchedulerConfig | None = None,
                 runner: ModelRunner | None = None) -> None:
        self.runner = runner if runner is not None else ModelRunner(executor)
        core = scheduler or SchedulerConfig()
        core = replace(core, block_size=self.runner.block_size,
                       max_model_len=min(core.max_model_len, self.runner.max_model_len))
        self.scheduler = Scheduler(core, self.runner.num_gpu_blocks, self.runner.num_cpu_blocks)
        self.eos_token_id = self.runner.eos_token_id

    def request(self, prompt_token_ids: list[int], sampling: SamplingParams | None = None,
                request_id: str | None = None, ignore_eos: bool = False) -> GenerationRequest:
        sp = replace(sampling) if sampling is not None else SamplingParams()
        if not ignore_eos and self.eos_token_id is not None and self.eos_token_id not in sp.stop_token_ids:
            sp.stop_token_ids = [*sp.stop_token_ids, self.eos_token_id]
        return GenerationRequest(request_id or uuid.uuid4().hex, list(prompt_token_ids), sp,
                                 arrival_time=time.time())

    def generate(self, requests: list[GenerationRequest]) -> dict[str, Completion]:
        """Run every request to completion, all admitted at once (continuous batching)."""
        start = time.perf_counter()
        done: dict[str, Completion] = {r.request_id: Completion(r.request_id) for r in requests}
        for r in requests:
            self.scheduler.add_request(r)
        while self.scheduler.has_unfinished():
            plan = self.scheduler.schedule()
            if plan is None:
                break
            result = self.runner.execute(plan)      # a failed step fails its requests
            now = time.perf_counter() - start
            for out in self.scheduler.update(plan, result).request_outputs():
                self._absorb(done[out.request_id], out, now)
        return done

    @staticmethod
    def _absorb(c: Completion, out: RequestOutput, now: float) -> None:
        if out.error:
            c.error = out.error
        for d in out.seqs:
            while len(c.token_ids) <= d.index:
                c.token_ids.append([])
                c.finish_reasons.append(None)
            if d.token_ids and not c.first_token_s:
                c.first_token_s = now
            c.token_ids[d.index].extend(d.token_ids)
            if d.finish_reason:
                c.finish_reasons[d.index] = d.finish_reason
        if out.finished:
            c.done_s = now
