"""Fair admission between tenants (API keys): start-time fair queueing over the waiting queue.

The gateway tags each request with an opaque tenant id (a hash of the client's API key, or of
its address on a gateway without keys; GenerationRequest.tenant). Within one priority, the
waiting queue is ordered by a virtual start time instead of arrival:

    start(request)  = max(V, finish(tenant))      when it arrives
    finish(tenant)  = start(request) + cost       cost: prompt + max_tokens per sequence
    V               = the largest start admitted so far

A tenant that sent nothing recently starts at V, ahead of every request another tenant
queued beyond its share; a tenant's own requests keep their arrival order. With one tenant
(or all requests untagged) the order is arrival order, as before. Idle tenants bank no
credit: their start is never below V.

NOTE: the cost is what a request may hold (its prompt and every token it may sample), the
same measure as the gateway's per-key token budget, so n=16 counts 16 times.
"""
from __future__ import annotations

from shared.messages import GenerationRequest

# Finish times at or below V are forgotten (they would start at V anyway) once this many
# tenants are remembered.
_PRUNE_AT = 1024


def request_cost(req: GenerationRequest) -> int:
    sp = req.sampling
    return len(req.prompt_token_ids) + max(1, sp.beam_width or sp.n) * max(1, sp.max_tokens)


class FairQueue:
    """Virtual start times of arriving requests, per tenant."""

    __slots__ = ("vtime", "finish")

    def __init__(self) -> None:
        self.vtime = 0.0
        self.finish: dict[str, float] = {}

    def start(self, req: GenerationRequest) -> float:
        """The virtual start of a request arriving now (and its tenant's new finish)."""
        finish = self.finish
        start = max(self.vtime, finish.get(req.tenant, 0.0))
        finish[req.tenant] = start + request_cost(req)
        if len(finish) > _PRUNE_AT:
            v = self.vtime
            self.finish = {t: f for t, f in finish.items() if f > v}
        return start

    def admitted(self, start: float) -> None:
        """A request of this virtual start left the waiting queue for the first time."""
        if start > self.vtime:
            self.vtime = start
