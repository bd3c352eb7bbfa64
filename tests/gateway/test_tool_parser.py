"""The Hermes-style tool-call parser: the same calls and content whether the text arrives
whole or a character at a time, tags split anywhere."""
import json

import pytest

from services.gateway.tools import CallParser, constraint, parse
from services.gateway.validation import ApiError

TEXT = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n')


def _run(pieces):
    p = CallParser()
    content, calls = "", []
    for piece in pieces:
        c, k = p.feed(piece)
        content += c
        calls += k
    return content + p.finish(), calls


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
