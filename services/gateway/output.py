"""Turns one request's stream of `RequestOutput`s into per-choice text deltas.

Each choice (sequence index 0..n-1) has its own incremental detokenizer and stop-string
matcher. Tokens are fed one at a time so that a stop string ends the choice at the exact
token that completed it: the text is trimmed right before the stop string, the tokens
after it are neither shown nor counted, and `needs_abort` tells the caller to free the
scheduler's blocks once every choice has ended.

Usage counts generated tokens: those shown, plus the stop token that ended a choice (it
was generated; vLLM counts it too), summed over the n choices.

Echo (completions): each choice's first delta starts with the prompt's text and, with
logprobs, the prompt tokens' logprobs (the first one null: nothing precedes it). With
`max_tokens: 0` the one token the scheduler ran (it always samples one) is dropped: the
choice ends with "length" and counts no completion token.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from services.gateway.detokenizer import IncrementalDetokenizer, StopStrings, TokenVocab
from shared.messages import RequestOutput, SeqDelta, StreamHeader, TokenLogprob


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice gained from one RequestOutput."""

    index: int
    text: str = ""
    logprobs: list[TokenLogprob | None] = field(default_factory=list)  # one per token counted
    text_offsets: list[int] = field(default_factory=list)       # chars before each token's text
    finish_reason: str | None = None
    stop_reason: int | str | None = None   # the stop string or stop token id that ended it
    echo_ids: list[int] = field(default_factory=list)  # echo with logprobs: the prompt's ids;
    # `logprobs` then starts with one entry per prompt token after the first (None if unknown)


class _Choice:
    __slots__ = ("index", "detok", "stop", "min_tokens", "num_tokens", "chars",
                 "finish_reason", "stop_reason", "text_parts")

    def __init__(self, index: int, spec: StreamHeader, vocab: TokenVocab) -> None:
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
        if (len(d.token_ids) == 1 and self.stop is None and not want_logprobs
                and d.finish_reason is None):
            # most tokens of a stream: one token's text, what the loop below makes of it
            self.num_tokens += 1
            piece = self.detok.push(d.token_ids[0])
            self.chars += len(piece)
            self.text_parts.append(piece)
            return ChoiceDelta(self.index, piece) if piece else None
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
                if want_logprobs and len(d.logprobs) > len(d.token_ids):
                    # the stop token is reported with its logprob (no text), as vLLM does
                    out.text_offsets.append(self.chars)
                    out.logprobs.append(d.logprobs[len(d.token_ids)])
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


def join(first: ChoiceDelta, then: ChoiceDelta) -> ChoiceDelta:
    """One delta for what a choice gained in two consecutive parts (echo, then tokens; or
    two outputs sent as one stream event)."""
    return ChoiceDelta(then.index, first.text + then.text, first.logprobs + then.logprobs,
                       first.text_offsets + then.text_offsets, then.finish_reason,
                       then.stop_reason, first.echo_ids)


class OutputProcessor:
    """One request's output state on the gateway. Feed RequestOutputs in stream order."""

    def __init__(self, spec: StreamHeader, vocab: TokenVocab) -> None:
        self.spec, self.vocab = spec, vocab
        self.choices = [_Choice(i, spec, vocab) for i in range(spec.n)]
        self.base = spec.prompt_index * spec.n   # choice j is numbered base + j in responses
        self.prompt_logprobs: list[TokenLogprob | None] | None = None   # as the scheduler sent
        self._echoed = not spec.echo
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
        if out.num_cached_tokens > self.num_cached_tokens:
            self.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = out.prompt_logprobs
        seqs = out.seqs
        if len(seqs) == 1 and self._echoed and not out.finished and not self.spec.hide_output:
            # one sequence's news (most outputs): what the general path below returns
            d = seqs[0]
            if not 0 <= d.index < len(self.choices) or self.choices[d.index].done:
                return []
            delta = self.choices[d.index].advance(d, self.spec.logprobs is not None)
            if delta is None:
                return []
            if delta.finish_reason is not None and d.finish_reason is None:
                self.stopped_here.append(d.index)
            delta.index += self.base
            return [delta]
        changed: dict[int, ChoiceDelta] = {}
        if not self._echoed:
            self._echoed = True
            for c in self.choices:
                changed[c.index] = self._echo(c)
        for d in out.seqs:
            if 0 <= d.index < len(self.choices) and not self.choices[d.index].done:
                if self.spec.hide_output:    # max_tokens 0: the token run is not an answer
                    d = SeqDelta(d.index, [], finish_reason="length")
                delta = self.choices[d.index].advance(d, self.spec.logprobs is not None)
                if delta is not None and d.index in changed:
                    delta = join(changed[d.index], delta)
                if delta is not None:
                    changed[d.index] = delta
                    if delta.finish_reason is not None and d.finish_reason is None:
                        self.stopped_here.append(d.index)
        if out.finished:
            self.scheduler_finished = True
            for c in self.choices:
                if not c.done:
                    changed[c.index] = c.force_end("abort")
        for delta in changed.values():       # this prompt's choices among all prompts'
            delta.index += self.base
        return [changed[i] for i in sorted(changed)]

    def _echo(self, c: _Choice) -> ChoiceDelta:
        """The prompt as the start of choice c: its text, and logprobs when asked."""
        ids = self.spec.prompt_token_ids
        detok = IncrementalDetokenizer(self.vocab, self.spec.skip_special_tokens)
        out = ChoiceDelta(c.index)
        pieces = []
        for t in ids:
            out.text_offsets.append(c.chars)
            pieces.append(detok.push(t))
            c.chars += len(pieces[-1])
        pieces.append(detok.finish())
        c.chars += len(pieces[-1])
        out.text = "".join(pieces)
        c.text_parts.append(out.text)
        if self.spec.logprobs is None:
            out.text_offsets = []
        elif ids:
            given = self.prompt_logprobs or []
            out.echo_ids = list(ids)
            # None where the scheduler sent none (it sends them whenever echo asks)
            out.logprobs = [given[i] if i < len(given) else None for i in range(1, len(ids))]
        return out

    @property
    def done(self) -> bool:
        if self.error is not None:
            return True
        for c in self.choices:               # (asked per output read: no generator)
            if c.finish_reason is None:
                return False
        return True

    @property
    def needs_abort(self) -> bool:
        """Every choice ended here (stop strings) but the scheduler still runs the request."""
        return self.done and not self.scheduler_finished

    def text(self, index: int) -> str:
        return "".join(self.choices[index].text_parts)

    def usage(self) -> dict:
        return usage_of([self])


def usage_of(procs: list[OutputProcessor]) -> dict:
    """OpenAI's usage object, summed over the prompts of one request."""
    prompt = sum(p.spec.prompt_tokens for p in procs)
    completion = sum(c.num_tokens for p in procs for c in p.choices)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion,
             "total_tokens": prompt + completion}
    cached = sum(p.num_cached_tokens for p in procs)
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage
