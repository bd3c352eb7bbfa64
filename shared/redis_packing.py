"""Redis commands packed by hiredis in one C call, for the gateway's and the scheduler's
clients.

redis-py's packers (with or without hiredis) first pass every argument through a Python
encoder: a generator step, isinstance tests and a call per argument. On the output path
that is per token: the scheduler's publishing script names a stream key, an entry and a
TTL per output, and the gateway's XREAD a key and a cursor per followed stream.
`hiredis.pack_command` takes str (as UTF-8), bytes, memoryview, int and float (as
`repr`), as redis-py's encoder writes them. Anything else (a bool or None, which redis-py
refuses with its DataError; a bytearray), and command names of two words ("SCRIPT LOAD"),
go to redis-py's own packer, so the bytes and errors are redis-py's in every case.
"""
from __future__ import annotations

from redis._parsers.encoders import Encoder
from redis.connection import PythonRespSerializer

try:
    from hiredis import pack_command
except ImportError:                  # redis[hiredis] not installed: redis-py's packer only
    pack_command = None

_BUFFER_CUTOFF = 6000                # redis-py's own (connection.py)


class CommandPacker:
    """A redis-py `command_packer`: `pack(*args)` -> the command's bytes, in a list."""

    __slots__ = ("fallback",)

    def __init__(self) -> None:
        self.fallback = PythonRespSerializer(_BUFFER_CUTOFF,
                                             Encoder("utf-8", "strict", False).encode)

    def pack(self, *args) -> list:
        name = args[0]
        if pack_command is not None and (b" " not in name if isinstance(name, bytes)
                                         else " " not in name):
            try:
                return [pack_command(args)]
            except TypeError:
                pass
        return self.fallback.pack(*args)


def packer() -> CommandPacker | None:
    """A packer for a client's connections, or None where hiredis is missing (redis-py's)."""
    return CommandPacker() if pack_command is not None else None

