"""Structured-output request fields in, one validated `OutputConstraint` out.

Accepted (at most one kind per request, else 400):

    response_format   {"type": "text"} | {"type": "json_object"}
                      | {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    structured_outputs   vLLM's {"json": schema|str, "regex": str, "choice": [str],
                         "grammar": str (Lark or GBNF)}
    guided_json / guided_regex / guided_choice / guided_grammar   vLLM's older names

The constraint is compiled here once (llguidance, shared/constraints.py) so that a bad
schema, regex or grammar is a 400 naming the problem before anything is queued; the
scheduler compiles it again, cached by spec, for its matchers.
"""
from __future__ import annotations

import json
from typing import Any

from services.gateway.validation import Fields, bad, kind
from shared.constraints import GrammarError, validate
from shared.messages import OutputConstraint

FIELDS = frozenset({"response_format", "structured_outputs", "guided_json", "guided_regex",
                    "guided_choice", "guided_grammar"})
_SO_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
MAX_SPEC_CHARS = 200_000       # a schema or grammar's text

# Any JSON object (json_object mode), as OpenAI's JSON mode promises.
ANY_OBJECT = '{"type": "object"}'


def _spec(kind_: str, v: Any, param: str) -> OutputConstraint:
    if kind_ == "json_schema":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError as exc:
                raise bad(f"{param} is not valid JSON: {exc}", param) from None
        if not isinstance(v, (dict, bool)):
            raise bad(f"{param} must be a JSON schema object, got {kind(v)}", param)
        spec = json.dumps(v)   # property order is the output order
    elif kind_ == "choice":
        if (not isinstance(v, list) or not v
                or not all(isinstance(c, str) and c for c in v)):
            raise bad(f"{param} must be a non-empty array of non-empty strings", param)
        spec = json.dumps(v)
    else:
        if not isinstance(v, str) or not v:
            raise bad(f"{param} must be a non-empty string, got {kind(v)}", param)
        spec = v
    if len(spec) > MAX_SPEC_CHARS:
        raise bad(f"{param} is longer than {MAX_SPEC_CHARS} characters", param)
    return OutputConstraint(kind_, spec)


def _response_format(v: Any) -> tuple[str, OutputConstraint] | None:
    """(the parameter that names the constraint, the constraint), or None for text."""
    f = Fields(v, frozenset({"type", "json_schema"}), "response_format.")
    t = f.str("type", None)
    if t not in ("text", "json_object", "json_schema"):
        raise bad(f"response_format.type must be text, json_object or json_schema, got {t!r}",
                  "response_format.type")
    # A json_schema object is checked whatever the type (the published schema types it so),
    # and used only by type json_schema.
    param = "response_format.json_schema.schema"
    spec = None
    if t == "json_schema" or f.raw("json_schema") is not None:
        js = Fields(f.raw("json_schema"), frozenset({"name", "schema", "strict", "description"}),
                    "response_format.json_schema.")
        js.str("name", None)
        js.str("description", None)
        js.bool("strict", False)
        schema = js.raw("schema")
        if schema is None:
            raise bad(f"{param} is required", param)
        spec = _spec("json_schema", schema, param)
    if t == "text":
        return None
    if t == "json_object":
        return "response_format", OutputConstraint("json_schema", ANY_OBJECT)
    return param, spec


def constraint(body: dict) -> OutputConstraint | None:
    """The request's output constraint (None: free text). 400 on a bad or ambiguous one."""
    found: list[tuple[str, OutputConstraint]] = []
    rf = body.get("response_format")
    if rf is not None:
        named = _response_format(rf)
        if named is not None:
            found.append(named)
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad(f"structured_outputs must be an object, got {kind(so)}",
                      "structured_outputs")
        for key, kind_ in _SO_KEYS.items():
            if so.get(key) is not None:
                found.append((f"structured_outputs.{key}",
                              _spec(kind_, so[key], f"structured_outputs.{key}")))
    for key, kind_ in _SO_KEYS.items():
        if body.get(f"guided_{key}") is not None:
            found.append((f"guided_{key}", _spec(kind_, body[f"guided_{key}"], f"guided_{key}")))
    if not found:
        return None
    if len(found) > 1:
        raise bad("only one output constraint may be given, got "
                  + ", ".join(name for name, _ in found), found[1][0])
    param, c = found[0]
    check(c, param)
    return c


def check(c: OutputConstraint, param: str) -> None:
    """400 naming the problem when `c` does not compile."""
    try:
        validate(c, None)
    except GrammarError as exc:
        raise bad(str(exc)[:2000], param, "invalid_constraint") from None
