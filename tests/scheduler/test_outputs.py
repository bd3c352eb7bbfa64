"""The published bytes of a step's news: StepOutputs.encoded() (what the scheduler service
writes to the output streams) against encode() of request_outputs() (the RequestOutputs)."""
from __future__ import annotations

import pytest

from services.scheduler.outputs import outgoing
from shared.messages import RequestOutput, SeqDelta, StepResult, TokenLogprob
from shared.wire import WireError, decode, encode, tuple_encoder
from tests.scheduler.test_scheduler import Engine


def _check(outs) -> int:
    whole = outs.request_outputs()
    sent = outs.encoded()
    assert [data for *_, data in sent] == [encode(o) for o in whole]
    for (request_id, finished, failed, num_tokens, data), w in zip(sent, whole):
        assert (request_id, finished, failed) == (w.request_id, w.finished, w.error is not None)
        assert num_tokens == sum(len(s.token_ids) for s in w.seqs)
        assert decode(data, RequestOutput) == w
    return len(sent)


def test_encoded_outputs_are_the_bytes_of_the_request_outputs_for_every_kind_of_row():
    # Stop tokens (with and without min_tokens), length ends, logprobs on the sampled token
    # and top candidates, parallel samples, a beam search, prefix-cached prompts, a prompt
    # logprobs first output: every path a step's news takes.
    kinds = [dict(max_tokens=5), dict(max_tokens=9, logprobs=2), dict(max_tokens=7, logprobs=0),
             dict(max_tokens=6, n=2), dict(max_tokens=4, beam_width=2, n=2),
             dict(max_tokens=8, prompt_logprobs=1), dict(max_tokens=30, min_tokens=3)]
    # Two stop rows: "stop0" samples its stop token third, "stop1" from the first, ignored
    # until min_tokens.
    e = Engine(gpu=256, cpu=64, script={"stop0": [5, 6, 9, 1, 1], "stop1": [9] * 8})
    e.add("stop0", 6, max_tokens=5, stop_token_ids=[9], logprobs=1)
    e.add("stop1", 7, max_tokens=8, stop_token_ids=[9], min_tokens=4)
    for i, sp in enumerate(kinds * 3):
        e.add(f"r{i}", list(range(1, 9 + i % 5)), **sp)
    stopped = rows = 0
    for _ in range(200):
        if not e.sched.has_unfinished():
            break
        plan = e.sched.schedule()
        if plan is None:
            continue
        outs = e.sched.update(plan, e.ex.execute(plan))
        rows += len(outs.rows)
        stopped += sum(1 for r in outs.rows if r[4] == "stop")
        assert _check(outs) == len(outs)
    assert not e.sched.has_unfinished()
    assert rows > 50 and stopped == 2     # the column path and the stop rows were checked


def test_a_failed_steps_outputs_encode_their_error():
    e = Engine()
    e.add("a", 6, max_tokens=4)
    plan = e.sched.schedule()
    outs = e.sched.update(plan, StepResult(plan.step_id, error="device lost"))
    assert _check(outs) == 1
    ((_, finished, failed, _, data),) = outs.encoded()
    assert finished and failed and decode(data, RequestOutput).error_code == 500


def test_outgoing_of_a_whole_output_and_the_tuple_encoder():
    out = RequestOutput("x", [SeqDelta(1, [3, 4], [TokenLogprob(3, -0.5, [[3, -0.5]])],
                                       "stop", 2, -1.0)], True, 7, 4)
    assert outgoing(out) == ("x", True, False, 2, encode(out))
    pack = tuple_encoder(RequestOutput)
    # nested messages as their field tuples or as messages: the same bytes
    assert pack(("x", [(1, [3, 4], [TokenLogprob(3, -0.5, [[3, -0.5]])], "stop", 2, -1.0)],
                 True, 7, 4, None, None, 0)) == encode(out)
    with pytest.raises(WireError):
        tuple_encoder(dict)
