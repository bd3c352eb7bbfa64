"""Stream chunks written from preformatted bytes are the bytes of the JSON chunk objects."""
from __future__ import annotations

import pytest

from services.gateway.output import ChoiceDelta
from services.gateway.responses import Shapes, dumps
from shared.messages import StreamHeader

DELTAS = [
    [ChoiceDelta(0, "a")],
    [ChoiceDelta(0, "")],
    [ChoiceDelta(0, 'quote " back \\ nl \n tab \t uni é 漢 \U0001F600 ctl \x01')],
    [ChoiceDelta(1, "x"), ChoiceDelta(3, "", finish_reason="length")],
    [ChoiceDelta(0, "end", finish_reason="stop", stop_reason="</s>")],
    [ChoiceDelta(2, "", finish_reason="stop", stop_reason=2)],
    [ChoiceDelta(0, "abort", finish_reason="abort")],
]


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("deltas", DELTAS)
def test_text_chunks_from_bytes_equal_the_chunk_objects(kind, include_usage, deltas):
    spec = StreamHeader(kind, "cmpl-1", 'model "m"', 1700000000, 4, 3, stream=True,
                        include_usage=include_usage, continuous_usage=include_usage)
    shapes = Shapes(spec, None, "cmpl-1")
    for usage in ([None, {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}]
                  if include_usage else [None]):
        assert shapes.chunk_json(deltas, usage) == dumps(shapes.chunk(deltas, usage))
