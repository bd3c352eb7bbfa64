"""The OpenAPI 3.0 document served at /openapi.json, with this server's real limits.

The request schemas say what `protocol.py` reads; other fields are ignored, as vLLM
ignores them (`additionalProperties` is left open). Limits that depend on the prompt
(prompt + max_tokens <= max_model_len) cannot be written in a schema: a request valid here
may still get that 400.
"""
from __future__ import annotations

from services.gateway.prompt import ROLES

_INT64 = {"type": "integer", "format": "int64"}


def _opt(schema: dict, description: str | None = None) -> dict:
    out = dict(schema, nullable=True)
    if "enum" in out:                  # OpenAPI 3.0: a nullable enum must list null itself
        out["enum"] = [*out["enum"], None]
    if description:
        out["description"] = description
    return out


def _num(lo: float, hi: float, default: float, exclusive_lo: bool = False) -> dict:
    s = {"type": "number", "minimum": lo, "maximum": hi, "default": default}
    if exclusive_lo:
        s["exclusiveMinimum"] = True
    return _opt(s)


def _error(description: str) -> dict:
    return {"description": description, "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}


def openapi_document(cfg, served_names: list[str], vocab_size: int) -> dict:
    token = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    tokens = {"type": "array", "minItems": 1, "items": token}
    sampling = {
        "model": _opt({"type": "string", "enum": list(served_names)},
                      "a served model name (GET /v1/models); optional"),
        "n": _opt({"type": "integer", "minimum": 1, "maximum": cfg.max_n, "default": 1}),
        "best_of": _opt({"type": "integer", "minimum": 1, "maximum": cfg.max_n},
                        "with use_beam_search: beam width = max(n, best_of); else must equal n"),
        "use_beam_search": _opt({"type": "boolean", "default": False},
                                "vLLM extension: beam search; the n best beams are returned"),
        "length_penalty": _num(-10, 10, 1.0),
        "stream": _opt({"type": "boolean", "default": False}),
        "stream_options": _opt({"type": "object", "properties": {
            "include_usage": _opt({"type": "boolean"}),
            "continuous_usage_stats": _opt({"type": "boolean"},
                                           "vLLM extension: usage on every chunk")}},
                               "read only with stream=true"),
        "stop": _opt({"oneOf": [
            {"type": "string", "minLength": 1, "maxLength": cfg.max_stop_chars},
            {"type": "array", "maxItems": cfg.max_stop, "items": {
                "type": "string", "minLength": 1, "maxLength": cfg.max_stop_chars}}]}),
        "stop_token_ids": _opt({"type": "array", "maxItems": 256, "items": token}),
        "seed": _opt(dict(_INT64)),
        "temperature": _num(0, 2, 1.0),
        "top_p": _num(0, 1, 1.0, exclusive_lo=True),
        "top_k": _opt({"type": "integer", "minimum": -1, "maximum": 2**31 - 1, "default": 0},
                      "-1 or 0 disables it"),
        "min_p": _num(0, 1, 0.0),
        "max_tokens": _opt({"type": "integer", "minimum": 1, "maximum": cfg.max_model_len - 1},
                           f"new tokens per choice; prompt + max_tokens <= {cfg.max_model_len}"),
        "min_tokens": _opt({"type": "integer", "minimum": 0, "default": 0}),
        "presence_penalty": _num(-2, 2, 0.0),
        "frequency_penalty": _num(-2, 2, 0.0),
        "repetition_penalty": _num(0, 10, 1.0, exclusive_lo=True),
        "ignore_eos": _opt({"type": "boolean", "default": False}),
        "include_stop_str_in_output": _opt({"type": "boolean", "default": False}),
        "skip_special_tokens": _opt({"type": "boolean", "default": True}),
        "priority": _opt({"type": "integer", "minimum": -2**31, "maximum": 2**31 - 1,
                          "default": 0}, "lower is served first (scheduler policy 'priority')"),
        "user": _opt({"type": "string"}, "accepted and ignored"),
        "logit_bias": _opt({"type": "object", "maxProperties": 1024,
                            "propertyNames": {"pattern": r"^[0-9]{1,9}$"},
                            "additionalProperties": {"type": "number", "minimum": -100,
                                                     "maximum": 100}},
                           "token id (a string) -> bias added to its logit"),
        "allowed_token_ids": _opt(dict(tokens), "vLLM: only these tokens may be sampled"),
        "bad_words": _opt({"type": "array", "maxItems": 64, "items": {
            "type": "string", "minLength": 1, "maxLength": cfg.max_stop_chars,
            "pattern": r"\S"}}, "vLLM: words never generated"),
        "truncate_prompt_tokens": _opt({"type": "integer", "minimum": 1},
                                       "vLLM: keep only the prompt's last k tokens"),
        "return_tokens_as_token_ids": _opt({"type": "boolean"},
                                           "vLLM: logprob tokens as 'token_id:<id>'"),
        "prompt_logprobs": _opt({"type": "integer", "minimum": 0,
                                 "maximum": cfg.max_logprobs},
                                "vLLM: top-k logprobs of each prompt token (not with stream)"),
    }
    text_part = {"type": "object", "required": ["type"],
                 "properties": {"type": {"type": "string", "enum": ["text"]},
                                "text": _opt({"type": "string"})}}
    message = {"type": "object", "required": ["role"],
               "properties": {"role": {"type": "string", "enum": list(ROLES)},
                              "content": _opt({"oneOf": [{"type": "string"},
                                                         {"type": "array", "items": text_part}]}),
                              "name": _opt({"type": "string"})}}
    messages = {"type": "array", "minItems": 1, "items": {"$ref": "#/components/schemas/Message"}}
    prompt = {"oneOf": [{"type": "string", "minLength": 1}, tokens,
                        {"type": "array", "minItems": 1, "maxItems": cfg.max_prompts,
                         "items": {"type": "string", "minLength": 1}},
                        {"type": "array", "minItems": 1, "maxItems": cfg.max_prompts,
                         "items": tokens}]}
    sampling = dict(sampling, response_format=_opt({
        "type": "object", "required": ["type"], "properties": {
            "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
            "json_schema": _opt({"type": "object", "required": ["schema"], "properties": {
                "name": _opt({"type": "string"}), "description": _opt({"type": "string"}),
                "schema": {"oneOf": [{"type": "object"}, {"type": "boolean"}]},
                "strict": _opt({"type": "boolean"})}})}}, "the output follows the JSON schema"),
        # as services/gateway/structured.py reads it: null is an absent key (vLLM's
        # defaults); json is a schema (an object, or true/false) or the same as a string
        structured_outputs=_opt({"type": "object", "properties": {
            "json": _opt({"oneOf": [{"type": "object"}, {"type": "boolean"}]},
                         "a JSON schema (also accepted as a string holding one)"),
            "regex": _opt({"type": "string", "minLength": 1}),
            "choice": _opt({"type": "array", "minItems": 1,
                            "items": {"type": "string", "minLength": 1}}),
            "grammar": _opt({"type": "string", "minLength": 1})}},
            "vLLM: one of json, regex, choice, grammar"))
    completion = {"type": "object", "required": ["prompt"],
                  "properties": dict(sampling, prompt=prompt,
                                     max_tokens=_opt({"type": "integer", "minimum": 0,
                                                      "maximum": cfg.max_model_len - 1},
                                                     "new tokens per choice (0: score the "
                                                     "prompt, with echo); prompt + max_tokens "
                                                     f"<= {cfg.max_model_len}"),
                                     logprobs=_opt({"type": "integer", "minimum": 0,
                                                    "maximum": cfg.max_logprobs}),
                                     echo=_opt({"type": "boolean"},
                                               "the prompt (and its logprobs) first"),
                                     suffix=_opt({"type": "string", "enum": [""]}),
                                     add_special_tokens=_opt({"type": "boolean"}))}
    chat = {"type": "object", "required": ["messages"],
            "properties": dict(
                sampling, messages=messages,
                logprobs=_opt({"type": "boolean", "default": False}),
                top_logprobs=_opt({"type": "integer", "minimum": 0, "maximum": cfg.max_logprobs},
                                  "needs logprobs=true"),
                max_completion_tokens=_opt({"type": "integer", "minimum": 1,
                                            "maximum": cfg.max_model_len - 1}),
                add_generation_prompt=_opt({"type": "boolean", "default": True}),
                continue_final_message=_opt({"type": "boolean", "default": False},
                                            "vLLM: the last (assistant) message is continued"),
                chat_template_kwargs=_opt({"type": "object"},
                                          "vLLM: extra variables for the chat template"),
                tools=_opt({"type": "array", "items": {
                    "type": "object", "required": ["type", "function"], "properties": {
                        "type": {"type": "string", "enum": ["function"]},
                        "function": {"type": "object", "required": ["name"], "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "description": _opt({"type": "string"}),
                            "parameters": _opt({"type": "object"}),
                            "strict": _opt({"type": "boolean"})}}}}},
                    "function tools; calls come back as tool_calls (Hermes-style prompt)"),
                tool_choice=_opt({"oneOf": [
                    {"type": "string", "enum": ["none", "auto", "required"]},
                    {"type": "object", "required": ["type", "function"], "properties": {
                        "type": {"type": "string", "enum": ["function"]},
                        "function": {"type": "object", "required": ["name"],
                                     "properties": {"name": {"type": "string"}}}}}]},
                    "required and a named function are grammar-constrained"),
                parallel_tool_calls=_opt({"type": "boolean"}))}
    flags = {"add_special_tokens": _opt({"type": "boolean"}),
             "return_token_strs": _opt({"type": "boolean"}), "model": _opt({"type": "string"})}
    tokenize = {"oneOf": [
        # a body with messages is read as chat (its prompt, if any, is an unknown field)
        {"type": "object", "required": ["prompt"], "not": {"required": ["messages"]},
         "properties": dict(flags, prompt={"type": "string"})},
        {"type": "object", "required": ["messages"],
         "properties": dict(flags, messages=messages,
                            add_generation_prompt=_opt({"type": "boolean"}))}]}
    detokenize = {"type": "object", "required": ["tokens"],
                  "properties": {"model": _opt({"type": "string"}),
                                 "tokens": {"type": "array", "items": token}}}
    error = {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": "string", "nullable": True},
            "code": {"type": "string", "nullable": True}}}}}
    obj = {"type": "object"}
    # one server-sent event: `data` is a JSON chunk (or "[DONE]"), `id` its Redis entry id
    sse = {"type": "object", "properties": {"data": {"type": "string"}, "id": {"type": "string"},
                                            "event": {"type": "string"}}}
    health = {"type": "object", "required": ["status"], "properties": {
        "status": {"type": "string", "enum": ["ok", "degraded"]},
        "reason": {"type": "string"}, "schedulers": {"type": "array", "items": {"type": "string"}}}}

    headers = [
        {"name": "X-Request-Id", "in": "header", "required": False,
         "schema": {"type": "string", "pattern": r"^[A-Za-z0-9_.-]{1,100}$"},
         "description": "the request's id (cmpl-<it>), echoed in the response"},
        {"name": "X-Resumable-Stream", "in": "header", "required": False,
         "schema": {"type": "string"},
         "description": "\"true\": a resumable stream (one prompt): event ids, keep-alives, "
                        "and the request outlives a dropped connection by resume_grace_s"}]

    def generation(schema: str, summary: str) -> dict:
        return {"post": {
            "summary": summary,
            "parameters": headers,
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{schema}"}}}},
            "responses": {
                "200": {"description": "the completion (JSON), or with stream=true server-sent "
                                       "events (with header X-Resumable-Stream: true, events "
                                       "whose ids can resume the stream)",
                        "content": {"application/json": {"schema": obj},
                                    "text/event-stream": {"schema": sse}}},
                "400": _error("invalid parameters, malformed JSON, prompt too long, or "
                              "refused by the scheduler"),
                "401": _error("missing or wrong API key"),
                "404": _error("unknown model"),
                "413": _error(f"body over {cfg.max_body_bytes} bytes"),
                "429": _error("queue full: retry after Retry-After seconds"),
                "503": _error("Redis unreachable: retry after Retry-After seconds")},
            **({"security": [{"bearer": []}]} if cfg.api_keys else {})}}

    def plain(method: str, summary: str, body: str | None = None, v1: bool = False,
              codes: tuple = ("400",)) -> dict:
        op = {"summary": summary, "responses": {
            "200": {"description": "OK", "content": {"application/json": {"schema": obj}}},
            **{c: _error("see the error message") for c in codes}}}
        if body:
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{body}"}}}}
        if v1 and cfg.api_keys:
            op["security"] = [{"bearer": []}]
            op["responses"]["401"] = _error("missing or wrong API key")
        return {method: op}

    resume = {"get": {
        "summary": "Resume (or replay) a request's output stream as server-sent events",
        "parameters": [
            {"name": "request_id", "in": "path", "required": True,
             "schema": {"type": "string", "pattern": r"^[A-Za-z0-9_.-]{1,128}$"}},
            {"name": "Last-Event-ID", "in": "header", "required": False,
             "schema": {"type": "string", "pattern": r"^\d{1,20}(-\d{1,20})?$"},
             "description": "the id of the last event received; the stream continues after it"},
            {"name": "last_event_id", "in": "query", "required": False,
             "schema": {"type": "string", "pattern": r"^\d{1,20}(-\d{1,20})?$"}}],
        "responses": {
            "200": {"description": "the events after Last-Event-ID",
                    "content": {"text/event-stream": {"schema": sse}}},
            "400": _error("malformed Last-Event-ID"),
            "404": _error("unknown request id, or its stream expired"),
            "503": _error("Redis unreachable"),
            **({"401": _error("missing or wrong API key")} if cfg.api_keys else {})},
        **({"security": [{"bearer": []}]} if cfg.api_keys else {})}}

    return {
        "openapi": "3.0.3",
        "info": {"title": "pagedserve gateway", "version": "0.1.0",
                 "description": "OpenAI-compatible API over a PagedAttention engine. Errors are "
                                "{\"error\": {\"message\", \"type\", \"param\", \"code\"}}."},
        "paths": {
            "/v1/completions": generation("CompletionRequest", "Text completion"),
            "/v1/chat/completions": generation("ChatCompletionRequest", "Chat completion"),
            "/v1/streams/{request_id}": resume,
            "/v1/models": plain("get", "The served model", v1=True, codes=()),
            "/tokenize": plain("post", "Tokenize a prompt or chat messages (vLLM)", "Tokenize",
                               codes=("400", "404", "413")),
            "/detokenize": plain("post", "Token ids back to text (vLLM)", "Detokenize",
                                 codes=("400", "404", "413")),
            "/health": {"get": {"summary": "200 when Redis answers and a scheduler is alive",
                                "responses": {c: {"description": d, "content": {
                                    "application/json": {"schema": health}}}
                                    for c, d in (("200", "ok"), ("503", "degraded"))}}},
            "/ping": plain("get", "Liveness: 200 while the process is up", codes=()),
            "/version": plain("get", "The server's version (vLLM's shape)", codes=()),
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {
                "description": "text exposition",
                "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        },
        "components": {
            "schemas": {"CompletionRequest": completion, "ChatCompletionRequest": chat,
                        "Message": message, "Tokenize": tokenize, "Detokenize": detokenize,
                        "ErrorResponse": error},
            **({"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}
               if cfg.api_keys else {}),
        },
    }
