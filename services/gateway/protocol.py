"""OpenAI request bodies in, validated `GenerationRequest`s out: nothing invalid reaches Redis.

Every check raises `ApiError` with the status, the offending parameter and what to do.
Choices (documented in /openapi.json too):

- Unknown top-level fields are refused (400 naming the field) rather than silently
  ignored, so a typo like `max_token` cannot go unnoticed. OpenAI fields this server
  does not implement (tools, logit_bias, echo, ...) are accepted only at their neutral
  value. `user` is accepted and ignored.
- `use_beam_search` (vLLM's extension): beam width = max(n, best_of); the `n` best beams
  are returned. Without beam search, `best_of` must equal `n` when given.
- Defaults: max_tokens 16 for /v1/completions (OpenAI's), all the remaining context for
  chat. prompt + max_tokens must fit in max_model_len, else 400 naming both lengths.
- `top_k` -1 or 0 disables it; `logprobs` is capped at `max_logprobs` (20).
- The EOS token joins stop_token_ids unless `ignore_eos`.
- One prompt per request: a list of several prompts is refused (send one request each).
- `stream_options` is validated always but only read with stream=true (some clients send
  it on every request).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.gateway.prompt import PromptBuilder
from services.gateway.validation import ApiError, Fields, bad, kind, or_default, text
from shared.messages import GenerationRequest, SamplingParams

_INT64 = (-(2**63), 2**63 - 1)
_INT32 = (-(2**31), 2**31 - 1)


@dataclass(slots=True)
class ResponseSpec:
    """All a response needs besides the tokens; stored as the output stream's header entry
    so that any gateway replica can replay the stream for a resuming client."""

    kind: str                        # "completion" | "chat"
    request_id: str
    model: str
    created: int                     # unix seconds
    n: int                           # choices (beams returned with beam search)
    prompt_tokens: int
    stream: bool = False
    include_usage: bool = False      # stream_options.include_usage
    logprobs: int | None = None      # top-k per token; None: no logprobs
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0              # stop strings apply from this many new tokens on (vLLM)

    def to_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}

    @classmethod
    def from_dict(cls, d: dict) -> "ResponseSpec":
        """Raises TypeError on a header this build does not understand."""
        return cls(**d)


@dataclass(slots=True)
class Parsed:
    spec: ResponseSpec
    request: GenerationRequest


_SAMPLING = frozenset({
    "model", "n", "best_of", "stream", "stream_options", "stop", "stop_token_ids", "seed",
    "temperature", "top_p", "top_k", "min_p", "max_tokens", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens", "priority",
    "use_beam_search", "length_penalty", "include_stop_str_in_output", "skip_special_tokens",
    "user", "logit_bias"})
COMPLETION_FIELDS = _SAMPLING | {"prompt", "logprobs", "echo", "suffix", "add_special_tokens"}
CHAT_FIELDS = _SAMPLING | {"messages", "logprobs", "top_logprobs", "max_completion_tokens",
                           "response_format", "tools", "tool_choice", "parallel_tool_calls",
                           "add_generation_prompt"}


class RequestParser:
    """Validates bodies and builds prompts (on the event loop, or the tokenizer thread for
    large bodies)."""

    def __init__(self, config, tokenizer, vocab, served_name: str) -> None:
        self.cfg, self.tokenizer, self.vocab = config, tokenizer, vocab
        self.served_name = served_name
        self.prompts = PromptBuilder(tokenizer, vocab)

    # ------------------------------------------------------------ endpoints
    def completion(self, body: Any) -> Parsed:
        f = Fields(body, COMPLETION_FIELDS)
        self.model(f)
        f.neutral("echo", False)
        f.neutral("suffix", "")
        f.neutral("logit_bias", {})
        logprobs = f.int("logprobs", None, 0, self.cfg.max_logprobs)
        s = self._sampling(f)
        prompt = self.prompts.completion(f.raw("prompt"), f.bool("add_special_tokens", True))
        return self._build("completion", "cmpl", f, s, prompt,
                           [("max_tokens", f.int("max_tokens", None, 1))], 16, logprobs, "prompt")

    def chat(self, body: Any) -> Parsed:
        f = Fields(body, CHAT_FIELDS)
        self.model(f)
        f.neutral("logit_bias", {})
        f.neutral("tools", [])
        f.neutral("tool_choice", "none")
        f.neutral("response_format", {"type": "text"})
        f.neutral("parallel_tool_calls", True, False)
        want = f.bool("logprobs", False)
        top = f.int("top_logprobs", None, 0, self.cfg.max_logprobs)
        if top and not want:
            raise bad("top_logprobs needs logprobs=true", "top_logprobs")
        s = self._sampling(f)
        # OpenAI's newer name wins over the older one; both must fit the context
        max_tokens = [("max_completion_tokens", f.int("max_completion_tokens", None, 1)),
                      ("max_tokens", f.int("max_tokens", None, 1))]
        prompt = self.prompts.chat(f.raw("messages"), f.bool("add_generation_prompt", True))
        return self._build("chat", "chatcmpl", f, s, prompt, max_tokens, None,
                           (top or 0) if want else None, "messages")

    def tokenize(self, body: Any) -> dict:
        """vLLM's /tokenize: a `prompt`, or chat `messages` rendered by the template."""
        chat = isinstance(body, dict) and "messages" in body
        allowed = {"model", "add_special_tokens", "return_token_strs",
                   *(("messages", "add_generation_prompt") if chat else ("prompt",))}
        f = Fields(body, frozenset(allowed))
        self.model(f)
        if chat:
            ids = self.prompts.chat(f.raw("messages"), f.bool("add_generation_prompt", True),
                                   f.bool("add_special_tokens", False))
        else:
            prompt = f.str("prompt", None)
            if prompt is None:
                raise bad("prompt (or messages) is required", "prompt")
            ids = self.prompts.encode(prompt, f.bool("add_special_tokens", True))
        strs = ([self.vocab.piece(i) for i in ids] if f.bool("return_token_strs", False)
                else None)
        return {"count": len(ids), "max_model_len": self.cfg.max_model_len, "tokens": ids,
                "token_strs": strs}

    def detokenize(self, body: Any) -> dict:
        f = Fields(body, frozenset({"model", "tokens"}))
        self.model(f)
        ids = self.prompts.token_ids(f.raw("tokens"), "tokens", allow_empty=True)
        return {"prompt": self.tokenizer.decode(ids)}

    # ------------------------------------------------------------ pieces
    def model(self, f: Fields) -> None:
        name = f.str("model", None)
        if name is not None and name != self.served_name:
            raise ApiError(404, f"the model {name!r} does not exist: this server serves "
                                f"{self.served_name!r} (see GET /v1/models)",
                           param="model", code="model_not_found")

    def _sampling(self, f: Fields) -> dict:
        cfg = self.cfg
        n = f.int("n", 1, 1, cfg.max_n)
        beam = f.bool("use_beam_search", False)
        best_of = f.int("best_of", None, 1, cfg.max_n)
        if best_of is not None and best_of < n:
            raise bad(f"best_of ({best_of}) must be at least n ({n})", "best_of")
        if not beam and best_of not in (None, n):
            raise bad("best_of > n is only supported with use_beam_search=true", "best_of")
        stream = f.bool("stream", False)
        include_usage = False
        if f.raw("stream_options") is not None:   # checked always, read only when streaming
            so = Fields(f.raw("stream_options"), frozenset({"include_usage"}), "stream_options.")
            include_usage = so.bool("include_usage", False) and stream
        f.str("user", None)
        top_k = f.int("top_k", 0, -1, _INT32[1])
        return dict(
            n=n, beam_width=max(n, best_of or 0) if beam else 0,
            length_penalty=f.float("length_penalty", 1.0, -10.0, 10.0),
            temperature=f.float("temperature", 1.0, 0.0, 2.0),
            top_p=f.float("top_p", 1.0, 0.0, 1.0, lo_open=True),
            top_k=max(top_k, 0),
            min_p=f.float("min_p", 0.0, 0.0, 1.0),
            seed=f.int("seed", None, *_INT64),
            presence_penalty=f.float("presence_penalty", 0.0, -2.0, 2.0),
            frequency_penalty=f.float("frequency_penalty", 0.0, -2.0, 2.0),
            repetition_penalty=f.float("repetition_penalty", 1.0, 0.0, 10.0, lo_open=True),
            min_tokens=f.int("min_tokens", 0, 0),
            stop_token_ids=self.prompts.token_ids(or_default(f.raw("stop_token_ids"), []),
                                                  "stop_token_ids", allow_empty=True, limit=256),
            # gateway-side, not SamplingParams:
            _stream=stream, _include_usage=include_usage, _stop=self._stop(f.raw("stop")),
            _ignore_eos=f.bool("ignore_eos", False),
            _include_stop=f.bool("include_stop_str_in_output", False),
            _skip_special=f.bool("skip_special_tokens", True),
            _priority=f.int("priority", 0, *_INT32))

    def _stop(self, v: Any) -> list[str]:
        if v is None:
            return []
        stops = [v] if isinstance(v, str) else v
        if not isinstance(stops, list):
            raise bad(f"stop must be a string or an array of strings, got {kind(v)}", "stop")
        if len(stops) > self.cfg.max_stop:
            raise bad(f"at most {self.cfg.max_stop} stop strings are allowed, got {len(stops)}",
                      "stop")
        for i, s in enumerate(stops):
            text(s, f"stop[{i}]")
            if not 0 < len(s) <= self.cfg.max_stop_chars:
                raise bad(f"stop[{i}] must be 1 to {self.cfg.max_stop_chars} characters long",
                          "stop")
        return list(dict.fromkeys(stops))

    def _build(self, kind: str, id_prefix: str, f: Fields, s: dict, prompt: list[int],
               asked: list[tuple[str, int | None]], default_max: int | None,
               logprobs: int | None, prompt_param: str) -> Parsed:
        limit, plen = self.cfg.max_model_len, len(prompt)
        room = limit - plen
        if room < 1:
            raise bad(f"the prompt is {plen} tokens, but this model's context is {limit} tokens "
                      "including at least one new token: shorten the prompt", prompt_param,
                      "context_length_exceeded")
        for param, value in asked:
            if value is not None and value > room:
                raise bad(f"{param}={value} plus the prompt's {plen} tokens exceeds this "
                          f"model's context of {limit} tokens: ask for at most {room} new tokens",
                          param, "context_length_exceeded")
        max_tokens = next((v for _p, v in asked if v is not None), None)
        if max_tokens is None:
            max_tokens = min(default_max, room) if default_max else room
        if s["min_tokens"] > max_tokens:
            raise bad(f"min_tokens ({s['min_tokens']}) must not exceed max_tokens ({max_tokens})",
                      "min_tokens")
        stop_ids = list(s["stop_token_ids"])
        eos = self.vocab.eos_token_id
        if not s["_ignore_eos"] and eos is not None and eos not in stop_ids:
            stop_ids.append(eos)
        extras = {k: s.pop(k) for k in list(s) if k.startswith("_")}
        s["stop_token_ids"] = stop_ids
        params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **s)
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        now = time.time()
        spec = ResponseSpec(kind, request_id, self.served_name, int(now), params.n, plen,
                            extras["_stream"], extras["_include_usage"], logprobs,
                            extras["_stop"], extras["_include_stop"], extras["_skip_special"],
                            params.min_tokens)
        return Parsed(spec, GenerationRequest(request_id, prompt, params,
                                              priority=extras["_priority"], arrival_time=now))
