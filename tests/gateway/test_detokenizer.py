"""Incremental detokenization, stop strings and per-choice output, with the real tokenizer."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from services.gateway.detokenizer import (
    REPLACEMENT,
    IncrementalDetokenizer,
    StopStrings,
    TokenVocab,
)
from services.gateway.output import OutputProcessor
from shared.messages import StreamHeader
from shared.messages import RequestOutput, SeqDelta

# Text with plenty of 2-, 3- and 4-byte UTF-8 characters (accents, CJK, emoji, ZWJ sequences).
TEXT = st.text(alphabet=st.one_of(
    st.characters(codec="utf-8", exclude_categories=("Cs",)),
    st.sampled_from("aé漢字日本語🎉👩‍🚀 \n\tΩж")), max_size=40)
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return TokenVocab(tokenizer)


@pytest.fixture(scope="module")
def generic_vocab(tokenizer):
    v = TokenVocab(tokenizer)
    v.token_bytes = None          # force the SentencePiece-style window path
    return v


def stream(vocab, ids, skip=True) -> list[str]:
    d = IncrementalDetokenizer(vocab, skip)
    return [d.push(i) for i in ids] + [d.finish()]


def test_smollm2_vocabulary_is_read_as_bytes(vocab):
    assert vocab.token_bytes is not None and len(vocab.token_bytes) == vocab.size


@FAST
@given(text=TEXT)
def test_deltas_of_real_text_join_to_the_full_decode_and_never_split_a_character(
        tokenizer, vocab, generic_vocab, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    for v in (vocab, generic_vocab):
        pieces = stream(v, ids)
        assert "".join(pieces) == full
        if REPLACEMENT not in full:   # (a few rare characters have no byte tokens here)
            assert not any(REPLACEMENT in p for p in pieces), pieces


@FAST
@given(ids=st.lists(st.one_of(st.integers(0, 49151), st.integers(0, 20)), max_size=30),
       skip=st.booleans())
def test_deltas_of_any_token_ids_join_to_the_full_decode(tokenizer, vocab, ids, skip):
    assert "".join(stream(vocab, ids, skip)) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_a_split_emoji_is_held_back_until_its_last_byte(tokenizer, vocab):
    ids = tokenizer.encode("🎉!", add_special_tokens=False)
    pieces = stream(vocab, ids)
    assert len(ids) >= 3                     # the emoji spans several byte tokens
    assert pieces[:len(ids) - 1].count("") >= 1
    assert "".join(pieces) == "🎉!" and "🎉" in pieces


def feed_chunks(stops: StopStrings, chunks: list[str]) -> tuple[str, str | None]:
    out = []
    for c in chunks:
        released, hit = stops.feed(c)
        out.append(released)
        if hit:
            return "".join(out), hit
    return "".join(out) + stops.flush(), None


@FAST
@given(text=TEXT, data=st.data())
def test_stop_string_cuts_right_before_itself_whatever_the_chunking(text, data):
    assume(len(text) >= 2)
    i = data.draw(st.integers(0, len(text) - 1))
    stop = text[i:data.draw(st.integers(i + 1, min(len(text), i + 6)))]
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=8)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    out, hit = feed_chunks(StopStrings([stop]), chunks)
    assert hit == stop
    assert out == text[:text.index(stop)]


def test_text_that_might_start_a_stop_string_is_held_then_released():
    s = StopStrings(["STOP"])
    assert s.feed("abc ST") == ("abc ", None)      # "ST" could begin "STOP"
    assert s.feed("ART") == ("START", None)        # it did not
    assert s.feed("x S") == ("x ", None)
    assert s.flush() == "S"                        # the sequence ended: nothing is lost


def test_earliest_stop_string_wins_and_can_be_kept_in_the_output():
    assert StopStrings(["cd", "bcde"]).feed("abcdef") == ("a", "bcde")
    assert StopStrings(["cd"], include_in_output=True).feed("abcdef") == ("abcd", "cd")


def spec(n=1, stop=(), logprobs=None, prompt_tokens=5, min_tokens=0) -> StreamHeader:
    return StreamHeader("completion", "r1", "m", 0, n, prompt_tokens, stop=list(stop),
                        logprobs=logprobs, min_tokens=min_tokens)


def test_stop_string_across_token_boundaries_trims_text_and_counts_generated_tokens(
        tokenizer, vocab):
    ids = tokenizer.encode("Hello world, the end is near", add_special_tokens=False)
    proc = OutputProcessor(spec(stop=["end is"]), vocab)
    text = ""
    for t in ids:          # one token per step, as the scheduler sends them
        for d in proc.process(RequestOutput("r1", [SeqDelta(0, [t])])):
            text += d.text
        if proc.done:
            break
    assert text == "Hello world, the "
    assert proc.choices[0].finish_reason == "stop" and proc.choices[0].stop_reason == "end is"
    # tokens up to the one completing "end is" were generated; the rest never counted
    upto = next(k for k in range(len(ids))
                if "end is" in tokenizer.decode(ids[:k + 1])) + 1
    assert proc.usage()["completion_tokens"] == upto
    assert proc.needs_abort


def test_stop_in_the_middle_of_a_multi_token_delta_drops_the_tokens_after_it(tokenizer, vocab):
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    proc = OutputProcessor(spec(n=2, stop=[" three"]), vocab)
    deltas = proc.process(RequestOutput("r1", [SeqDelta(0, ids), SeqDelta(1, ids[:2])]))
    assert [d.text for d in deltas] == ["one two", "one two"]
    assert deltas[0].finish_reason == "stop" and deltas[1].finish_reason is None
    assert not proc.done                     # choice 1 still runs: no abort yet
    proc.process(RequestOutput("r1", [SeqDelta(1, [], finish_reason="length")], finished=True))
    assert proc.done and not proc.needs_abort
    assert proc.text(1) == "one two"


def test_usage_sums_choices_and_counts_the_stop_token(tokenizer, vocab):
    proc = OutputProcessor(spec(n=2, prompt_tokens=7), vocab)
    proc.process(RequestOutput("r1", [SeqDelta(0, [28, 29, 30]), SeqDelta(1, [28])]))
    proc.process(RequestOutput("r1", [SeqDelta(0, [], finish_reason="stop", stop_token_id=2),
                                      SeqDelta(1, [31], finish_reason="length")], finished=True))
    assert proc.usage() == {"prompt_tokens": 7, "completion_tokens": 6, "total_tokens": 13}
    assert proc.choices[0].stop_reason == 2 and proc.choices[1].finish_reason == "length"


def test_stop_strings_apply_only_after_min_tokens(tokenizer, vocab):
    ids = tokenizer.encode("ab ab ab ab", add_special_tokens=False)   # "ab", " ab", " ab", ..
    proc = OutputProcessor(spec(stop=["ab"], min_tokens=3), vocab)
    text = "".join(d.text for t in ids
                   for d in proc.process(RequestOutput("r1", [SeqDelta(0, [t])])))
    assert text == "ab ab "                  # the stop string first counts in token 3
    assert proc.choices[0].finish_reason == "stop" and proc.usage()["completion_tokens"] == 3


@FAST
@given(text=TEXT, n=st.integers(1, 2), base=st.integers(0, 2))
def test_one_token_an_output_gives_the_text_and_counts_of_all_tokens_in_one(
        tokenizer, vocab, text, n, base):
    """The gateway's path for a one-token output (most of a stream) ends where the general
    path over the same tokens does: the same text, characters and tokens counted; a token
    that leaves a character incomplete shows nothing until the token that completes it."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assume(ids)
    header = spec(n=n)
    header.prompt_index = base               # a later prompt of a request: choices base*n+j
    per_token, at_once = OutputProcessor(header, vocab), OutputProcessor(header, vocab)
    shown = {j: "" for j in range(n)}
    for t in ids:
        for j in range(n):                   # each sequence's news in its own output
            for d in per_token.process(RequestOutput("r1", [SeqDelta(j, [t])])):
                assert d.text and d.index == base * n + j and d.finish_reason is None
                shown[d.index - base * n] += d.text
    end = [SeqDelta(j, [], finish_reason="length") for j in range(n)]
    tail = {d.index: d.text for d in per_token.process(RequestOutput("r1", end, finished=True))}
    whole = at_once.process(RequestOutput("r1", [SeqDelta(j, ids) for j in range(n)]))
    whole += at_once.process(RequestOutput("r1", end, finished=True))
    for j in range(n):
        assert shown[j] + tail[base * n + j] == per_token.text(j) == at_once.text(j)
        assert per_token.choices[j].chars == at_once.choices[j].chars
        assert per_token.choices[j].finish_reason == at_once.choices[j].finish_reason == "length"
    assert per_token.usage() == at_once.usage()
    assert per_token.done and at_once.done
