"""The Hermes-style tool-call parser: the same calls and content whether the text arrives
whole or a character at a time, tags split anywhere."""
import json

import pytest

from services.gateway.tools import CallParser, constraint, parse
from services.gateway.validation import ApiError

TEXT = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n')


def _run(pieces):
    """(content, calls assembled from the pieces as the SDK does, the parser's own calls)."""
    p = CallParser()
    content, calls = "", {}
    for piece in [*pieces, None]:
        c, deltas = p.feed(piece) if piece is not None else p.finish()
        content += c
        for d in deltas:
            if d.name is not None:
                assert d.index not in calls          # the name comes once, first
                calls[d.index] = {"name": d.name, "arguments": ""}
            calls[d.index]["arguments"] += d.arguments
    assembled = [calls[k] for k in sorted(calls)]
    assert assembled == p.calls
    return content, assembled


@pytest.mark.parametrize("size", [1, 3, 7, len(TEXT)])
def test_calls_and_content_do_not_depend_on_how_the_text_is_split(size):
    content, calls = _run([TEXT[i:i + size] for i in range(0, len(TEXT), size)])
    assert content == "Let me check. "
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Rome"}), ("add", {"a": 1, "b": 2})]


def test_text_that_only_looks_like_a_tag_stays_content():
    text = "a <tool b <tool_call>not json</tool_call> c <tool_c"
    for size in (1, len(text)):
        content, calls = _run([text[i:i + size] for i in range(0, len(text), size)])
        assert calls == [] and content == text


def test_a_named_tool_choice_is_a_one_call_grammar_and_unknown_names_are_refused():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}}]
    t = parse({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}})
    c = constraint(t)
    assert c.kind == "grammar" and "start: block\n" in c.spec and '"const": "f"' in c.spec
    assert constraint(parse({"tools": tools})) is None            # auto: not constrained
    assert parse({"tools": tools, "tool_choice": "none"}) is None
    with pytest.raises(ApiError, match="not among tools"):
        parse({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "g"}}})


def test_arguments_stream_as_the_model_writes_them_not_at_the_blocks_close():
    p = CallParser()
    c, deltas = p.feed('<tool_call>\n{"name": "add", "arguments": {"a": 1')
    assert c == "" and [(d.index, d.name) for d in deltas] == [(0, "add")]
    assert "".join(d.arguments for d in deltas) == '{"a": 1'
    _, deltas = p.feed(', "b": 2}')
    assert "".join(d.arguments for d in deltas) == ', "b": 2'   # the "}" may be the call's own
    _, deltas = p.feed('}\n</tool_call>\n')
    assert [(d.name, d.arguments) for d in deltas] == [(None, "}")]
    assert p.calls == [{"name": "add", "arguments": '{"a": 1, "b": 2}'}]
    assert p.finish() == ("", [])
