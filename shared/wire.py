"""msgpack codec for the typed messages in `shared.messages`.

Every message crossing a process boundary is a `@dataclass(slots=True)` declared in
`shared/messages.py`. On the wire a message is a msgpack array:

    [WIRE_VERSION, "TypeName", field_0, field_1, ...]

Fields go in declaration order (positional, no key strings: plans are sent every
iteration, so they stay small). Nested messages are encoded the same way, without the
version/type header. Decoding is driven by the dataclasses' type annotations, so adding a
message type needs no codec code. No pickle anywhere.
"""
from __future__ import annotations

import dataclasses
import operator
import os
import sys
import types
import typing
from functools import cache
from typing import Any, Callable, TypeVar

import msgpack

# The largest message a socket accepts (ZeroMQ MAXMSGSIZE), in bytes: a plan holds at most
# max_num_seqs whole prompts (NewSeq) of max_model_len tokens, a few MiB; a peer that sends
# more is cut off instead of making the receiver allocate it.
# NOTE: ZeroMQ drops the connection of a message over the limit without a word to either
# side, which would look like a lost peer or a step that never ends. So a sender checks
# the encoded size (`oversized`) and fails the step instead of sending. Both sides read
# the same variable (a test sets a small limit).
MAX_MESSAGE_BYTES = int(os.environ.get("PAGEDSERVE_MAX_MESSAGE_BYTES") or 64 << 20)
WIRE_VERSION = 6     # raised whenever a message changes its fields or their meaning

T = TypeVar("T")


class WireError(ValueError):
    """A message could not be decoded: wrong version, unknown type, or malformed body."""


_REGISTRY: dict[str, type] = {}


def message(cls: type[T]) -> type[T]:
    """Class decorator: a slotted dataclass registered as a wire message."""
    cls = dataclasses.dataclass(slots=True)(cls)
    _REGISTRY[cls.__name__] = cls
    return cls


@cache
def _fields_of(cls: type) -> Callable[[Any], tuple]:
    """A fast getter of a message's field values, in declaration order."""
    names = [f.name for f in dataclasses.fields(cls)]
    if len(names) == 1:
        name = names[0]
        return lambda obj: (getattr(obj, name),)
    return operator.attrgetter(*names)


def _default(obj: Any) -> Any:
    """msgpack calls this for what it cannot pack natively: our message dataclasses.
    Lists, ints, floats and strings are packed in C without reaching Python."""
    cls = type(obj)
    if cls.__name__ in _REGISTRY:
        return _fields_of(cls)(obj)
    raise TypeError(f"{cls.__name__} cannot cross a wire (not a registered message)")


def encode(msg: Any) -> bytes:
    """Serialise one registered message to bytes."""
    cls = type(msg)
    name = cls.__name__
    if name not in _REGISTRY:
        raise WireError(f"{name} is not a registered wire message")
    return msgpack.packb((WIRE_VERSION, name, *_fields_of(cls)(msg)), default=_default,
                         use_bin_type=True)


def tuple_encoder(cls: type) -> Callable[[tuple], bytes]:
    """A function that encodes a `cls` message given as the tuple of all its field values
    (declaration order; a nested message as a message or as its own field tuple): the bytes
    of `encode(cls(*fields))`, without building the message. For loops that publish one
    message per sequence per step. Not thread-safe (it keeps one msgpack.Packer): make one
    per loop."""
    if cls.__name__ not in _REGISTRY:
        raise WireError(f"{cls.__name__} is not a registered wire message")
    pack = msgpack.Packer(default=_default, use_bin_type=True).pack
    head = (WIRE_VERSION, cls.__name__)

    def encode_fields(fields: tuple) -> bytes:
        return pack(head + fields)
    return encode_fields


def oversized(data: bytes, what: str) -> str | None:
    """Why `data` (an encoded `what`) may not be sent: over MAX_MESSAGE_BYTES; else None."""
    if len(data) <= MAX_MESSAGE_BYTES:
        return None
    return (f"{what} is {len(data)} bytes, over the {MAX_MESSAGE_BYTES} bytes a message may "
            f"carry (PAGEDSERVE_MAX_MESSAGE_BYTES)")


def decode(data: bytes, expect: type[T] | None = None) -> T:
    """Parse bytes produced by `encode`. Raises WireError on any mismatch."""
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise WireError(f"not a msgpack message: {exc}") from None
    if raw.__class__ is not list or len(raw) < 2:
        raise WireError("message must be [version, type, ...fields]")
    if raw[0] != WIRE_VERSION:
        raise WireError(f"wire version {raw[0]} not supported (this build speaks {WIRE_VERSION})")
    name = raw[1]
    dec = _BY_NAME.get(name) if name.__class__ is str else None
    if dec is None:
        cls = _REGISTRY.get(name) if name.__class__ is str else None
        if cls is None:
            raise WireError(f"unknown message type {name!r}")
        dec = _BY_NAME[name] = (cls, _decoder(cls))
    if expect is not None and dec[0] is not expect:
        raise WireError(f"expected {expect.__name__}, got {name}")
    return dec[1](raw[2:])


_BY_NAME: dict[str, tuple[type, Callable[[Any], Any]]] = {}   # name -> (class, its decoder)


@cache
def _decoder(tp: Any) -> Callable[[Any], Any]:
    """Build a function turning plain msgpack data back into `tp`."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp, vars(sys.modules[tp.__module__]))
        fields = dataclasses.fields(tp)
        decs = [_decoder(hints[f.name]) for f in fields]
        if all(d is _identity for d in decs):
            def dec_plain(v: Any) -> Any:
                if not isinstance(v, list) or len(v) > len(decs):
                    raise WireError(f"bad {tp.__name__} body")
                return tp(*v)
            return dec_plain

        # Generated per class: only the fields that need converting are visited, without a
        # loop or a call per field (per output on the gateway's per-token path, where most
        # fields are plain values). Older senders may omit trailing fields: those take
        # their defaults.
        env = {"tp": tp, "WireError": WireError, "bad": f"bad {tp.__name__} body"}
        lines = ["def dec_dc(v):",
                 f"    if v.__class__ is not list or len(v) > {len(decs)}:",
                 "        raise WireError(bad)",
                 "    n = len(v)"]
        for i, d in enumerate(decs):
            if d is _identity:
                continue
            hint = hints[fields[i].name]
            item = _decoder(typing.get_args(hint)[0]) if typing.get_origin(hint) is list else None
            inner = _optional_inner(hint)
            if item is not None and item is not _identity:      # list[X]: X converted inline
                env[f"d{i}"] = item
                lines += [f"    if n > {i} and v[{i}]:", f"        v[{i}] = [d{i}(x) for x in v[{i}]]"]
            elif inner is not None:      # X | None: None passes, X is converted
                env[f"d{i}"] = inner
                lines += [f"    if n > {i} and v[{i}] is not None:", f"        v[{i}] = d{i}(v[{i}])"]
            else:
                env[f"d{i}"] = d
                lines += [f"    if n > {i}:", f"        v[{i}] = d{i}(v[{i}])"]
        lines.append("    return tp(*v)")
        exec("\n".join(lines), env)        # noqa: S102 (our own code, from the annotations)
        return env["dec_dc"]
    if origin in (list, tuple):
        args = typing.get_args(tp)
        inner = _decoder(args[0]) if args else (lambda x: x)
        if inner is _identity:
            return lambda v: v if origin is list else tuple(v)
        return lambda v: [inner(x) for x in v] if v else v
    if origin is dict:
        k, val = typing.get_args(tp)
        dv = _decoder(val)
        return lambda v: {key: dv(x) for key, x in v.items()}
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            inner = _decoder(args[0])
            if inner is _identity:
                return _identity
            return lambda v: None if v is None else inner(v)
        return _identity
    return _identity


def _identity(v: Any) -> Any:
    return v


def _optional_inner(tp: Any) -> Callable[[Any], Any] | None:
    """The decoder of X for an annotation X | None whose X needs converting; else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            inner = _decoder(args[0])
            return None if inner is _identity else inner
    return None
