"""Typed reading of JSON request bodies, and the errors a client sees.

Every failed check is an `ApiError`: an HTTP status plus OpenAI's error body
{"error": {"message", "type", "param", "code"}}, naming the parameter and what to do.
"""
from __future__ import annotations

import logging
import math
from typing import Any

log = logging.getLogger("pagedserve.gateway")
_IGNORED: set[str] = set()       # field names already logged as ignored
_IGNORED_LOGGED_MAX = 256        # bounds the set: a client may send endless new names

_ERROR_TYPES = {401: "authentication_error", 404: "invalid_request_error",
                429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class ApiError(Exception):
    """An error a client sees: an HTTP status and OpenAI's error body, never a traceback."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code
        self.type = type or _ERROR_TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


class Fields:
    """Typed access to one JSON object; each failure is a 400 naming the field.

    Fields outside `allowed` are ignored, as vLLM's server ignores them (clients send
    OpenAI fields a local server has no use for, and other servers' extensions); each
    ignored name is logged once per process."""

    def __init__(self, body: Any, allowed: frozenset[str], where: str = "") -> None:
        if not isinstance(body, dict):
            raise bad(f"{where.rstrip('.') or 'the request body'} must be a JSON object",
                      where.rstrip(".") or None)
        self.body, self.where = body, where
        if len(body) > len(allowed) or not body.keys() <= allowed:
            self.body = {k: v for k, v in body.items() if k in allowed}
            _log_ignored(where, [k for k in body if k not in allowed])

    def raw(self, name: str) -> Any:
        return self.body.get(name)

    def int(self, name: str, default: int | None, lo: int | None = None,
            hi: int | None = None) -> int | None:
        v = self.body.get(name)
        if v is None:
            return default
        if type(v) is not int:
            raise bad(f"{self.where}{name} must be an integer, got {kind(v)}", self.where + name)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise bad(f"{self.where}{name} must be {_range(lo, hi)}, got {v}", self.where + name)
        return v

    def float(self, name: str, default: float, lo: float, hi: float,
              lo_open: bool = False) -> float:
        v = self.body.get(name)
        if v is None:
            return default
        if type(v) not in (int, float) or not math.isfinite(v):
            raise bad(f"{self.where}{name} must be a finite number, got {kind(v)}",
                      self.where + name)
        if v < lo or v > hi or (lo_open and v == lo):
            low = f"greater than {lo}" if lo_open else f"at least {lo}"
            raise bad(f"{self.where}{name} must be {low} and at most {hi}, got {v}",
                      self.where + name)
        return float(v)

    def bool(self, name: str, default: bool) -> bool:
        v = self.body.get(name)
        if v is None:
            return default
        if type(v) is not bool:
            raise bad(f"{self.where}{name} must be true or false, got {kind(v)}",
                      self.where + name)
        return v

    def str(self, name: str, default: str | None) -> str | None:
        v = self.body.get(name)
        return default if v is None else text(v, self.where + name)

    def neutral(self, name: str, *allowed: Any) -> None:
        """An OpenAI field this server does not implement: only its neutral value passes."""
        v = self.body.get(name)
        if v is not None and not any(type(v) is type(a) and v == a for a in allowed):
            raise bad(f"{name} is not supported by this server; remove it from the request",
                      name, "unsupported_parameter")


def _log_ignored(where: str, names: list[str]) -> None:
    for name in names:
        name = (where + str(name))[:100]      # a bounded name, whatever was sent
        if name not in _IGNORED and len(_IGNORED) < _IGNORED_LOGGED_MAX:
            _IGNORED.add(name)
            log.warning("ignoring the request field %r: this server does not use it (logged "
                        "once per field name)", name)


def text(v: Any, param: str) -> str:
    if not isinstance(v, str):
        raise bad(f"{param} must be a string, got {kind(v)}", param)
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(f"{param} is not valid Unicode (it holds a lone surrogate)", param) from None
    return v


def or_default(v: Any, default: Any) -> Any:
    return default if v is None else v


def kind(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null", int: "an integer", float: "a number"}.get(type(v), "a value")


def _range(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"between {lo} and {hi}"
    return f"at least {lo}" if lo is not None else f"at most {hi}"
