"""Per-key budgets: the admission of one client against the others, across every gateway.

A key is the Bearer token (the client's address when the gateway has no keys). Each key may
have at most key_max_requests requests open and key_max_tokens tokens in flight, where a
request costs its prompt tokens plus max_tokens for each sequence it runs (n, or the beam
width); more is a 429 with Retry-After, so one client's flood waits in its own retry loop
instead of in the queue ahead of everyone else. A request holds its share while its
connection is open.

The counts live in Redis, so that the gateway processes of `--api-server-count` (and
replicas behind one balancer) share one budget per key instead of multiplying it:

    {prefix}:budget:{tenant}   hash  "<gateway id>/<n>" -> tokens, one field per open request
    {prefix}:gateway:{id}      the gateway's liveness, a key with a TTL of LEASE_S that it
                               renews every LEASE_S / 3

Taking is one Lua script (atomic: two gateways never both take the last slot): it drops the
holdings of gateways whose liveness key is gone (a gateway killed -9 leaks nothing for
longer than LEASE_S), sums the rest, and adds the request's field if it fits. Giving back
deletes the field. Neither key nor token is stored: a budget is named by the key's hash.
"""
from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import uuid

from services.gateway.validation import ApiError
from shared.messages import GenerationRequest, token_cost
from shared.redis_keys import RedisKeys

log = logging.getLogger("pagedserve.gateway")

LEASE_S = 10.0          # a dead gateway's holdings stop counting after this long
_IDLE_EXPIRE_MS = 86_400_000   # a budget hash nobody touches for a day is dropped whole

# KEYS: the key's holdings, this gateway's liveness key.
# ARGV: holding id, cost, max requests (0: none), max tokens (0: none), lease ms,
#       the liveness keys' prefix, the hash's idle expiry ms.
_TAKE = """
redis.call('SET', KEYS[2], '1', 'PX', ARGV[5])
local held = redis.call('HGETALL', KEYS[1])
local n, tokens = 0, 0
for i = 1, #held, 2 do
  local gw = string.match(held[i], '^(.+)/')
  if gw and redis.call('EXISTS', ARGV[6] .. gw) == 1 then
    n = n + 1
    tokens = tokens + tonumber(held[i + 1])
  else
    redis.call('HDEL', KEYS[1], held[i])
  end
end
local cost, maxr, maxt = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if (maxr > 0 and n >= maxr) or (maxt > 0 and tokens + cost > maxt) then
  return {0, n, tokens}
end
redis.call('HSET', KEYS[1], ARGV[1], cost)
redis.call('PEXPIRE', KEYS[1], ARGV[7])
return {1, n, tokens}
"""


def tenant_id(key: str) -> str:
    """The opaque id of a client key: its budget's name in Redis and the tenant requests
    carry to the scheduler (fair admission). A hash: Redis and the scheduler never hold a
    key."""
    return hashlib.blake2b(key.encode(), digest_size=8, person=b"pagedserve.tnt").hexdigest()


def request_cost(requests: list[GenerationRequest]) -> int:
    """Tokens an HTTP request's prompts may hold in the KV cache at their end."""
    return sum(token_cost(r) for r in requests)


class KeyBudgets:
    """Open requests and tokens in flight per key, shared by every gateway on one Redis."""

    def __init__(self, queue, max_requests: int, max_tokens: int, retry_after: dict) -> None:
        self.queue = queue                    # RequestQueue: its client and its error mapping
        self.keys: RedisKeys = queue.keys
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self.retry_after = retry_after
        self.gateway_id = uuid.uuid4().hex[:16]
        self._numbers = itertools.count()
        self._take = queue.redis.register_script(_TAKE)
        self._unreleased: list[tuple[str, str]] = []   # (budget key, holding) Redis missed
        self._tasks: set[asyncio.Task] = set()
        self._renewer: asyncio.Task | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.max_requests or self.max_tokens)

    async def take(self, tenant: str, cost: int) -> tuple[str, str] | None:
        """Count one request of `cost` tokens against the key of `tenant`; raises ApiError
        (400 if it could never fit, 429 while the key holds too much; QueueUnavailable, a 503,
        when Redis does not answer). Returns the holding to give() back (None: no limits)."""
        if not self.enabled:
            return None
        if self.max_tokens and cost > self.max_tokens:
            raise ApiError(400, f"this request may use {cost} tokens (prompt + max_tokens per "
                                f"sequence), more than the {self.max_tokens} one API key may "
                                "hold: lower max_tokens or n", param="max_tokens",
                           code="token_budget_exceeded")
        if self._renewer is None:
            self._renewer = asyncio.create_task(self._renew())
        budget = self.keys.budget(tenant)
        holding = f"{self.gateway_id}/{next(self._numbers)}"
        ok, n, tokens = await self.queue.call(self._take(
            keys=[budget, self.keys.gateway_alive(self.gateway_id)],
            args=[holding, cost, self.max_requests, self.max_tokens, int(LEASE_S * 1000),
                  self.keys.gateway_alive(""), _IDLE_EXPIRE_MS]))
        if ok:
            return budget, holding
        if self.max_requests and n >= self.max_requests:
            busy = f"{n} requests of this API key are open (limit {self.max_requests})"
        else:
            busy = (f"this API key's open requests hold {tokens} tokens and this one needs "
                    f"{cost} (limit {self.max_tokens})")
        raise ApiError(429, f"{busy}; retry after {self.retry_after['Retry-After']} s",
                       code="key_limit", headers=self.retry_after)

    def give(self, holding: tuple[str, str] | None) -> None:
        """Give a holding back. Returns at once: the delete runs as its own task, so that a
        cancelled response still releases its share."""
        if holding is None:
            return
        task = asyncio.get_running_loop().create_task(self._release([holding]))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, holdings: list[tuple[str, str]]) -> None:
        try:
            async with self.queue.redis.pipeline(transaction=False) as pipe:
                for budget, holding in holdings:
                    pipe.hdel(budget, holding)
                await pipe.execute()
        except Exception as exc:  # noqa: BLE001 - retried by the renewer; never lost
            log.warning("could not give back %d budget holdings (%s); retrying",
                        len(holdings), exc)
            self._unreleased += holdings

    async def close(self) -> None:
        """A clean stop: this gateway's shares stop counting at once (its liveness key goes)."""
        if self._renewer is not None:
            self._renewer.cancel()
            self._renewer = None
            try:
                await self.queue.redis.delete(self.keys.gateway_alive(self.gateway_id))
            except Exception as exc:  # noqa: BLE001 - then its shares expire with the lease
                log.warning("could not drop the budget lease (%s)", exc)

    async def _renew(self) -> None:
        """Keep this gateway's holdings alive, and give back those Redis missed."""
        alive = self.keys.gateway_alive(self.gateway_id)
        while True:
            try:
                await self.queue.redis.set(alive, "1", px=int(LEASE_S * 1000))
            except Exception as exc:  # noqa: BLE001 - Redis down: takes answer 503 meanwhile
                log.warning("could not renew the budget lease (%s)", exc)
            if self._unreleased:
                holdings, self._unreleased = self._unreleased, []
                await self._release(holdings)
            await asyncio.sleep(LEASE_S / 3)


class Holding:
    """The ASGI response of a request that holds a key's budget until it is answered."""

    __slots__ = ("response", "budgets", "holding")

    def __init__(self, response, budgets: KeyBudgets, holding: tuple[str, str] | None) -> None:
        self.response, self.budgets, self.holding = response, budgets, holding

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.budgets.give(self.holding)
