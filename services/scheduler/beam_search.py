"""Beam search over the executors' top-2k candidates (selection only: no blocks here).

Each step every live beam returns its best 2k [token, logprob] pairs (raw log_softmax). The
k * 2k candidates are ranked by cumulative logprob:

    candidate ends in a stop token (after min_tokens)  -> a finished hypothesis
    otherwise                                          -> the best k become the next beams

Hypotheses are ranked by the length-penalised score cum_logprob / len ** length_penalty,
len counting prompt and output tokens but not the stop token (as vLLM does). The search ends
at max_tokens (the beams become hypotheses, reason "length"), when no beam is left, or when
k hypotheses are finished and no live beam can still beat the worst of them.

The scheduler turns the selection into sequences: a beam chosen once continues in place, a
beam chosen several times forks (its blocks are shared), a beam not chosen is freed.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter

from shared.messages import SamplingParams, TokenLogprob

_first = itemgetter(0)


def beam_score(cumulative_logprob: float, seq_len: int, length_penalty: float) -> float:
    return cumulative_logprob / (max(seq_len, 1) ** length_penalty)


@dataclass(slots=True)
class BeamHypothesis:
    token_ids: list[int]            # output tokens (the stop token is not among them)
    cumulative_logprob: float
    score: float
    finish_reason: str              # "stop" | "length" | "abort"
    stop_token_id: int | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class BeamCandidate:
    parent: object                  # the Sequence it extends
    token_id: int
    logprob: float
    cumulative_logprob: float
    top: list                       # the parent's candidate list, for logprobs reporting


class BeamSearch:
    """State of one beam-search request: its finished hypotheses, best first, at most k."""

    def __init__(self, sampling: SamplingParams, prompt_len: int, max_model_len: int) -> None:
        self.width = sampling.beam_width
        self.length_penalty = sampling.length_penalty
        self.max_tokens = sampling.max_tokens
        self.min_tokens = sampling.min_tokens
        self.stop_ids = frozenset(sampling.stop_token_ids)
        self.num_logprobs = sampling.logprobs
        self.prompt_len = prompt_len
        # The longest a beam can get: bounds what a live beam can still score.
        self.max_len = min(prompt_len + sampling.max_tokens, max_model_len)
        self.finished: list[BeamHypothesis] = []

    def _hypothesis(self, parent, cum: float, reason: str, extra_token: int | None,
                    extra_lp: TokenLogprob | None, stop_token: int | None) -> BeamHypothesis:
        out = parent.token_ids[parent.prompt_len:]
        lps = list(parent.logprobs) if parent.logprobs is not None else None
        if extra_token is not None:
            out.append(extra_token)
            if lps is not None and extra_lp is not None:
                lps.append(extra_lp)
        score = beam_score(cum, self.prompt_len + len(out), self.length_penalty)
        return BeamHypothesis(out, cum, score, reason, stop_token, lps)

    def token_logprob(self, cand: BeamCandidate) -> TokenLogprob | None:
        if self.num_logprobs is None:
            return None
        return TokenLogprob(cand.token_id, cand.logprob, cand.top[:self.num_logprobs])

    def step(self, beams: list[tuple[object, list]]) -> tuple[list[BeamCandidate], bool]:
        """Rank the candidates of every live beam ([(seq, top), ...]).

        Returns (the next beams as candidates, best first; done). When done, the finished
        hypotheses are final (`best(n)`); the returned candidates are then empty.
        """
        k = self.width
        ranked = []                      # (cumulative logprob, beam, token, logprob)
        for i, (seq, top) in enumerate(beams):
            base = seq.cumulative_logprob
            for tok, lp in top[:2 * k]:
                ranked.append((base + lp, i, tok, lp))
        ranked.sort(key=_first, reverse=True)     # stable: ties keep beam order
        num_out_before = beams[0][0].num_output_tokens if beams else 0
        stop_ids = self.stop_ids
        stop_allowed = num_out_before >= self.min_tokens   # else masked, as the executor would
        running: list[BeamCandidate] = []
        for cum, i, tok, lp in ranked:
            if tok in stop_ids:
                if stop_allowed:
                    self.finished.append(self._hypothesis(beams[i][0], cum, "stop", None, None,
                                                          int(tok)))
            elif len(running) < k:
                running.append(BeamCandidate(beams[i][0], int(tok), lp, cum, beams[i][1]))
            elif not stop_ids:
                break                    # the rest can neither run on nor finish
        self._keep_best()
        out_len = num_out_before + 1
        if not running:
            return [], True
        if out_len >= self.max_tokens or self.prompt_len + out_len >= self.max_len:
            for c in running:
                self.finished.append(self._hypothesis(c.parent, c.cumulative_logprob, "length",
                                                      c.token_id, self.token_logprob(c), None))
            self._keep_best()
            return [], True
        if len(self.finished) >= k and self._cannot_improve(running[0].cumulative_logprob,
                                                            self.prompt_len + out_len):
            return [], True
        return running, False

    def _cannot_improve(self, best_cum: float, cur_len: int) -> bool:
        """No continuation of the best live beam can beat the k-th finished hypothesis.

        Logprobs are <= 0, so a beam's cumulative logprob only falls. With a positive length
        penalty the score is highest at the longest possible length; otherwise at the current one.
        """
        lp = self.length_penalty
        best_len = self.max_len if lp > 0 else cur_len
        return self.finished[self.width - 1].score >= beam_score(best_cum, best_len, lp)

    def _keep_best(self) -> None:
        self.finished.sort(key=lambda h: h.score, reverse=True)
        del self.finished[self.width:]

    def best(self, n: int, live: list | None = None) -> list[BeamHypothesis]:
        """The n best hypotheses; `live` beams (on abort) are ranked in as reason "abort"."""
        pool = list(self.finished)
        for seq in live or ():
            pool.append(self._hypothesis(seq, seq.cumulative_logprob, "abort", None, None, None))
        pool.sort(key=lambda h: h.score, reverse=True)
        return pool[:n]
