"""shared.redis_packing: the gateway's and the scheduler's Redis commands packed by hiredis
in one call, byte for byte as redis-py packs them, against a real Redis."""
from __future__ import annotations

import asyncio

import pytest
import redis
from redis._parsers.encoders import Encoder
from redis.connection import PythonRespSerializer

from services.gateway.queue import RequestQueue
from services.scheduler.redis_link import RedisLink
from shared.redis_keys import RedisKeys
from shared.redis_packing import CommandPacker, packer

pytest.importorskip("hiredis")

COMMANDS = [
    ("EVALSHA", "f" * 40, 3, "ps:claim:s", b"ps:requests", "ps:out:r1", "tok", 2, b"\x00\xff",
     -600, 3.25, 0.1 + 0.2, 1e20, 12345678901234567890),
    ("XREAD", "COUNT", 256, "BLOCK", 50, "STREAMS", "ps:out:é", "ps:out:b", "0-0", b"17-3"),
    ("SCRIPT LOAD", "return redis.call('PING')"),       # two words: redis-py splits them
    ("XINFO GROUPS", "ps:requests"),
    ("SET", "k", bytearray(b"ba")),                      # bytearray: redis-py's own packer
    ("SET", "k", memoryview(b"mv" * 5000)),
    (b"SET", b"k", b""),
]


def redis_py_bytes(*args) -> bytes:
    return b"".join(bytes(c) for c in PythonRespSerializer(
        6000, Encoder("utf-8", "strict", False).encode).pack(*args))


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: str(a[0]))
def test_same_bytes_as_redis_py(args):
    assert b"".join(bytes(c) for c in CommandPacker().pack(*args)) == redis_py_bytes(*args)


@pytest.mark.parametrize("bad", [True, None, object()])
def test_what_redis_py_refuses_is_refused_alike(bad):
    with pytest.raises(redis.DataError) as ours:
        CommandPacker().pack("SET", "k", bad)
    with pytest.raises(redis.DataError) as theirs:
        redis_py_bytes("SET", "k", bad)
    assert str(ours.value) == str(theirs.value)


def test_the_scheduler_link_publishes_through_it(redis_server):
    """The scheduler's client (as SchedulerService makes it): a round's publishing script,
    heartbeat and reads, packed by CommandPacker, reach Redis intact."""
    client = redis.Redis.from_url(redis_server.url, command_packer=packer())
    assert isinstance(client.connection_pool.get_connection()._command_packer, CommandPacker)
    keys = RedisKeys("pack-test")
    link = RedisLink(client, keys, "s0")
    link.ensure_group()
    link.hold_claim()
    outputs = [(f"r{i}", False, False, 1, f"entry-é-{i}".encode()) for i in range(300)]
    link.round(outputs, [], None, read=True, want=10)
    for i in (0, 299):
        [(_, fields)] = client.xrange(keys.output(f"r{i}"))
        assert list(fields.values()) == [f"entry-é-{i}".encode()]
        assert client.ttl(keys.output(f"r{i}")) > 0


def test_the_gateway_queue_reads_through_it(redis_server):
    """The gateway's asyncio pool packs with CommandPacker: a 300-stream XREAD (the
    follower's command) returns every stream's entry."""
    async def go():
        q = RequestQueue(redis_server.url, "pack-gw")
        conn = q.redis.connection_pool.make_connection()
        assert isinstance(conn._packer, CommandPacker)
        sync = redis.Redis.from_url(redis_server.url)
        streams = {f"pack-gw:s{i}": "0-0" for i in range(300)}
        for key in streams:
            sync.xadd(key, {"m": key.encode()})
        try:
            reply = await q.redis.xread(streams, count=10)
        finally:
            await q.close()
        got = {(k.decode() if isinstance(k, bytes) else k) for k, _ in
               (reply.items() if isinstance(reply, dict) else reply)}
        assert got == set(streams)
    asyncio.run(go())
