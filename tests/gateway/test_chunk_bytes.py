"""A stream chunk that only adds text is built from bytes made once per choice
(Shapes.text_chunk): those must be the very bytes the general chunk gives."""
import pytest

from services.gateway.output import ChoiceDelta
from services.gateway.responses import Shapes, dumps
from shared.messages import StreamHeader

TEXTS = ["a", " the", 'say "hi"\n', "\\", "é中😀", "\u2028", "</script>", "\x00", "\x1f"]


def spec(kind: str, **kw) -> StreamHeader:
    return StreamHeader(kind, "cmpl-1", "some/model-Name", 1700000000, 2, 3, stream=True, **kw)


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_text_only_chunk_has_the_bytes_of_the_general_chunk(kind, include_usage):
    shapes = Shapes(spec(kind, include_usage=include_usage), None, "resp-\"quoted\"-id")
    for index in (0, 3, 0):
        for text in TEXTS:
            d = ChoiceDelta(index, text)
            assert shapes.text_chunk(d) == dumps(shapes.chunk([d], None)), (index, text)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_other_deltas_and_requests_take_the_general_chunk(kind):
    shapes = Shapes(spec(kind), None, "resp-1")
    assert shapes.text_chunk(ChoiceDelta(0, "")) is None              # nothing to add
    assert shapes.text_chunk(ChoiceDelta(0, "a", finish_reason="length")) is None
    assert shapes.text_chunk(ChoiceDelta(0, "a", stop_reason="x")) is None
    for other in (spec(kind, logprobs=2), spec(kind, include_usage=True, continuous_usage=True)):
        assert Shapes(other, None, "resp-1").text_chunk(ChoiceDelta(0, "a")) is None
    if kind == "chat":
        calls = Shapes(spec(kind, tool_calls=True), None, "resp-1")
        assert calls.text_chunk(ChoiceDelta(0, "a")) is None
