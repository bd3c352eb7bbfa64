"""Turns one request's stream of `RequestOutput`s into per-choice text deltas.

Each choice (sequence index 0..n-1) has its own incremental detokenizer and stop-string
matcher. Tokens are fed one at a time so that a stop string ends the choice at the exact
token that completed it: the text is trimmed right before the stop string, the tokens
after it are neither shown nor counted, and `needs_abort` tells the caller to free the
scheduler's blocks once every choice has ended.

Usage counts generated tokens: those shown, plus the stop token that ended a choice (it
was generated; vLLM counts it too), summed over the n choices.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from services.gateway.detokenizer import IncrementalDetokenizer, StopStrings, TokenVocab
from services.gateway.protocol import ResponseSpec
from shared.messages import RequestOutput, SeqDelta, TokenLogprob


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice gained from one RequestOutput."""

    index: int
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token counted
    text_offsets: list[int] = field(default_factory=list)       # chars before each token's text
    finish_reason: str | None = None
    stop_reason: int | str | None = None   # the stop string or stop token id that ended it


class _Choice:
    __slots__ = ("index", "detok", "stop", "min_tokens", "num_tokens", "chars",
                 "finish_reason", "stop_reason", "text_parts")

    def __init__(self, index: int, spec: ResponseSpec, vocab: TokenVocab) -> None:
        self.index = index
        self.detok = IncrementalDetokenizer(vocab, spec.skip_special_tokens)
        self.stop = StopStrings(spec.stop, spec.include_stop_str_in_output) if spec.stop else None
        self.min_tokens = spec.min_tokens
        self.num_tokens = 0       # generated tokens counted in usage
        self.chars = 0            # characters decoded so far (before stop trimming)
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.text_parts: list[str] = []

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def advance(self, d: SeqDelta, want_logprobs: bool) -> ChoiceDelta | None:
        out = ChoiceDelta(self.index)
        parts = []
        for k, token in enumerate(d.token_ids):
            self.num_tokens += 1
            if want_logprobs:
                out.text_offsets.append(self.chars)
                if k < len(d.logprobs):
                    out.logprobs.append(d.logprobs[k])
            piece = self.detok.push(token)
            self.chars += len(piece)
            released, hit = self._filter(piece)
            parts.append(released)
            if hit is not None:
                self._end(out, "stop", hit)
                break
        if not self.done and d.finish_reason is not None:
            released, hit = self._filter(self.detok.finish())
            parts.append(released)
            if hit is None and self.stop is not None:
                parts.append(self.stop.flush())
            if d.stop_token_id is not None:
                self.num_tokens += 1
            if hit is not None:
                self._end(out, "stop", hit)
            else:
                self._end(out, d.finish_reason,
                          d.stop_token_id if d.finish_reason == "stop" else None)
        out.text = "".join(parts)
        self.text_parts.append(out.text)
        if out.text or out.logprobs or out.finish_reason:
            return out
        return None

    def _filter(self, piece: str) -> tuple[str, str | None]:
        # like vLLM, stop strings count only once min_tokens tokens have been generated
        if self.stop is None or self.num_tokens < self.min_tokens:
            return piece, None
        return self.stop.feed(piece)

    def _end(self, out: ChoiceDelta, reason: str, stop_reason) -> None:
        self.finish_reason = out.finish_reason = reason
        self.stop_reason = out.stop_reason = stop_reason

    def force_end(self, reason: str) -> ChoiceDelta:
        """The scheduler finished the request without ending this choice (e.g. an abort)."""
        text = self.detok.finish() + (self.stop.flush() if self.stop is not None else "")
        self.text_parts.append(text)
        out = ChoiceDelta(self.index, text)
        self._end(out, reason, None)
        return out


class OutputProcessor:
    """One request's output state on the gateway. Feed RequestOutputs in stream order."""

    def __init__(self, spec: ResponseSpec, vocab: TokenVocab) -> None:
        self.spec = spec
        self.choices = [_Choice(i, spec, vocab) for i in range(spec.n)]
        self.scheduler_finished = False   # the scheduler has released the request
        # Choices that ended here at a stop string while the scheduler still runs their
        # sequence (n > 1): the caller stops each one (an abort of that index), then clears.
        self.stopped_here: list[int] = []
        self.error: tuple[str, int] | None = None   # (message, HTTP-ish status)
        self.num_cached_tokens = 0

    def process(self, out: RequestOutput) -> list[ChoiceDelta]:
        """The choices that changed, in index order ([] if nothing visible happened)."""
        if out.error:
            self.scheduler_finished = True
            code = out.error_code if 400 <= out.error_code < 600 else 500
            self.error = (out.error, code)
            return []
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        changed: dict[int, ChoiceDelta] = {}
        for d in out.seqs:
            if 0 <= d.index < len(self.choices) and not self.choices[d.index].done:
                delta = self.choices[d.index].advance(d, self.spec.logprobs is not None)
                if delta is not None:
                    changed[d.index] = delta
                    if delta.finish_reason is not None and d.finish_reason is None:
                        self.stopped_here.append(d.index)
        if out.finished:
            self.scheduler_finished = True
            for c in self.choices:
                if not c.done:
                    changed[c.index] = c.force_end("abort")
        return [changed[i] for i in sorted(changed)]

    @property
    def done(self) -> bool:
        return self.error is not None or all(c.done for c in self.choices)

    @property
    def needs_abort(self) -> bool:
        """Every choice ended here (stop strings) but the scheduler still runs the request."""
        return self.done and not self.scheduler_finished

    def text(self, index: int) -> str:
        return "".join(self.choices[index].text_parts)

    def usage(self) -> dict:
        completion = sum(c.num_tokens for c in self.choices)
        usage = {"prompt_tokens": self.spec.prompt_tokens, "completion_tokens": completion,
                 "total_tokens": self.spec.prompt_tokens + completion}
        if self.num_cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": self.num_cached_tokens}
        return usage
