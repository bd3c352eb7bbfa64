"""Every wire message round-trips through msgpack, and bad bytes are refused clearly."""
import msgpack
import pytest

from shared.messages import (AbortRequest, GenerationRequest, NewSeq, OutputConstraint,
                             RequestOutput, SamplingParams, SeqDelta, StepPlan, StepResult, StreamHeader,
                             TokenLogprob)
from shared.wire import WIRE_VERSION, WireError, decode, encode


def _examples():
    sp = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=40, seed=11, max_tokens=64,
                        stop_token_ids=[2, 7], logprobs=5, prompt_logprobs=1)
    yield GenerationRequest("req-1", [1, 2, 3], sp, priority=-1, arrival_time=1.5)
    constrained = SamplingParams(logit_bias={5: -100.0, 70000: 2.5}, allowed_token_ids=[1, 5],
                                 bad_words_ids=[[9], [3, 4]])
    yield GenerationRequest("req-3", [1], constrained)
    schema = SamplingParams(constraint=OutputConstraint("json_schema", '{"type": "object"}'))
    yield GenerationRequest("req-4", [1], schema)
    yield StreamHeader("completion", "cmpl-1-2", "m", 1700000000, 2, 3, stream=True,
                       include_usage=True, continuous_usage=True, resumable=False, logprobs=1,
                       stop=["END"], prompt_index=2, echo=True, prompt_token_ids=[1, 2, 3],
                       hide_output=True, prompt_logprobs=0, tokens_as_ids=True)
    yield AbortRequest("req-1", "client disconnected")
    yield RequestOutput("req-1", [SeqDelta(0, [5, 6], [TokenLogprob(5, -0.1, [[5, -0.1], [9, -2.5]]),
                                                       TokenLogprob(6, -0.2)], "stop", 2, -0.3)],
                        finished=True, num_prompt_tokens=3, num_cached_tokens=0,
                        prompt_logprobs=[None, TokenLogprob(2, -4.0, [[2, -4.0]])])
    yield RequestOutput("req-2", [], finished=True, error="prompt too long", error_code=400)
    yield StepPlan(7, [NewSeq(1, "req-1", [1, 2, 3], 3, [4, 9], sp, 2)],
                   seq_ids=[2, 1], num_computed_tokens=[17, 0], num_tokens=[1, 2],
                   num_append_tokens=[1, 0], append_token_ids=[42], block_keep=[1, -1],
                   block_append=[[8], []],
                   num_sampling_rows=1, swap_out=[[3, 0]], swap_in=[[1, 5]], copy=[[4, 6]],
                   finished_seq_ids=[9])
    # Two constrained rows of a 3-word vocabulary: packed bits travel as one bytes field.
    yield StepPlan(8, seq_ids=[2, 1, 3], num_computed_tokens=[5, 6, 7], num_tokens=[1, 1, 1],
                   num_append_tokens=[1, 1, 1], append_token_ids=[1, 2, 3],
                   block_keep=[-1, -1, -1],
                   block_append=[[], [], []], num_sampling_rows=3, bitmask_rows=[0, 2],
                   bitmask_words=3, token_bitmask=bytes(range(24)))
    yield StepResult(7, [42], [-0.5], [[[42, -0.5], [3, -1.0]]],
                     [[], [TokenLogprob(2, -3.0)]], forward_ms=3.5)
    yield StepResult(8, [], error="out of memory")


@pytest.mark.parametrize("msg", list(_examples()), ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    assert decode(encode(msg)) == msg
    assert decode(encode(msg), type(msg)) == msg


def test_decode_refuses_the_wrong_expected_type():
    with pytest.raises(WireError, match="expected StepResult"):
        decode(encode(StepPlan(1)), StepResult)


def test_decode_refuses_another_wire_version():
    data = msgpack.packb([WIRE_VERSION + 1, "StepPlan", 1])
    with pytest.raises(WireError, match="version"):
        decode(data)


def test_decode_refuses_garbage_and_unknown_types():
    with pytest.raises(WireError):
        decode(b"\xc1 not msgpack")
    with pytest.raises(WireError, match="unknown message type"):
        decode(msgpack.packb([WIRE_VERSION, "Pickle", 1]))


def test_trailing_fields_missing_take_defaults():
    """An older sender that does not know a newer optional field still decodes."""
    data = msgpack.packb([WIRE_VERSION, "StepResult", 5, [10], [-1.0]])
    assert decode(data) == StepResult(5, [10], [-1.0])


def test_a_decode_plan_stays_small():
    """A decode step of 256 sequences is a few bytes per sequence (diffs, not tables)."""
    n = 256
    plan = StepPlan(1000, seq_ids=list(range(n)), num_computed_tokens=[300] * n,
                    num_tokens=[1] * n, num_append_tokens=[1] * n, append_token_ids=[1234] * n,
                    block_keep=[-1] * n,
                    block_append=[[]] * n, num_sampling_rows=n)
    assert len(encode(plan)) < n * 16
