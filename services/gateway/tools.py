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
  finish_reason "tool_calls". Streamed, content streams as it comes; a call's first delta
  carries its id, type and name, and its arguments follow in fragments as the model writes
  them (CallParser).
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Callable

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


def fallback_messages(msgs: list[dict], tools: Tools | None, mark: Callable[[str], str]
                      ) -> list[dict]:
    """Messages for a template without tool support: tools in the system message, past
    calls as tool-call blocks in the assistant's text, tool results as Hermes writes them.
    Every text that comes from the request (tool descriptions and schemas, past calls'
    names and arguments) goes in as `mark(text)`, so it is tokenized as text like a message
    content: a special-token string in it never becomes a control token."""
    out = []
    for m in msgs:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        m.pop("tool_call_id", None)
        if calls:
            blocks = "\n".join(f"{OPEN}\n{json.dumps(c)}\n{CLOSE}" for c in calls)
            m["content"] += mark("\n" + blocks)
        if m["role"] == "tool":
            m["content"] = f"<tool_response>\n{m['content']}\n</tool_response>"
        out.append(m)
    if tools is not None:
        sys = mark(system_prompt(tools))
        if out and out[0]["role"] == "system":
            out[0] = dict(out[0], content=out[0]["content"] + "\n\n" + sys)
        else:
            out.insert(0, {"role": "system", "content": sys})
    return out


def guard_strings(v: Any, special: re.Pattern, mark: Callable[[str], str]) -> Any:
    """`v` (tools or call arguments for a template that renders them) with every string
    that holds a special-token string replaced by a mark of its JSON-escaped text: such
    templates write tools and arguments with `tojson`, and the mark's text is then
    tokenized as text. Strings without one are left as they are."""
    if isinstance(v, str):
        return mark(json.dumps(v, ensure_ascii=False)[1:-1]) if special.search(v) else v
    if isinstance(v, dict):
        return {guard_strings(k, special, mark): guard_strings(x, special, mark)
                for k, x in v.items()}
    if isinstance(v, list):
        return [guard_strings(x, special, mark) for x in v]
    return v


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


# The start of a call as the grammar (and Hermes) writes it: once this much of a block is
# in, the call's name is known and the rest, up to the block's last "}", is its arguments.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


@dataclass(slots=True)
class CallDelta:
    """A piece of one tool call, as it streams: the first piece of a call carries its name
    (and `arguments` "" or the start of them), later ones argument fragments only."""
    index: int                 # the call's index among the choice's calls
    name: str | None           # set on the call's first piece only
    arguments: str


class CallParser:
    """One choice's output text → content and tool calls, incrementally.

    Text outside tool-call blocks is content, released as soon as it cannot be the start of
    a block. A block that starts `{"name": "...", "arguments": ` (the grammar's form) is a
    call from then on: its name goes out at once and its arguments as the model writes them,
    each fragment ending before any "}" and whitespace that may be the object's own close;
    the block's last "}" ends them. A block of another shape becomes a call when it closes
    and parses as {"name", "arguments"}, else it stays content. `calls` holds every call so
    far, whole: feeding the text in one piece or a token at a time gives the same calls."""

    __slots__ = ("pending", "inside", "calls", "_start", "_sent")

    def __init__(self) -> None:
        self.pending = ""          # outside: held text that may open a block; inside: the body
        self.inside = False
        self.calls: list[dict] = []       # {"name", "arguments"} of each call so far
        self._start = -1           # inside a call: where its arguments start in the body
        self._sent = 0             # characters of its arguments already given out

    @property
    def num_calls(self) -> int:
        return len(self.calls)

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        """The content and the call pieces that `text` completes."""
        self.pending += text
        content: list[str] = []
        deltas: list[CallDelta] = []
        while True:
            if self.inside:
                end = self.pending.find(CLOSE)
                if end < 0:
                    self._stream(self.pending, deltas, final=False)
                    break
                body, self.pending = self.pending[:end], self.pending[end + len(CLOSE):]
                self._close(body, content, deltas)
                continue
            start = self.pending.find(OPEN)
            if start >= 0:
                content.append(self._outside(self.pending[:start]))
                self.pending = self.pending[start + len(OPEN):]
                self.inside, self._start, self._sent = True, -1, 0
                continue
            keep = _partial(self.pending, OPEN)
            content.append(self._outside(self.pending[:len(self.pending) - keep]))
            self.pending = self.pending[len(self.pending) - keep:]
            break
        return "".join(content), deltas

    def _stream(self, body: str, deltas: list[CallDelta], final: bool) -> None:
        """Give out what is new of the open block's call (announcing it when its head is in)."""
        if self._start < 0:
            m = _HEAD.match(body)
            if m is None or m.end() == len(body):    # (more whitespace may follow the head)
                return
            name = _unquote(m.group(1))
            if name is None:
                return
            self._start = m.end()
            self.calls.append({"name": name, "arguments": ""})
            deltas.append(CallDelta(len(self.calls) - 1, name, ""))
        args = body[self._start:] if final else body[self._start:len(body) - _partial(body, CLOSE)]
        args = args.rstrip()
        if args.endswith("}"):                   # maybe the object's own close: not yet
            args = args[:-1].rstrip()
        if len(args) > self._sent:
            k = len(self.calls) - 1
            self.calls[k]["arguments"] = args
            if deltas and deltas[-1].index == k:
                deltas[-1].arguments += args[self._sent:]
            else:
                deltas.append(CallDelta(k, None, args[self._sent:]))
            self._sent = len(args)

    def _close(self, body: str, content: list[str], deltas: list[CallDelta]) -> None:
        self.inside = False
        self._stream(body, deltas, final=True)
        if self._start >= 0:
            return
        call = _call(body)
        if call is None:
            content.append(OPEN + body + CLOSE)
        else:
            self.calls.append(call)
            deltas.append(CallDelta(len(self.calls) - 1, call["name"], call["arguments"]))

    def _outside(self, text: str) -> str:
        """Whitespace between and after calls is not content."""
        return "" if self.calls and not text.strip() else text

    def finish(self) -> tuple[str, list[CallDelta]]:
        """What is still held back when the output ends: an unclosed block is content, or
        the rest of its call's arguments when its head was in (a call cut by max_tokens)."""
        deltas: list[CallDelta] = []
        rest = ""
        if self.inside:
            self._stream(self.pending, deltas, final=True)
            if self._start < 0:
                rest = OPEN + self.pending
        else:
            rest = self.pending
        self.pending, self.inside = "", False
        return self._outside(rest), deltas


def _partial(s: str, tag: str) -> int:
    """Length of the longest suffix of s that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(s)), 0, -1):
        if tag.startswith(s[-n:]):
            return n
    return 0


def _unquote(s: str) -> str | None:
    try:
        return json.loads(f'"{s}"')
    except ValueError:
        return None


def _call(body: str) -> dict | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if (not isinstance(obj, dict) or not isinstance(obj.get("name"), str)
            or not isinstance(obj.get("arguments", {}), dict)):
        return None
    return {"name": obj["name"], "arguments": json.dumps(obj.get("arguments", {}))}


def stream_entries(response_id: str, choice: int, deltas: list[CallDelta]) -> list[dict]:
    """OpenAI's streamed `delta.tool_calls`: a call's first entry carries its index, id, type
    and name, later ones the index and an argument fragment (the SDK's accumulator appends
    fragments by index)."""
    out = []
    for d in deltas:
        fn = {"arguments": d.arguments}
        entry: dict = {"index": d.index}
        if d.name is not None:
            entry.update(id=call_id(response_id, choice, d.index), type="function")
            fn = {"name": d.name, "arguments": d.arguments}
        entry["function"] = fn
        out.append(entry)
    return out


def message_calls(response_id: str, choice: int, calls: list[dict]) -> list[dict]:
    """OpenAI's `message.tool_calls` of a whole response."""
    return [{"id": call_id(response_id, choice, k), "type": "function", "function": dict(c)}
            for k, c in enumerate(calls)]
