"""OpenAI response shapes: whole responses, stream chunks, logprobs, usage.

    /v1/completions       object "text_completion"       choices[i].text
    /v1/chat/completions  object "chat.completion"       choices[i].message.{role, content}
                          object "chat.completion.chunk" choices[i].delta.{role?, content}

With tools, chat text goes through tools.CallParser: tool-call blocks become
`tool_calls` (finish_reason "tool_calls"), the rest stays content.
Choices carry vLLM's `stop_reason` (the stop string or stop token id that ended them).
JSON cannot hold -inf: a logprob of -inf is sent as -9999.0, as vLLM does.
"""
from __future__ import annotations

import json

import orjson

from services.gateway.detokenizer import TokenVocab
from services.gateway.output import ChoiceDelta, OutputProcessor, usage_of
from services.gateway.tools import CallParser, message_calls, stream_entries
from shared.messages import StreamHeader, TokenLogprob

_FLOOR = -9999.0
_MARK = "\x00text\x00"     # stands for a chunk's text while its bytes around it are made


def dumps(obj) -> bytes:
    """Compact UTF-8 JSON. orjson writes a stream chunk several times faster than json
    (docs/overhead.md); json takes what orjson refuses (integers over 64 bits)."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"),
                          allow_nan=False).encode()


def _lp(x: float) -> float:
    return x if x > _FLOOR else _FLOOR      # also maps NaN-free -inf to the floor


class Shapes:
    """Builds the JSON bodies of one request's response (all its prompts' choices)."""

    def __init__(self, spec: StreamHeader, vocab: TokenVocab, response_id: str) -> None:
        self.spec, self.vocab = spec, vocab
        self.chat = spec.kind == "chat"
        self.base = {"id": response_id,
                     "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": spec.created, "model": spec.model}
        self.calls = spec.tool_calls and self.chat
        self.parsers: dict[int, CallParser] = {}     # choice index -> its stream's parser
        # text_chunk: per choice, the chunk's bytes before and after its text
        self.around: dict[int, tuple[bytes, bytes]] | None = (
            None if self.calls or spec.logprobs is not None or spec.continuous_usage else {})

    def token(self, t: int) -> str:
        """A token as logprobs name it: its text, or vLLM's "token_id:<id>" when asked."""
        return f"token_id:{t}" if self.spec.tokens_as_ids else self.vocab.piece(t)

    def completion_logprobs(self, d: ChoiceDelta) -> dict:
        k = self.spec.logprobs
        tokens, values, tops = [], [], []
        if d.echo_ids:                       # nothing precedes the first prompt token
            tokens.append(self.token(d.echo_ids[0]))
            values.append(None)
            tops.append(None)
        for i, lp in enumerate(d.logprobs):
            if lp is None:                   # a prompt position without a logprob
                tokens.append(self.token(d.echo_ids[i + 1]))
                values.append(None)
                tops.append(None)
                continue
            top = lp.top[:k] if k else [[lp.token_id, lp.logprob]]
            tokens.append(self.token(lp.token_id))
            values.append(_lp(lp.logprob))
            tops.append({self.token(t): _lp(v) for t, v in top})
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": d.text_offsets[:len(tokens)]}

    def chat_logprobs(self, lps: list[TokenLogprob]) -> dict:
        k = self.spec.logprobs

        def entry(t: int, v: float) -> dict:
            return {"token": self.token(t), "logprob": _lp(v),
                    "bytes": self.vocab.piece_bytes(t)}

        return {"content": [dict(entry(lp.token_id, lp.logprob),
                                 top_logprobs=[entry(t, v) for t, v in lp.top[:k]])
                            for lp in lps if lp is not None]}

    def _logprobs(self, d: ChoiceDelta) -> dict | None:
        if self.spec.logprobs is None:
            return None
        return self.chat_logprobs(d.logprobs) if self.chat else self.completion_logprobs(d)

    def prompt_logprobs(self, proc: OutputProcessor) -> list | None:
        """vLLM's prompt_logprobs: per prompt token {id: {logprob, rank, decoded_token}},
        the token itself and the top-k; None for the first token."""
        if proc.spec.prompt_logprobs is None:
            return None
        k = proc.spec.prompt_logprobs
        out: list = []
        for lp in proc.prompt_logprobs or []:
            if lp is None:
                out.append(None)
                continue
            ranked = lp.top[:k]
            entries = {lp.token_id: (lp.logprob, next(
                (r + 1 for r, (t, _v) in enumerate(lp.top) if t == lp.token_id), None))}
            for r, (t, v) in enumerate(ranked):
                entries.setdefault(t, (v, r + 1))
            out.append({str(t): {"logprob": _lp(v), "rank": rank,
                                 "decoded_token": self.token(t)}
                        for t, (v, rank) in entries.items()})
        return out

    def chunk(self, deltas: list[ChoiceDelta], usage: dict | None = None) -> dict:
        choices = []
        for d in deltas:
            c = {"index": d.index}
            reason = d.finish_reason
            if self.calls:
                parser = self.parsers.setdefault(d.index, CallParser())
                content, calls = parser.feed(d.text)
                if reason is not None:
                    rest, more = parser.finish()
                    content, calls = content + rest, calls + more
                c["delta"] = {"content": content} if content else {}
                if calls:
                    c["delta"]["tool_calls"] = stream_entries(self.base["id"], d.index, calls)
                reason = _calls_reason(reason, parser.num_calls)
            elif self.chat:
                c["delta"] = {"content": d.text} if d.text else {}
            else:
                c["text"] = d.text
            c.update(logprobs=self._logprobs(d), finish_reason=reason,
                     stop_reason=d.stop_reason)
            choices.append(c)
        body = dict(self.base, choices=choices)
        if self.spec.include_usage:
            body["usage"] = usage     # None, or the usage so far (continuous_usage_stats)
        return body

    def text_chunk(self, d: ChoiceDelta) -> bytes | None:
        """dumps(self.chunk([d])) for a delta that only adds text to one choice (most chunks
        of a stream), from the bytes around the text, made once per choice; None for any
        other delta (or request: logprobs, tool calls, usage in every chunk)."""
        if (self.around is None or not d.text or d.finish_reason is not None
                or d.stop_reason is not None):
            return None
        around = self.around.get(d.index)
        if around is None:
            head, _, tail = dumps(self.chunk([ChoiceDelta(d.index, _MARK)])).partition(
                dumps(_MARK))
            around = self.around[d.index] = (head, tail)
        return around[0] + dumps(d.text) + around[1]

    def role_chunk(self, indices: list[int], usage: dict | None = None) -> dict:
        """The chat stream's first event: every choice learns its role before any text."""
        body = dict(self.base, choices=[
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None} for i in indices])
        if self.spec.include_usage:
            body["usage"] = usage
        return body

    def usage_chunk(self, procs: list[OutputProcessor]) -> dict:
        return dict(self.base, choices=[], usage=usage_of(procs))

    def whole(self, procs: list[OutputProcessor],
              deltas_by_choice: dict[int, list[ChoiceDelta]]) -> dict:
        """The non-streamed response, from every delta each choice produced."""
        choices = []
        for proc in procs:
            prompt_lps = self.prompt_logprobs(proc)
            for c in proc.choices:
                deltas = deltas_by_choice.get(proc.base + c.index, [])
                merged = ChoiceDelta(proc.base + c.index, proc.text(c.index),
                                     [lp for d in deltas for lp in d.logprobs],
                                     [o for d in deltas for o in d.text_offsets],
                                     c.finish_reason, c.stop_reason,
                                     next((d.echo_ids for d in deltas if d.echo_ids), []))
                choice = {"index": merged.index}
                reason = c.finish_reason
                if self.calls:
                    parser = CallParser()
                    content = parser.feed(merged.text)[0] + parser.finish()[0]
                    calls = parser.calls
                    choice["message"] = {"role": "assistant", "content": content}
                    if calls:
                        choice["message"]["content"] = content or None
                        choice["message"]["tool_calls"] = message_calls(self.base["id"],
                                                                        merged.index, calls)
                    reason = _calls_reason(reason, len(calls))
                elif self.chat:
                    choice["message"] = {"role": "assistant", "content": merged.text}
                else:
                    choice["text"] = merged.text
                choice.update(logprobs=self._logprobs(merged), finish_reason=reason,
                              stop_reason=c.stop_reason)
                if prompt_lps is not None and not self.chat:
                    choice["prompt_logprobs"] = prompt_lps
                choices.append(choice)
        body = dict(self.base, object="chat.completion" if self.chat else "text_completion",
                    choices=choices, usage=usage_of(procs))
        if self.chat and procs[0].spec.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt_logprobs(procs[0])
        return body


def _calls_reason(reason: str | None, num_calls: int) -> str | None:
    """A choice that ended normally after making calls ends "tool_calls", as OpenAI says."""
    return "tool_calls" if reason == "stop" and num_calls else reason
