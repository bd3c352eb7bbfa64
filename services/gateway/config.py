"""The gateway's one config object, from CLI flags and environment variables.

Every field has a flag (`--max-queue`) and an environment variable (`PAGEDSERVE_MAX_QUEUE`;
the Redis URL is plain `REDIS_URL`); flags win over the environment, which wins over the
defaults below. The defaults serve the bundled model on a laptop.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

from shared.model_source import BUNDLED_NAME


@dataclass(slots=True)
class GatewayConfig:
    model: str = BUNDLED_NAME              # bundled name, .gguf file or HF folder (model_source)
    served_model_name: list[str] = field(default_factory=list)  # names clients may pass as
    # "model" (comma-separated); the first is echoed in responses. Empty: the model's own name
    host: str = "127.0.0.1"
    port: int = 8000
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "pagedserve"
    api_keys: list[str] = field(default_factory=list)  # Bearer keys for /v1/*; empty: open
    log_level: str = "info"
    # Admission
    max_queue: int = 1024                  # unfinished requests (waiting + running) before 429
    retry_after_s: int = 1                 # Retry-After sent with 429 and 503
    queue_probe_s: float = 0.05            # queue depth probed at most this often (s)
    redis_max_connections: int = 64        # pooled connections (a burst waits for one)
    request_stream_maxlen: int = 100_000   # request stream trimmed (~) to this many entries
    # Limits (each violation is a 4xx naming the parameter)
    max_model_len: int = 2048              # tokens: prompt + max_tokens must fit
    max_body_bytes: int = 1 << 20          # bytes of one request body (413 above)
    max_n: int = 16                        # n, best_of and beam width
    max_stop: int = 16                     # stop strings per request
    max_stop_chars: int = 256              # characters per stop string
    max_logprobs: int = 20                 # top-k logprobs per token
    max_prompts: int = 256                 # prompts in one /v1/completions request
    # Streaming
    stream_start_wait_s: float = 1.0       # SSE headers wait this long: a refusal is then a 4xx
    keepalive_s: float = 15.0              # resumable SSE: a comment after this much silence
    read_block_ms: int = 2000              # one XREAD BLOCK slice (also bounds shutdown latency)
    resume_grace_s: float = 30.0           # a resumable stream's request outlives its client's
    # drop by this long, waiting for a resume; other requests are aborted at once
    heartbeat_fresh_s: float = 5.0         # /health: a scheduler beat younger than this is alive
    # No scheduler beat for this long (while some scheduler is known): new requests get 503
    # with Retry-After, and a stream with no output gets a 503 error event. Longer than a
    # scheduler restart under `serve` (docs/reliability.md), which the client never sees.
    scheduler_gone_s: float = 20.0
    stall_check_s: float = 5.0             # a stream quiet this long checks its request is alive
    request_timeout_s: float = 3600.0      # a request still running after this ends with 504
    # Connections (services/gateway/limits.py)
    header_timeout_s: float = 10.0         # a request's headers must be complete this soon (s)
    body_timeout_s: float = 30.0           # a request body must arrive this soon (s); else 408
    send_timeout_s: float = 30.0           # a response write blocked this long on a client
    # that does not read cuts its connection (s); its request is aborted
    send_buffer_bytes: int = 262144        # kernel send buffer of a connection (SO_SNDBUF;
    # 0: the kernel's autotuning, up to MiBs): bounds what a client that does not read pins
    timeout_keep_alive_s: float = 5.0      # an idle kept-alive connection is closed after (s)
    limit_concurrency: int = 2048          # open connections; beyond, new requests get 503
    # Per API key (the client's address without keys); 0: no limit
    key_max_requests: int = 0              # open requests of one key; more get 429
    key_max_tokens: int = 0                # tokens one key's open requests may hold (prompt +
    # max_tokens per sequence); more get 429, a single request above it 400

    def check(self) -> None:
        """ValueError naming the first setting out of its range (checked at start, before
        anything listens): counts that would refuse every request (a queue, connections or
        bodies of 0) must be >= 1, timeouts > 0, every other number >= 0."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            least, strict = (1, False) if f.name in _AT_LEAST_ONE else (
                (0, True) if f.name in _POSITIVE else (0, False))
            if value < least or (strict and value == least):
                need = "> 0" if strict else f">= {least}"
                raise ValueError(f"--{f.name.replace('_', '-')} must be {need}, got {value}")
        if self.port > 65535:
            raise ValueError(f"--port must be at most 65535, got {self.port}")

    @classmethod
    def from_argv(cls, argv: list[str] | None = None, env: dict[str, str] | None = None
                  ) -> "GatewayConfig":
        """Parse flags over environment over defaults. Exits with a usage message on bad input."""
        env = os.environ if env is None else env
        parser = argparse.ArgumentParser(prog="pagedserve-gateway",
                                         description="OpenAI-compatible HTTP gateway of pagedserve")
        for f in dataclasses.fields(cls):
            var = "REDIS_URL" if f.name == "redis_url" else f"PAGEDSERVE_{f.name.upper()}"
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            kind = type(default)
            raw = env.get(var)
            if f.name in ("api_keys", "served_model_name"):
                kind = _keys
            try:
                value = kind(raw) if raw not in (None, "") else default
            except ValueError:
                parser.error(f"{var}={raw!r} is not a valid {kind.__name__}")
            parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind,
                                default=value, help=f"[env {var}, default {default!r}]")
        return cls(**vars(parser.parse_args(argv)))


# GatewayConfig.check: counts where 0 would refuse every request, and timeouts
_AT_LEAST_ONE = {"max_queue", "redis_max_connections", "request_stream_maxlen", "max_model_len",
                 "max_body_bytes", "max_n", "max_stop_chars", "max_prompts", "read_block_ms",
                 "limit_concurrency"}
_POSITIVE = {"keepalive_s", "heartbeat_fresh_s", "scheduler_gone_s", "stall_check_s",
             "request_timeout_s", "header_timeout_s", "body_timeout_s", "send_timeout_s"}


def _keys(raw: str) -> list[str]:
    return [k.strip() for k in raw.split(",") if k.strip()]
