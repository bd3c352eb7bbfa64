"""OpenAI request bodies in, validated `GenerationRequest`s out: nothing invalid reaches Redis.

Every check raises `ApiError` with the status, the offending parameter and what to do.
Choices, as vLLM's OpenAI server makes them unless said otherwise (documented in
/openapi.json too):

- Unknown fields, and documented OpenAI fields that do not apply to a local server
  (`store`, `metadata`, `service_tier`, `reasoning_effort`, `prompt_cache_key`,
  `functions: null`, ...), are accepted and ignored; each ignored name is logged once.
  Fields this server knows keep strict value checks (types, ranges, NaN, sizes). OpenAI
  fields it knows but cannot honour (`suffix`) are accepted only at their neutral value.
- Structured outputs (`response_format`, vLLM's `structured_outputs` and `guided_*`):
  structured.py; tool calling (`tools`, `tool_choice`): tools.py.
- `use_beam_search` (vLLM's extension): beam width = max(n, best_of); the `n` best beams
  are returned. Without beam search, `best_of` must equal `n` when given.
- Defaults: max_tokens 16 for /v1/completions (OpenAI's), all the remaining context for
  chat. prompt + max_tokens must fit in max_model_len, else 400 worded as OpenAI words it.
- `top_k` -1 or 0 disables it; `logprobs` is capped at `max_logprobs` (20).
- The EOS token joins stop_token_ids unless `ignore_eos`.
- /v1/completions takes several prompts (a list of strings or of token-id lists): one
  `GenerationRequest` each, choices numbered prompt_index * n + j. `max_tokens: 0` (with
  `echo`, for scoring a prompt) runs one token that is neither shown nor counted.
- `stream_options` is validated always but only read with stream=true (some clients send
  it on every request).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from services.gateway import structured, tools
from services.gateway.prompt import PromptBuilder
from services.gateway.validation import ApiError, Fields, bad, kind, or_default, text
from shared.messages import GenerationRequest, SamplingParams, StreamHeader

_INT64 = (-(2**63), 2**63 - 1)
_INT32 = (-(2**31), 2**31 - 1)
MAX_LOGIT_BIAS = 1024          # entries of logit_bias
MAX_BAD_WORDS = 64             # bad_words entries


@dataclass(slots=True)
class Parsed:
    """One request: a header and a GenerationRequest per prompt (one, except for a
    /v1/completions list of prompts). `response_id` is the id clients see."""

    response_id: str
    headers: list[StreamHeader]
    requests: list[GenerationRequest]
    resumable: bool = False


_SAMPLING = frozenset({
    "model", "n", "best_of", "stream", "stream_options", "stop", "stop_token_ids", "seed",
    "temperature", "top_p", "top_k", "min_p", "max_tokens", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens", "priority",
    "use_beam_search", "length_penalty", "include_stop_str_in_output", "skip_special_tokens",
    "user", "logit_bias", "allowed_token_ids", "bad_words", "truncate_prompt_tokens",
    "return_tokens_as_token_ids", "prompt_logprobs"}) | structured.FIELDS
COMPLETION_FIELDS = _SAMPLING | {"prompt", "logprobs", "echo", "suffix", "add_special_tokens"}
CHAT_FIELDS = _SAMPLING | tools.FIELDS | {"messages", "logprobs", "top_logprobs",
                                          "max_completion_tokens", "add_generation_prompt", "continue_final_message",
                           "chat_template_kwargs"}


class RequestParser:
    """Validates bodies and builds prompts (on the event loop, or the tokenizer thread for
    large bodies)."""

    def __init__(self, config, tokenizer, vocab, served_names: list[str]) -> None:
        self.cfg, self.tokenizer, self.vocab = config, tokenizer, vocab
        self.served_names = served_names
        self.prompts = PromptBuilder(tokenizer, vocab)

    # ------------------------------------------------------------ endpoints
    def completion(self, body: Any, request_id: str | None = None,
                   resumable: bool = False) -> Parsed:
        f = Fields(body, COMPLETION_FIELDS)
        self.model(f)
        f.neutral("suffix", "")
        echo = f.bool("echo", False)
        logprobs = f.int("logprobs", None, 0, self.cfg.max_logprobs)
        s = self._sampling(f)
        prompts = self.prompts.completions(f.raw("prompt"), f.bool("add_special_tokens", True),
                                           self.cfg.max_prompts)
        if resumable and len(prompts) > 1:
            raise bad("a resumable stream takes one prompt: send one request per prompt, or "
                      "drop the X-Resumable-Stream header", "prompt")
        asked = f.int("max_tokens", None, 0)
        return self._build("completion", "cmpl", f, s, prompts, [("max_tokens", asked)], 16,
                           logprobs, "prompt", request_id, resumable, echo=echo)

    def chat(self, body: Any, request_id: str | None = None, resumable: bool = False) -> Parsed:
        f = Fields(body, CHAT_FIELDS)
        self.model(f)
        tool_req = tools.parse(f.body)
        want = f.bool("logprobs", False)
        top = f.int("top_logprobs", None, 0, self.cfg.max_logprobs)
        if top and not want:
            raise bad("top_logprobs needs logprobs=true", "top_logprobs")
        s = self._sampling(f)
        call_grammar = tools.constraint(tool_req) if tool_req is not None else None
        if call_grammar is not None:
            if s["constraint"] is not None:
                raise bad("a required or named tool_choice already constrains the output: "
                          "drop response_format / structured_outputs", "tool_choice")
            if s["beam_width"]:
                raise bad("use_beam_search cannot follow a required or named tool_choice",
                          "use_beam_search")
            structured.check(call_grammar, "tools")
            s["constraint"] = call_grammar
        # OpenAI's newer name wins over the older one; both must fit the context
        max_tokens = [("max_completion_tokens", f.int("max_completion_tokens", None, 1)),
                      ("max_tokens", f.int("max_tokens", None, 1))]
        generation_prompt = f.bool("add_generation_prompt", True)
        continue_final = f.bool("continue_final_message", False)
        if generation_prompt and continue_final and "add_generation_prompt" in f.body:
            raise bad("continue_final_message and add_generation_prompt cannot both be true",
                      "continue_final_message")
        kwargs = f.raw("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise bad(f"chat_template_kwargs must be an object, got {kind(kwargs)}",
                      "chat_template_kwargs")
        prompt = self.prompts.chat(f.raw("messages"), generation_prompt and not continue_final,
                                   continue_final=continue_final, template_kwargs=kwargs,
                                   tools=tool_req)
        return self._build("chat", "chatcmpl", f, s, [prompt], max_tokens, None,
                           (top or 0) if want else None, "messages", request_id, resumable,
                           tool_calls=tool_req is not None)

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
        ids = self.prompts.token_ids(f.raw("tokens"), "tokens", allow_empty=True,
                                     limit=self.cfg.max_model_len)
        return {"prompt": self.tokenizer.decode(ids)}

    # ------------------------------------------------------------ pieces
    def model(self, f: Fields) -> None:
        name = f.str("model", None)
        if name is not None and name not in self.served_names:
            raise model_not_found(name, self.served_names)

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
        include_usage = continuous = False
        if f.raw("stream_options") is not None:   # checked always, read only when streaming
            so = Fields(f.raw("stream_options"),
                        frozenset({"include_usage", "continuous_usage_stats"}), "stream_options.")
            include_usage = so.bool("include_usage", False) and stream
            continuous = so.bool("continuous_usage_stats", False) and include_usage
        f.str("user", None)
        top_k = f.int("top_k", 0, -1, _INT32[1])
        constraint = structured.constraint(f.body)
        if constraint is not None and beam:
            raise bad("use_beam_search cannot follow an output constraint (response_format, "
                      "structured_outputs, guided_*, tools): drop one", "use_beam_search")
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
            prompt_logprobs=f.int("prompt_logprobs", None, 0, cfg.max_logprobs),
            logit_bias=self._logit_bias(f.raw("logit_bias")),
            allowed_token_ids=(None if f.raw("allowed_token_ids") is None else
                               self.prompts.token_ids(f.raw("allowed_token_ids"),
                                                      "allowed_token_ids")),
            bad_words_ids=self._bad_words(f.raw("bad_words")),
            constraint=constraint,
            # gateway-side, not SamplingParams:
            _stream=stream, _include_usage=include_usage, _continuous=continuous,
            _stop=self._stop(f.raw("stop")),
            _ignore_eos=f.bool("ignore_eos", False),
            _include_stop=f.bool("include_stop_str_in_output", False),
            _skip_special=f.bool("skip_special_tokens", True),
            _tokens_as_ids=f.bool("return_tokens_as_token_ids", False),
            _truncate=f.int("truncate_prompt_tokens", None, 1),
            _priority=f.int("priority", 0, *_INT32))

    def _logit_bias(self, v: Any) -> dict[int, float]:
        """OpenAI's {"<token id>": bias}: ids of this vocabulary, biases in [-100, 100]."""
        if v is None:
            return {}
        if not isinstance(v, dict):
            raise bad(f"logit_bias must be an object of token id -> bias, got {kind(v)}",
                      "logit_bias")
        if len(v) > MAX_LOGIT_BIAS:
            raise bad(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(v)}",
                      "logit_bias")
        f = Fields(v, frozenset(v), "logit_bias.")
        out = {}
        for key in v:
            if not (key.isascii() and key.isdigit() and int(key) < self.vocab.size):
                raise bad(f"logit_bias keys must be token ids of this model (0 to "
                          f"{self.vocab.size - 1}), got {key[:32]!r}", "logit_bias")
            out[int(key)] = f.float(key, 0.0, -100.0, 100.0)
        return out

    def _bad_words(self, v: Any) -> list[list[int]]:
        """vLLM's bad_words: each word's token ids as written and with a leading space (its
        form inside a sentence), so it is banned at the start and in the middle of text."""
        if v is None:
            return []
        if not isinstance(v, list) or len(v) > MAX_BAD_WORDS:
            raise bad(f"bad_words must be an array of at most {MAX_BAD_WORDS} strings",
                      "bad_words")
        out: list[list[int]] = []
        for i, word in enumerate(v):
            word = text(word, f"bad_words[{i}]").strip()
            if not word or len(word) > self.cfg.max_stop_chars:
                raise bad(f"bad_words[{i}] must be 1 to {self.cfg.max_stop_chars} characters",
                          "bad_words")
            for form in (word, " " + word):
                ids = self.prompts.encode(form, False)
                if ids and ids not in out:
                    out.append(ids)
        return out

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

    def _max_tokens(self, plen: int, asked: list[tuple[str, int | None]],
                    default_max: int | None, prompt_param: str) -> int:
        """The new tokens to ask for: the first value given, else the default; 400 in
        OpenAI's words when the prompt and the completion do not fit the context."""
        limit = self.cfg.max_model_len
        room = limit - plen
        if room < 1:
            raise bad(f"This model's maximum context length is {limit} tokens. However, your "
                      f"prompt is {plen} tokens, and at least one new token must fit. Please "
                      "reduce the length of the prompt.", prompt_param, "context_length_exceeded")
        for param, value in asked:
            if value is not None and value > room:
                raise bad(f"This model's maximum context length is {limit} tokens. However, you "
                          f"requested {plen + value} tokens ({plen} in the prompt, {value} for "
                          f"the completion). Please reduce the length of the prompt or "
                          f"{param} (at most {room} here).", param, "context_length_exceeded")
        max_tokens = next((v for _p, v in asked if v is not None), None)
        if max_tokens is None:
            max_tokens = min(default_max, room) if default_max else room
        return max_tokens

    def _build(self, kind: str, id_prefix: str, f: Fields, s: dict, prompts: list[list[int]],
               asked: list[tuple[str, int | None]], default_max: int | None,
               logprobs: int | None, prompt_param: str, request_id: str | None,
               resumable: bool, echo: bool = False, tool_calls: bool = False) -> Parsed:
        extras = {k: s.pop(k) for k in list(s) if k.startswith("_")}
        if s["prompt_logprobs"] is not None and extras["_stream"]:
            raise bad("prompt_logprobs is not available with stream=true (as in vLLM): ask "
                      "without streaming, or use echo with logprobs", "prompt_logprobs")
        if extras["_truncate"] is not None:     # vLLM: keep the prompt's last k tokens
            prompts = [p[-extras["_truncate"]:] for p in prompts]
        stop_ids = list(s["stop_token_ids"])
        eos = self.vocab.eos_token_id
        if not extras["_ignore_eos"] and eos is not None and eos not in stop_ids:
            stop_ids.append(eos)
        s["stop_token_ids"] = stop_ids
        shown_prompt_lp = s["prompt_logprobs"]
        if echo and logprobs is not None:
            s["prompt_logprobs"] = max(logprobs, s["prompt_logprobs"] or 0)
        hide = any(v == 0 for _p, v in asked)  # scoring a prompt: one token run, then dropped
        params = []
        for prompt in prompts:
            max_tokens = self._max_tokens(len(prompt), asked, default_max, prompt_param)
            if s["min_tokens"] > max_tokens:
                raise bad(f"min_tokens ({s['min_tokens']}) must not exceed max_tokens "
                          f"({max_tokens})", "min_tokens")
            params.append(SamplingParams(max_tokens=max(max_tokens, 1), logprobs=logprobs, **s))
        response_id = f"{id_prefix}-{request_id or uuid.uuid4().hex}"
        now = time.time()
        headers, requests = [], []
        for i, prompt in enumerate(prompts):
            rid = response_id if len(prompts) == 1 else f"{response_id}-{i}"
            headers.append(StreamHeader(
                kind, rid, self.served_names[0], int(now), params[i].n, len(prompt),
                stream=extras["_stream"], include_usage=extras["_include_usage"],
                continuous_usage=extras["_continuous"], resumable=resumable,
                logprobs=logprobs, stop=extras["_stop"],
                include_stop_str_in_output=extras["_include_stop"],
                skip_special_tokens=extras["_skip_special"], min_tokens=params[i].min_tokens,
                prompt_index=i, echo=echo, prompt_token_ids=list(prompt) if echo else [],
                hide_output=hide, prompt_logprobs=shown_prompt_lp,
                tokens_as_ids=extras["_tokens_as_ids"], tool_calls=tool_calls))
            requests.append(GenerationRequest(rid, prompt, params[i], priority=extras["_priority"],
                                              arrival_time=now))
        return Parsed(response_id, headers, requests, resumable)


def model_not_found(name: str, served: list[str]) -> ApiError:
    """OpenAI's 404 for a model this server does not serve."""
    return ApiError(404, f"The model `{name[:256]}` does not exist. This server serves "
                         f"{', '.join(map(repr, served))} (see GET /v1/models).",
                    param="model", code="model_not_found")
