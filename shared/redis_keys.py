"""Redis key names and stream conventions shared by the gateway and the scheduler.

    {prefix}:requests          stream, consumer group `schedulers`; field b"m" = GenerationRequest
    {prefix}:aborts            stream (capped); field b"m" = AbortRequest; every scheduler reads all
    {prefix}:out:{request_id}  stream, one per request; field b"m" = RequestOutput; TTL'd
                               (its first entry, field b"h" = StreamHeader, is the gateway's
                               response header: what any gateway needs to replay the stream)
    {prefix}:schedulers        hash: scheduler name -> last heartbeat (unix seconds)
    {prefix}:metrics:{name}    string: that scheduler's Prometheus exposition text (short TTL)
    {prefix}:degraded          hash: scheduler name -> why it cannot serve now (absent: fine)
    {prefix}:claim:{name}      string: the token of the scheduler process that holds the name's
                               pending requests ("taken by <other>" once another took them over)
    {prefix}:dash:watchers     string, short TTL: a dashboard page is open (shared/dashboard.py)
    {prefix}:dash:snap:{name}  string: that scheduler's latest block-map snapshot (short TTL)
    {prefix}:budget:{tenant}   hash: "<gateway id>/<n>" -> tokens, one API key's open requests
                               across every gateway process (services/gateway/limits.py)
    {prefix}:gateway:{id}      string, short TTL: that gateway process is alive (its budget
                               holdings count only while it is)

A client resumes a stream with Last-Event-ID = the Redis entry id of the last event it saw.
"""
from __future__ import annotations

from dataclasses import dataclass

MSG_FIELD = b"m"
HEADER_FIELD = b"h"       # an output stream's first entry: StreamHeader instead of b"m"
CONSUMER_GROUP = "schedulers"
OUTPUT_TTL_S = 600        # per-request output streams expire this long after their last write
FINISHED_OUTPUT_TTL_S = 120  # ... and this long after the request finished (still resumable)
ABORTS_MAXLEN = 10_000    # the abort stream is trimmed to about this many entries


@dataclass(frozen=True, slots=True)
class RedisKeys:
    prefix: str = "pagedserve"

    @property
    def requests(self) -> str:
        return f"{self.prefix}:requests"

    @property
    def aborts(self) -> str:
        return f"{self.prefix}:aborts"

    @property
    def schedulers(self) -> str:
        return f"{self.prefix}:schedulers"

    @property
    def degraded(self) -> str:
        return f"{self.prefix}:degraded"

    def output(self, request_id: str) -> str:
        return f"{self.prefix}:out:{request_id}"

    def claim(self, scheduler_name: str) -> str:
        return f"{self.prefix}:claim:{scheduler_name}"

    def metrics(self, scheduler_name: str) -> str:
        return f"{self.prefix}:metrics:{scheduler_name}"

    @property
    def metrics_pattern(self) -> str:
        """SCAN MATCH pattern over every scheduler's `metrics(name)` key."""
        return f"{self.prefix}:metrics:*"

    @property
    def dashboard_watchers(self) -> str:
        return f"{self.prefix}:dash:watchers"

    def dashboard(self, scheduler_name: str) -> str:
        return f"{self.prefix}:dash:snap:{scheduler_name}"

    def budget(self, tenant: str) -> str:
        return f"{self.prefix}:budget:{tenant}"

    def gateway_alive(self, gateway_id: str) -> str:
        return f"{self.prefix}:gateway:{gateway_id}"


def redis_where(url: str) -> str:
    """A Redis URL's host part for messages and logs: never its password."""
    return url.split("://", 1)[-1].split("@")[-1]
