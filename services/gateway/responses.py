"""OpenAI response shapes: whole responses, stream chunks, logprobs, usage.

    /v1/completions       object "text_completion"       choices[i].text
    /v1/chat/completions  object "chat.completion"       choices[i].message.{role, content}
                          object "chat.completion.chunk" choices[i].delta.{role?, content}

Choices carry vLLM's `stop_reason` (the stop string or stop token id that ended them).
JSON cannot hold -inf: a logprob of -inf is sent as -9999.0, as vLLM does.
"""
from __future__ import annotations

import json

from services.gateway.detokenizer import TokenVocab
from services.gateway.output import ChoiceDelta, OutputProcessor
from services.gateway.protocol import ResponseSpec
from shared.messages import TokenLogprob

_FLOOR = -9999.0


def dumps(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def _lp(x: float) -> float:
    return x if x > _FLOOR else _FLOOR      # also maps NaN-free -inf to the floor


def completion_logprobs(vocab: TokenVocab, k: int, lps: list[TokenLogprob],
                        offsets: list[int]) -> dict:
    tops = []
    for lp in lps:
        top = lp.top[:k] if k else [[lp.token_id, lp.logprob]]
        tops.append({vocab.piece(t): _lp(v) for t, v in top})
    return {"tokens": [vocab.piece(lp.token_id) for lp in lps],
            "token_logprobs": [_lp(lp.logprob) for lp in lps],
            "top_logprobs": tops, "text_offset": offsets[:len(lps)]}


def chat_logprobs(vocab: TokenVocab, k: int, lps: list[TokenLogprob]) -> dict:
    def entry(t: int, v: float) -> dict:
        return {"token": vocab.piece(t), "logprob": _lp(v), "bytes": vocab.piece_bytes(t)}

    return {"content": [dict(entry(lp.token_id, lp.logprob),
                             top_logprobs=[entry(t, v) for t, v in lp.top[:k]])
                        for lp in lps]}


class Shapes:
    """Builds the JSON bodies of one request's response."""

    def __init__(self, spec: ResponseSpec, vocab: TokenVocab) -> None:
        self.spec, self.vocab = spec, vocab
        self.chat = spec.kind == "chat"
        self.base = {"id": spec.request_id,
                     "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": spec.created, "model": spec.model}

    def _logprobs(self, d: ChoiceDelta) -> dict | None:
        k = self.spec.logprobs
        if k is None:
            return None
        if self.chat:
            return chat_logprobs(self.vocab, k, d.logprobs)
        return completion_logprobs(self.vocab, k, d.logprobs, d.text_offsets)

    def chunk(self, deltas: list[ChoiceDelta]) -> dict:
        choices = []
        for d in deltas:
            c = {"index": d.index}
            if self.chat:
                c["delta"] = {"content": d.text} if d.text else {}
            else:
                c["text"] = d.text
            c.update(logprobs=self._logprobs(d), finish_reason=d.finish_reason,
                     stop_reason=d.stop_reason)
            choices.append(c)
        body = dict(self.base, choices=choices)
        if self.spec.include_usage:
            body["usage"] = None
        return body

    def role_chunk(self) -> dict:
        """The chat stream's first event: every choice learns its role before any text."""
        body = dict(self.base, choices=[
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None} for i in range(self.spec.n)])
        if self.spec.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, proc: OutputProcessor) -> dict:
        return dict(self.base, choices=[], usage=proc.usage())

    def whole(self, proc: OutputProcessor, deltas_by_choice: list[list[ChoiceDelta]]) -> dict:
        """The non-streamed response, from every delta each choice produced."""
        choices = []
        for c, deltas in zip(proc.choices, deltas_by_choice):
            merged = ChoiceDelta(c.index, proc.text(c.index),
                                 [lp for d in deltas for lp in d.logprobs],
                                 [o for d in deltas for o in d.text_offsets],
                                 c.finish_reason, c.stop_reason)
            lps = self._logprobs(merged)
            if self.chat:
                choices.append({"index": c.index, "message": {"role": "assistant",
                                                              "content": merged.text},
                                "logprobs": lps, "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason})
            else:
                choices.append({"index": c.index, "text": merged.text, "logprobs": lps,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {"id": self.spec.request_id,
                "object": "chat.completion" if self.chat else "text_completion",
                "created": self.spec.created, "model": self.spec.model,
                "choices": choices, "usage": proc.usage()}
