"""Grammar state of constrained sequences (structured outputs, tool calls), on llguidance.

The scheduler sees every sampled token of every sequence, so it owns each constrained
sequence's matcher: when a plan is built, `fill_masks` gives every constrained sampling
row its bitmask of allowed next tokens (plan.add_bitmasks ships them in the StepPlan);
after the step, the sampled token is consumed (outputs.apply_result). A matcher tracks the
output tokens, not the KV cache, so it stays valid through swap and recompute preemption;
each of n samples has its own.

Off the step's critical path:

    add_request ──▶ waiting heap ──▶ head of the queue: attach()
                                       │ compiled (cached by spec): matchers, admitted
                                       │ not yet: hold(); the compile runs on the worker
                                       ▼ thread and the queue moves on without it
                                     ready() (each schedule): back into the heap

Compiling (the tokenizer's first load, ~0.5 s; a big schema's lexer, up to hundreds of ms)
happens on one worker thread; llguidance drops the GIL while it builds, so steps go on.
The masks of a step are written by llguidance, without the GIL, straight into one buffer
(no per-row Python bytes); a large batch on a many-core host fills them on LLExecutor's
threads (fill_masks).

llguidance has no torch or numpy dependency (the scheduler's wall), and is imported only
when the first constrained request arrives. Compiled grammars are cached by (kind, spec):
a new sequence of a known grammar costs one deep copy (microseconds), not a compile.
"""
from __future__ import annotations

import ctypes
import json
import os
import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

from services.scheduler.sequence import SequenceStatus
from shared.constraints import GrammarError, validate
from shared.messages import OutputConstraint

if TYPE_CHECKING:
    import llguidance

    from services.scheduler.scheduler import Scheduler
    from services.scheduler.sequence import Sequence, SequenceGroup

_CACHE_SIZE = 256      # compiled grammars kept (distinct schemas are few in practice)

__all__ = ["GrammarError", "Grammars", "admit_constrained", "fill_masks", "load_tokenizer"]

_executor = None       # llguidance.LLExecutor, made with the first parallel fill
_CORES = os.cpu_count() or 1
PARALLEL_MIN_ROWS = 16        # constrained rows in a step before masks go to LLExecutor
PARALLEL_MIN_CORES = 8
_mask_bytes = 0       # one mask: 4 * ceil(vocab / 32), set when a tokenizer is loaded


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
    tok = llguidance.LLTokenizer(text, eos_token=eos or None)
    _set_mask_bytes(tok)
    return tok


def _set_mask_bytes(tok: llguidance.LLTokenizer) -> None:
    global _mask_bytes
    _mask_bytes = (tok.vocab_size + 31) // 32 * 4


class Grammars:
    """Matchers for constrained sequences, from compiled grammars cached by constraint.

    The tokenizer is the served model's (read from its tokenizer folder on first use);
    `model=None` resolves the model the way every service does. Only the scheduler's
    thread calls these methods; the compile itself runs on `_pool`'s one thread."""

    def __init__(self, model: str | None = None, tokenizer=None) -> None:
        self.model = model
        self._tokenizer = tokenizer
        if tokenizer is not None:
            _set_mask_bytes(tokenizer)
        self._lock = threading.Lock()
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._compiling: dict[tuple[str, str], Future] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.held: list[SequenceGroup] = []     # out of the queue until their grammar is in

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                from shared.model_source import tokenizer_dir
                self._tokenizer = load_tokenizer(tokenizer_dir(self.model))
            return self._tokenizer

    def compile(self, constraint: OutputConstraint) -> llguidance.LLMatcher:
        """A matcher at the start of `constraint`'s grammar (the worker thread runs this).
        Raises GrammarError."""
        import llguidance

        try:
            grammar = validate(constraint, self.tokenizer)
            template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        except GrammarError:
            raise
        except Exception as exc:     # a tokenizer that does not load, a resource limit
            raise GrammarError(f"the {constraint.kind} could not be compiled: {exc}") from None
        if template.is_error():
            raise GrammarError(f"invalid {constraint.kind}: {template.get_error()}")
        return template

    def attach(self, group: SequenceGroup) -> bool:
        """Give every seq of `group` its own matcher, advanced over the tokens it has already
        output (a request taken over from another scheduler). False when the grammar is not
        compiled yet: its compile is started (once per spec) and the caller holds the group.
        Raises GrammarError when the grammar does not compile."""
        c = group.sampling.constraint
        key = (c.kind, c.spec)
        template = self._compiled.get(key)
        if template is None:
            job = self._compiling.get(key)
            if job is None:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
                job = self._compiling[key] = self._pool.submit(self.compile, c)
            if not job.done():
                return False
            del self._compiling[key]
            template = job.result()                       # raises GrammarError
            self._compiled[key] = template
            if len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        for seq in group.seqs:
            m = template.deep_copy()
            done = seq.token_ids[seq.prompt_len:]
            if done and not m.consume_tokens(done):
                raise GrammarError("the tokens this request already output do not follow "
                                   f"its {c.kind}: {m.get_error()}")
            seq.matcher = m
        return True

    def hold(self, group: SequenceGroup) -> None:
        if group not in self.held:
            self.held.append(group)

    def wait(self) -> bool:
        """Block until a held group's compile ends; False (at once) when none is held. For a
        scheduler with nothing else to run: its step would be empty anyway."""
        if not self.held:
            return False
        keys = {(g.sampling.constraint.kind, g.sampling.constraint.spec) for g in self.held
                if g.status == SequenceStatus.WAITING}
        wait([self._compiling[k] for k in keys if k in self._compiling],
             return_when=FIRST_COMPLETED)
        return True

    def ready(self) -> list[SequenceGroup]:
        """Held groups whose compile has ended (well or not), for the queue again: attach()
        gives them matchers, or the error, when they reach its head. Aborted ones drop."""
        back, still = [], []
        for group in self.held:
            if group.status != SequenceStatus.WAITING:
                continue
            c = group.sampling.constraint
            job = self._compiling.get((c.kind, c.spec))
            (still if job is not None and not job.done() else back).append(group)
        self.held = still
        return back


def admit_constrained(core: Scheduler, group: SequenceGroup) -> bool:
    """Matchers for a constrained group at the head of `core`'s queue. False when its
    grammar is still compiling (the group is held until then) or does not compile (the
    request ends with the error, in core.refused: the gateway checks every constraint
    first, so only a tokenizer-specific problem gets this far)."""
    try:
        if core.grammars.attach(group):
            return True
        core.grammars.hold(group)
    except GrammarError as exc:
        out = core.abort_request(group.request_id, "error")
        out.error, out.error_code = str(exc), 400
        core.refused.append(out)
    return False


def fill_masks(seqs: list[Sequence]) -> bytes:
    """The bitmasks of the tokens each seq's matcher allows next, one after another
    (little-endian int32 words, `_mask_bytes` each). A seq's stop tokens are allowed exactly
    when its grammar is complete (accepting). llguidance writes straight into one buffer,
    without the GIL: on LLExecutor's threads for a large batch on a host with cores to
    spare, else row by row on this thread (a thread hand-off costs more than a mask of
    tens of µs when there are few rows or cores: loadtest/bench_structured.py --mask-only)."""
    global _executor
    width = _mask_bytes
    buf = bytearray(width * len(seqs))
    # NOTE: the buffer outlives the calls and is not resized while llguidance writes it.
    addr = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
    if len(seqs) >= PARALLEL_MIN_ROWS and _CORES >= PARALLEL_MIN_CORES:
        if _executor is None:
            import llguidance
            _executor = llguidance.LLExecutor()
        _executor.unsafe_compute_mask_ptr([(s.matcher, k) for k, s in enumerate(seqs)], addr,
                                          width, len(seqs))
    else:
        for k, s in enumerate(seqs):
            s.matcher.unsafe_compute_mask_ptr(addr + k * width, width)
    n = width * 8
    for k, s in enumerate(seqs):
        base = k * width
        accepting = s.matcher.is_accepting()
        for t in s.group.stop_ids:
            if t < n:
                if accepting:
                    buf[base + (t >> 3)] |= 1 << (t & 7)
                else:
                    buf[base + (t >> 3)] &= ~(1 << (t & 7)) & 0xFF
    return bytes(buf)
