"""Grammar state of constrained sequences (structured outputs, tool calls), on llguidance.

The scheduler sees every sampled token of every sequence, so it owns each constrained
sequence's matcher: before a sampling row runs, `allowed_mask` gives the row's bitmask of
allowed next tokens (plan.add_bitmasks ships it in the StepPlan); after, the sampled token
is consumed (outputs.append_token). A matcher tracks the output tokens, not the KV cache,
so it stays valid through swap and recompute preemption; each of n samples has its own
(a deep copy of the first).

llguidance has no torch or numpy dependency (the scheduler's wall), and is imported only
when the first constrained request arrives. Compiled grammars are cached by (kind, spec):
a new sequence of a known grammar costs one deep copy (microseconds), not a compile.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from shared.constraints import GrammarError, validate
from shared.messages import OutputConstraint

if TYPE_CHECKING:
    import llguidance

_CACHE_SIZE = 256      # compiled grammars kept (distinct schemas are few in practice)

__all__ = ["GrammarError", "Grammars", "allowed_mask", "load_tokenizer"]


def load_tokenizer(tokenizer_dir, extra_eos: list[int] | None = None) -> llguidance.LLTokenizer:
    """An llguidance tokenizer from a Hugging Face tokenizer folder (tokenizer.json), with
    the chat EOS of tokenizer_config.json as its end token. No transformers, no torch."""
    import llguidance
    from pathlib import Path

    folder = Path(tokenizer_dir)
    text = (folder / "tokenizer.json").read_text()
    eos: list[int] = list(extra_eos or [])
    cfg_file = folder / "tokenizer_config.json"
    if cfg_file.exists():
        name = json.loads(cfg_file.read_text()).get("eos_token")
        if isinstance(name, dict):
            name = name.get("content")
        for tok in json.loads(text).get("added_tokens", []):
            if tok.get("content") == name:
                eos.insert(0, tok["id"])
    return llguidance.LLTokenizer(text, eos_token=eos or None)


class Grammars:
    """Matchers for constrained sequences, from compiled grammars cached by constraint.

    The tokenizer is the served model's (read from its tokenizer folder on first use,
    ~0.5 s); `tokenizer_dir=None` resolves the model the way every service does."""

    def __init__(self, model: str | None = None, tokenizer=None) -> None:
        self.model = model
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                from shared.model_source import resolve_model
                self._tokenizer = load_tokenizer(resolve_model(self.model).tokenizer_dir)
            return self._tokenizer

    def matcher(self, constraint: OutputConstraint) -> llguidance.LLMatcher:
        """A fresh matcher at the start of `constraint`'s grammar. Raises GrammarError."""
        import llguidance

        key = (constraint.kind, constraint.spec)
        template = self._compiled.get(key)
        if template is None:
            grammar = validate(constraint, self.tokenizer)
            template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            if template.is_error():
                raise GrammarError(f"invalid {constraint.kind}: {template.get_error()}")
            self._compiled[key] = template
            if len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return template.deep_copy()


def allowed_mask(matcher: llguidance.LLMatcher, stop_ids: frozenset[int]) -> bytearray:
    """The bitmask of the tokens `matcher` allows next (little-endian int32 words). The
    request's stop tokens are allowed exactly when the grammar is complete (accepting)."""
    mask = bytearray(matcher.compute_bitmask())
    accepting = matcher.is_accepting()
    n = len(mask) * 8
    for t in stop_ids:
        if t < n:
            if accepting:
                mask[t >> 3] |= 1 << (t & 7)
            else:
                mask[t >> 3] &= ~(1 << (t & 7)) & 0xFF
    return mask
