"""The scheduler's real plans, results and outputs survive the msgpack wire unchanged."""
from __future__ import annotations

from services.scheduler.config import SchedulerConfig
from shared.messages import RequestOutput, StepPlan, StepResult
from shared.wire import decode, encode
from tests.scheduler.simulation import make_requests, simulate


def test_plans_results_and_outputs_round_trip_through_msgpack():
    seen = {"new_seqs": 0, "diffs": 0, "swap_out": 0, "swap_in": 0, "copy": 0, "finished": 0,
            "top": 0, "prompt_logprobs": 0, "outputs": 0}
    sizes = []

    def wire(msg):
        data = encode(msg)
        back = decode(data, type(msg))
        assert back == msg
        if isinstance(msg, StepPlan):
            sizes.append(len(data))
            seen["new_seqs"] += len(msg.new_seqs)
            seen["diffs"] += sum(1 for keep, blocks in zip(msg.block_keep, msg.block_append)
                                 if keep >= 0 or blocks)
            seen["swap_out"] += len(msg.swap_out)
            seen["swap_in"] += len(msg.swap_in)
            seen["copy"] += len(msg.copy)
            seen["finished"] += len(msg.finished_seq_ids)
        elif isinstance(msg, StepResult):
            seen["top"] += sum(1 for top in msg.top if top)
            seen["prompt_logprobs"] += sum(1 for lps in msg.prompt_logprobs if lps)
        elif isinstance(msg, RequestOutput):
            seen["outputs"] += 1
        return back

    requests = make_requests(300, seed=3)
    cfg = SchedulerConfig(block_size=4, max_num_seqs=32, max_num_batched_tokens=128,
                          max_model_len=128, preemption_mode="auto")
    over_wire = simulate(requests, cfg, 70, 40, wire=wire)
    direct = simulate(requests, cfg, 70, 40)
    assert all(v > 0 for v in seen.values()), seen
    assert over_wire.results == direct.results
    assert max(sizes) < 64 * 1024
