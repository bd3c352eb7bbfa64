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

Being first in the queue is not enough when another tenant's running groups hold the seats
or the blocks: then a waiting request of a tenant with nothing running preempts, by
recompute, the latest groups of tenants that run more than one (each keeps its earliest),
as a more important request does under the priority policy (priority.py counts whether
that makes room). A victim goes to the back of its own tenant's line.

First-token steps: a step of decodes already running holds the first token of a request that
joins it by the whole step's time. So when the queue's head is the first request of a tenant
with nothing running, while another tenant runs more than one sequence, the head is
admitted in a step of its own (with any other such request behind it), and never two such
steps in a row: the decodes wait one short prefill step at most. Where every tenant runs
one sequence (many users, a request each) steps mix prefills and decodes as usual.

NOTE: the cost is what a request may hold (messages.token_cost: its prompt and every token
it may sample), the measure of the gateway's per-key token budget, so n=16 counts 16 times.
"""
from __future__ import annotations

from services.scheduler.sequence import SequenceGroup
from shared.messages import GenerationRequest, token_cost

# Finish times at or below V are forgotten (they would start at V anyway) once this many
# tenants are remembered (then twice as many as remain, so pruning stays rare).
_PRUNE_AT = 1024


class FairQueue:
    """Virtual start times of arriving requests, per tenant."""

    __slots__ = ("vtime", "finish", "prune_at")

    def __init__(self) -> None:
        self.vtime = 0.0
        self.finish: dict[str, float] = {}
        self.prune_at = _PRUNE_AT

    def start(self, req: GenerationRequest) -> float:
        """The virtual start of a request arriving now (and its tenant's new finish)."""
        finish = self.finish
        start = max(self.vtime, finish.get(req.tenant, 0.0))
        finish[req.tenant] = start + token_cost(req)
        if len(finish) > self.prune_at:
            v = self.vtime
            self.finish = {t: f for t, f in finish.items() if f > v}
            self.prune_at = max(_PRUNE_AT, 2 * len(self.finish))
        return start

    def requeue(self, group: SequenceGroup, order: int) -> tuple:
        """The queue key of a group preempted for another tenant: behind its tenant's line."""
        return (group.sort_key[0], self.start(group.request), order)

    def admitted(self, start: float) -> None:
        """A request of this virtual start was admitted: the virtual time moves up to it."""
        if start > self.vtime:
            self.vtime = start


def fair_candidates(head: SequenceGroup, running: list[SequenceGroup]) -> list[SequenceGroup]:
    """The running groups (queue order) that `head` may preempt for its tenant's share: none
    if its tenant runs anything; else every group of a tenant after that tenant's earliest,
    of head's priority or a lower one."""
    tenant = head.request.tenant
    first: set[str] = set()
    out = []
    for g in running:
        t = g.request.tenant
        if t == tenant:
            return []
        if t in first:
            if g.sort_key[0] >= head.sort_key[0]:
                out.append(g)
        else:
            first.add(t)
    return out


def first_token_step(head: SequenceGroup, running: list[SequenceGroup]) -> bool:
    """Whether `head` is admitted in a step of its own (see the module's docstring): it has
    output nothing yet, its tenant runs nothing, and another tenant runs more than one
    sequence."""
    if head.first_output_sent:
        return False
    tenant = head.request.tenant
    crowded = False
    seen: set[str] = set()
    for g in running:
        t = g.request.tenant
        if t == tenant:
            return False
        if g.max_num_seqs > 1 or t in seen:
            crowded = True
        seen.add(t)
    return crowded
