"""The grammar bitmask applied by the sampler bans exactly the tokens whose bit is 0, on the
masked rows only, and leaves every allowed logit as it was."""
import random

import torch

from services.executor.sampler import Sampler, SampleRow, TokenMask
from shared.messages import SamplingParams


def test_mask_bans_exactly_the_cleared_bits_of_the_masked_rows():
    rng = random.Random(0)
    vocab, words = 70, 3                      # 96 bits: the last 26 are past the vocabulary
    allowed = {0: {1, 5, 31, 32, 69}, 2: set(range(0, 70, 3))}
    bits = bytearray()
    for r in (0, 2):
        word = sum(1 << t for t in allowed[r])
        bits += word.to_bytes(4 * words, "little")
    logits = torch.tensor([[rng.uniform(-5, 5) for _ in range(vocab)] for _ in range(3)])
    out = TokenMask([0, 2], words, bytes(bits)).apply(logits)
    for r in range(3):
        for t in range(vocab):
            if r == 1 or t in allowed[r]:
                assert out[r, t] == logits[r, t]
            else:
                assert out[r, t] == float("-inf")


def test_masked_rows_sample_only_allowed_tokens_greedy_and_sampled():
    vocab, words = 64, 2
    ok = {7, 40}
    bits = sum(1 << t for t in ok).to_bytes(8, "little") * 2
    logits = torch.randn(2, vocab)
    logits[:, 3] = 50.0                       # the unconstrained favourite is banned
    rows = [SampleRow(SamplingParams(temperature=0.0), [1], 1),
            SampleRow(SamplingParams(temperature=1.0, seed=3), [1], 1)]
    for _ in range(5):
        out = Sampler(0)(logits, rows, TokenMask([0, 1], words, bits))
        assert set(out.token_ids) <= ok
        # the reported logprob is the raw model's, not the masked distribution's
        raw = torch.log_softmax(logits, dim=-1)
        assert abs(out.logprobs[0] - raw[0, out.token_ids[0]].item()) < 1e-5
