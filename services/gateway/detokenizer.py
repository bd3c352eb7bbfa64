"""Incremental detokenization and stop strings: token ids in, text deltas out.

Two rules hold for every stream this module produces:

  1. the concatenated deltas equal `tokenizer.decode(all_ids, skip_special_tokens=...)`;
  2. a delta never ends inside a character: an incomplete UTF-8 sequence is held back
     until the token that completes it arrives (U+FFFD appears only where the full
     decode has it too, i.e. for bytes that can never become a character).

Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM) map every token to exact bytes,
so the delta of one token is one step of an incremental UTF-8 decoder: O(1) per token.
Other tokenizers (SentencePiece) go through the prefix/read-offset window used by vLLM:
decode a short window twice and emit the difference once it no longer ends in U+FFFD.
"""
from __future__ import annotations

import codecs

REPLACEMENT = "\ufffd"


def _byte_decoder() -> dict[str, int]:
    """GPT-2's reversible map, inverted: printable stand-in character -> raw byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = dict(zip(printable, printable)), 0
    for b in range(256):
        if b not in chars:  # control bytes and space get code points 256, 257, ...
            chars[b] = 256 + extra
            extra += 1
    return {chr(c): b for b, c in chars.items()}


class TokenVocab:
    """What each token id means as bytes and text; built once, shared by all requests."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        added = tokenizer.added_tokens_decoder            # id -> AddedToken
        # skip_special_tokens drops every added token flagged special (not only bos/eos)
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        self.size = len(tokenizer)
        self.eos_token_id = tokenizer.eos_token_id
        self.token_bytes: list[bytes] | None = None       # None: not a byte-level vocabulary
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        if decoder is not None and "ByteLevel" in repr(decoder):
            self.token_bytes = self._byte_table(tokenizer, added)
        # Each token's text when its bytes are whole characters, else None: between
        # characters, a token's delta is that text without a decoder step.
        self.token_text: list[str | None] | None = None
        if self.token_bytes is not None:
            self.token_text = [_whole(b) for b in self.token_bytes]

    @staticmethod
    def _byte_table(tokenizer, added) -> list[bytes] | None:
        to_byte = _byte_decoder()
        table = []
        for i, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
            if i in added:                   # added tokens are stored verbatim, not byte-mapped
                table.append(added[i].content.encode())
                continue
            try:
                table.append(bytes(to_byte[c] for c in piece or ""))
            except KeyError:                 # not really byte-level: use the generic path
                return None
        return table

    def piece(self, token_id: int) -> str:
        """One token's own text (for logprobs); U+FFFD where it holds part of a character."""
        if self.token_bytes is not None:
            if 0 <= token_id < len(self.token_bytes):
                return self.token_bytes[token_id].decode("utf-8", "replace")
            return ""
        return self.tokenizer.decode([token_id])

    def piece_bytes(self, token_id: int) -> list[int]:
        """The token's exact bytes (OpenAI's `bytes` field)."""
        if self.token_bytes is not None and 0 <= token_id < len(self.token_bytes):
            return list(self.token_bytes[token_id])
        return list(self.piece(token_id).encode())


def _whole(data: bytes) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


class IncrementalDetokenizer:
    """Feed token ids one at a time with `push`; call `finish` once at the end."""

    __slots__ = ("vocab", "skip_special", "_utf8", "_ids", "_prefix", "_read", "_between")

    def __init__(self, vocab: TokenVocab, skip_special_tokens: bool = True) -> None:
        self.vocab = vocab
        self.skip_special = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._ids: list[int] = []
        self._prefix = 0   # generic path: window start (tokens already emitted as context)
        self._read = 0     # generic path: tokens before this index have been emitted
        self._between = True   # byte-level: the decoder holds no part of a character

    def push(self, token_id: int) -> str:
        """The text this token completes ('' while a character is still incomplete)."""
        if self.skip_special and token_id in self.vocab.special_ids:
            return ""
        table = self.vocab.token_bytes
        if table is not None:
            if not 0 <= token_id < len(table):
                return ""
            if self._between:
                text = self.vocab.token_text[token_id]
                if text is not None:
                    return text
            text = self._utf8.decode(table[token_id])
            self._between = not self._utf8.getstate()[0]
            return text
        return self._push_generic(token_id)

    def finish(self) -> str:
        """Whatever is still held back (an incomplete character becomes U+FFFD, as in decode)."""
        if self.vocab.token_bytes is not None:
            self._between = True
            return self._utf8.decode(b"", final=True)
        decode = self.vocab.tokenizer.decode
        window = decode(self._ids[self._prefix:], skip_special_tokens=self.skip_special)
        done = decode(self._ids[self._prefix:self._read], skip_special_tokens=self.skip_special)
        self._prefix = self._read = len(self._ids)
        return window[len(done):]

    def _push_generic(self, token_id: int) -> str:
        # NOTE: decoding the window with its left context keeps SentencePiece's leading-space
        # rule right; the window stays a few tokens long, so this is O(1) per token too.
        self._ids.append(token_id)
        decode = self.vocab.tokenizer.decode
        done = decode(self._ids[self._prefix:self._read], skip_special_tokens=self.skip_special)
        window = decode(self._ids[self._prefix:], skip_special_tokens=self.skip_special)
        if len(window) > len(done) and not window.endswith(REPLACEMENT):
            self._prefix, self._read = self._read, len(self._ids)
            return window[len(done):]
        return ""


class StopStrings:
    """Finds the first stop string in streamed text and trims the output right before it.

    Text that could still turn out to be the start of a stop string is held back (never
    more than the longest stop string minus one character), so a client never sees text
    that is later cut.
    """

    __slots__ = ("stops", "include", "_held", "_longest")

    def __init__(self, stops: list[str], include_in_output: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include = include_in_output
        self._held = ""
        self._longest = max((len(s) for s in self.stops), default=0)

    def feed(self, text: str) -> tuple[str, str | None]:
        """(text safe to release, the stop string that matched or None). Stop after a match."""
        buf = self._held + text
        if not self.stops:
            self._held = ""
            return buf, None
        hit, at = None, len(buf) + 1
        for s in self.stops:
            i = buf.find(s)
            if 0 <= i < at:       # the earliest start wins (ties: the first listed)
                hit, at = s, i
        if hit is not None:
            self._held = ""
            return buf[:at + len(hit)] if self.include else buf[:at], hit
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], None

    def flush(self) -> str:
        """Release what was held back (the sequence ended without a stop string)."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
