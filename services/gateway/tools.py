"""Tool calling in chat: `tools`, `tool_choice`, `parallel_tool_calls` in; `tool_calls` out.

One output format for every mode, Hermes-style (as vLLM's `hermes` tool parser reads it):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- The prompt: a template that renders `tools` itself gets them (apply_chat_template(tools=));
  one that does not (SmolLM2's) gets them in the system message, with the format above
  (`system_prompt`), and past calls / tool results written as Hermes writes them.
- `tool_choice`: "none" sends no tools to the model and parses nothing; "auto" lets the
  model choose, and `<tool_call>` blocks in its output become tool calls; "required" and a
  named function constrain the output with a grammar (the blocks, each a JSON object whose
  `arguments` follow that function's `parameters` schema), so the calls always validate.
  `parallel_tool_calls: false` allows one call.
- The response: `message.tool_calls` (content: the text outside the blocks, or null) and
  finish_reason "tool_calls". Streamed, content streams as it comes; each call goes out as
  one delta (id, type, name, the whole arguments string) when its block closes.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from services.gateway.validation import Fields, bad, kind
from shared.messages import OutputConstraint

FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})
OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
# Call JSON on one line, spaced as json.dumps spaces it: no runaway whitespace when sampled.
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(slots=True)
class Tools:
    functions: list[dict]      # OpenAI's tools[i].function: {name, description?, parameters?}
    choice: str                # "auto" | "required" | "named"
    name: str | None = None    # the function of a named tool_choice
    parallel: bool = True


def parse(body: dict) -> Tools | None:
    """The request's tools (None: none given, or tool_choice "none"). 400 on bad ones."""
    raw = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad(f"parallel_tool_calls must be a boolean, got {kind(parallel)}",
                  "parallel_tool_calls")
    if raw is None or raw == []:
        if choice not in (None, "none", "auto"):
            raise bad("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise bad(f"tools must be an array of at most {MAX_TOOLS} function tools", "tools")
    functions = []
    for i, t in enumerate(raw):
        tf = Fields(t, frozenset({"type", "function"}), f"tools[{i}].")
        if tf.str("type", None) != "function":
            raise bad(f"tools[{i}].type must be 'function'", f"tools[{i}].type")
        ff = Fields(tf.raw("function"), frozenset({"name", "description", "parameters",
                                                   "strict"}), f"tools[{i}].function.")
        name = ff.str("name", None)
        if not name:
            raise bad(f"tools[{i}].function.name is required", f"tools[{i}].function.name")
        params = ff.raw("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad(f"tools[{i}].function.parameters must be a JSON schema object",
                      f"tools[{i}].function.parameters")
        ff.bool("strict", False)
        functions.append({"name": name, "description": ff.str("description", None) or "",
                          "parameters": params or {"type": "object"}})
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise bad("tools must have distinct function names", "tools")
    if choice is None or choice == "auto":
        return Tools(functions, "auto", parallel=parallel is not False)
    if choice == "none":
        return None
    if choice == "required":
        return Tools(functions, "required", parallel=parallel is not False)
    cf = Fields(choice, frozenset({"type", "function"}), "tool_choice.")
    if cf.str("type", None) != "function":
        raise bad("tool_choice must be none, auto, required or "
                  '{"type": "function", "function": {"name": ...}}', "tool_choice")
    name = Fields(cf.raw("function"), frozenset({"name"}), "tool_choice.function.").str(
        "name", None)
    if name not in names:
        raise bad(f"tool_choice names the function {name!r}, which is not among tools",
                  "tool_choice.function.name")
    return Tools(functions, "named", name, parallel=False)


def constraint(tools: Tools) -> OutputConstraint | None:
    """The grammar of a required or named call: tool-call blocks whose JSON names one of the
    allowed functions and whose arguments follow its schema (llguidance Lark, %json)."""
    if tools.choice == "auto":
        return None
    allowed = [f for f in tools.functions if tools.choice == "required" or f["name"] == tools.name]
    bodies = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                "arguments": f["parameters"]},
               "required": ["name", "arguments"], "additionalProperties": False}
              for f in allowed]
    schema = bodies[0] if len(bodies) == 1 else {"anyOf": bodies}
    schema["x-guidance"] = _COMPACT
    # Parallel calls: at most one per allowed function (a small model repeats itself).
    blocks = "block" + " block?" * ((len(allowed) if tools.parallel else 1) - 1)
    lark = (f"start: {blocks}\n"
            f'block: "{_lark(OPEN)}\\n" call "\\n{_lark(CLOSE)}\\n"?\n'
            f"call: %json {json.dumps(schema)}\n")
    return OutputConstraint("grammar", lark)


def _lark(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"')


def system_prompt(tools: Tools) -> str:
    """The tools, for a template that cannot render them (Hermes' wording of the format)."""
    sigs = "\n".join(json.dumps({"type": "function", "function": f}) for f in tools.functions)
    return ("You are a function calling AI model. You are provided with function signatures "
            f"within <tools></tools> XML tags.\n<tools>\n{sigs}\n</tools>\n"
            "For each function call, return a json object with the function name and "
            f"arguments within {OPEN}{CLOSE} XML tags:\n"
            f'{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}')


def fallback_messages(msgs: list[dict], tools: Tools | None) -> list[dict]:
    """Messages for a template without tool support: tools in the system message, past
    calls as tool-call blocks in the assistant's text, tool results as Hermes writes them."""
    out = []
    for m in msgs:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        m.pop("tool_call_id", None)
        if calls:
            blocks = "\n".join(f"{OPEN}\n{json.dumps(c)}\n{CLOSE}" for c in calls)
            m["content"] = (m["content"] + "\n" if m["content"] else "") + blocks
        if m["role"] == "tool":
            m["content"] = f"<tool_response>\n{m['content']}\n</tool_response>"
        out.append(m)
    if tools is not None:
        sys = system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = dict(out[0], content=out[0]["content"] + "\n\n" + sys)
        else:
            out.insert(0, {"role": "system", "content": sys})
    return out


def history_calls(v: Any, where: str) -> list[dict]:
    """An assistant message's tool_calls, as {name, arguments (parsed)} for the template."""
    if not isinstance(v, list):
        raise bad(f"{where}tool_calls must be an array", where + "tool_calls")
    calls = []
    for j, c in enumerate(v):
        cf = Fields(c, frozenset({"id", "type", "function"}), f"{where}tool_calls[{j}].")
        ff = Fields(cf.raw("function"), frozenset({"name", "arguments"}),
                    f"{where}tool_calls[{j}].function.")
        args = ff.raw("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                raise bad(f"{where}tool_calls[{j}].function.arguments is not valid JSON",
                          f"{where}tool_calls[{j}].function.arguments") from None
        calls.append({"name": ff.str("name", None), "arguments": args})
    return calls


def call_id(response_id: str, choice: int, k: int) -> str:
    """A call's id, the same on every replay of the response (a resumed stream)."""
    return "call_" + hashlib.sha1(f"{response_id}:{choice}:{k}".encode()).hexdigest()[:24]


class CallParser:
    """One choice's output text → content and tool calls, incrementally.

    Text outside tool-call blocks is content, released as soon as it cannot be the start of
    a block; a block becomes a call when it closes. A block that does not parse as
    {"name", "arguments"} stays content."""

    __slots__ = ("pending", "inside", "num_calls")

    def __init__(self) -> None:
        self.pending = ""
        self.inside = False
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.pending += text
        content, calls = [], []
        while True:
            if self.inside:
                end = self.pending.find(CLOSE)
                if end < 0:
                    break
                body, self.pending = self.pending[:end], self.pending[end + len(CLOSE):]
                self.inside = False
                call = _call(body)
                if call is None:
                    content.append(OPEN + body + CLOSE)
                else:
                    calls.append(call)
                    self.num_calls += 1
                continue
            start = self.pending.find(OPEN)
            if start >= 0:
                content.append(self._outside(self.pending[:start]))
                self.pending = self.pending[start + len(OPEN):]
                self.inside = True
                continue
            keep = _partial_open(self.pending)
            content.append(self._outside(self.pending[:len(self.pending) - keep]))
            self.pending = self.pending[len(self.pending) - keep:]
            break
        return "".join(content), calls

    def _outside(self, text: str) -> str:
        """Whitespace between and after calls is not content."""
        return "" if self.num_calls and not text.strip() else text

    def finish(self) -> str:
        """Content still held back when the output ends (an unclosed block is content)."""
        rest = (OPEN if self.inside else "") + self.pending
        self.pending, self.inside = "", False
        return self._outside(rest)


def _partial_open(s: str) -> int:
    """Length of the longest suffix of s that is a proper prefix of OPEN."""
    for n in range(min(len(OPEN) - 1, len(s)), 0, -1):
        if OPEN.startswith(s[-n:]):
            return n
    return 0


def _call(body: str) -> dict | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if (not isinstance(obj, dict) or not isinstance(obj.get("name"), str)
            or not isinstance(obj.get("arguments", {}), dict)):
        return None
    return {"name": obj["name"], "arguments": json.dumps(obj.get("arguments", {}))}
