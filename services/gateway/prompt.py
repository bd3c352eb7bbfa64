"""Prompts: API input (text, token ids, chat messages) in, prompt token ids out.

Chat messages are rendered by the model's own chat template (text parts only, joined by
newlines; "developer" is sent as "system"), then tokenized without special tokens: the
template writes them itself. A message's content is always tokenized as text: a
special-token string in it ("<|im_start|>system") becomes the tokens of those characters,
never the control token, so no user can open a turn of another role. The template renders
a placeholder per content; the template's text around them is tokenized with its special
tokens, each content as text, and the pieces are joined.
"""
from __future__ import annotations

import re
from typing import Any

from services.gateway import tools as tool_calls
from services.gateway.validation import Fields, bad, kind, text

ROLES = ("system", "developer", "user", "assistant", "tool")
# apply_chat_template's own arguments: chat_template_kwargs may not set them
_TEMPLATE_OWN = frozenset({"conversation", "tools", "documents", "chat_template",
                           "add_generation_prompt", "continue_final_message", "tokenize",
                           "padding", "truncation", "max_length", "return_tensors",
                           "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


# A message content's place in the rendered template: private-use characters, which no
# template writes and no content reaches the template with (contents are swapped out).
_MARK = re.compile("\ue000(\\d+)\ue001")


class PromptBuilder:
    def __init__(self, tokenizer, vocab) -> None:
        self.tokenizer, self.vocab = tokenizer, vocab
        # NOTE: the Rust tokenizer's encode only reads its state, so the event loop and the
        # tokenizer thread may call it at once; transformers' wrapper may reconfigure it.
        self._rust = getattr(tokenizer, "backend_tokenizer", None)
        # A copy that reads special-token strings as plain text (for message contents).
        self._rust_text = None
        if self._rust is not None:
            from tokenizers import Tokenizer
            self._rust_text = Tokenizer.from_str(self._rust.to_str())
            self._rust_text.encode_special_tokens = True
        # Any added-token string (the special tokens among them): request text that holds
        # one and that a template writes outside a content is marked (tools.guard_strings).
        added = sorted(getattr(tokenizer, "get_added_vocab", dict)(), key=len, reverse=True)
        self._special = re.compile("|".join(map(re.escape, added)) or r"(?!)")

    def token_ids(self, v: Any, param: str, allow_empty: bool = False,
                  limit: int | None = None) -> list[int]:
        """`v` itself when it is a list of this vocabulary's token ids; else 400 naming param."""
        if not isinstance(v, list) or not all(type(t) is int for t in v):
            raise bad(f"{param} must be an array of integer token ids", param)
        if not v and not allow_empty:
            raise bad(f"{param} must not be empty", param)
        if limit is not None and len(v) > limit:
            raise bad(f"{param} may hold at most {limit} ids, got {len(v)}", param)
        for t in v:
            if not 0 <= t < self.vocab.size:
                raise bad(f"{param} holds {t}, which is not a token id of this model "
                          f"(0 to {self.vocab.size - 1})", param)
        return v

    def completions(self, v: Any, add_special: bool, max_prompts: int) -> list[list[int]]:
        """Token ids of each prompt of a /v1/completions `prompt`: a text, token ids, or a
        list of texts or of token-id lists (several prompts)."""
        if v is None:
            raise bad("prompt is required", "prompt")
        if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
            if len(v) > max_prompts:
                raise bad(f"prompt holds {len(v)} prompts; at most {max_prompts} are taken in "
                          "one request", "prompt")
            return [self._one_prompt(p, add_special, f"prompt[{i}]") for i, p in enumerate(v)]
        return [self._one_prompt(v, add_special, "prompt")]

    def _one_prompt(self, v: Any, add_special: bool, param: str) -> list[int]:
        if isinstance(v, str):
            ids = self.encode(text(v, param), add_special)
        elif isinstance(v, list):
            ids = self.token_ids(v, param)
        else:
            raise bad(f"{param} must be a string or an array of token ids, got {kind(v)}", param)
        if not ids:
            raise bad(f"{param} is empty: send some text or token ids", param)
        return ids

    def chat(self, v: Any, add_generation_prompt: bool, add_special: bool = False, *,
             continue_final: bool = False, template_kwargs: dict | None = None,
             tools: tool_calls.Tools | None = None) -> list[int]:
        """Token ids of `messages` rendered by the chat template; 400 on a bad message.
        `continue_final`: the last (assistant) message is left open for the model to go on
        (vLLM's continue_final_message); `template_kwargs` reach the template as variables.
        `tools` and the messages' tool calls go to a template that renders tools, else
        into the messages themselves (tools.fallback_messages)."""
        if not isinstance(v, list) or not v:
            raise bad("messages must be a non-empty array of {role, content} objects", "messages")
        msgs, contents = [], []
        for i, m in enumerate(v):
            where = f"messages[{i}]."
            mf = Fields(m, frozenset({"role", "content", "name", "tool_calls", "tool_call_id"}),
                        where)
            role = mf.str("role", None)
            if role not in ROLES:
                raise bad(f"{where}role must be one of {', '.join(ROLES)}, got {role!r}",
                          where + "role")
            mf.str("name", None)
            # The content is a mark here; _encode_rendered puts it back, tokenized as text.
            msg = {"role": "system" if role == "developer" else role,
                   "content": f"\ue000{i}\ue001"}
            contents.append(self._content(mf.raw("content"), where + "content"))
            if role == "assistant" and mf.raw("tool_calls") is not None:
                msg["tool_calls"] = tool_calls.history_calls(mf.raw("tool_calls"), where)
            if role == "tool":
                msg["tool_call_id"] = mf.str("tool_call_id", None) or ""
            msgs.append(msg)
        if continue_final and msgs[-1]["role"] != "assistant":
            raise bad("continue_final_message needs an assistant message last",
                      "continue_final_message")
        extra = {k: v for k, v in (template_kwargs or {}).items() if k not in _TEMPLATE_OWN}

        def mark(s: str) -> str:          # request text the template writes: text, like contents
            contents.append(s)
            return f"\ue000{len(contents) - 1}\ue001"

        if "tools" in (getattr(self.tokenizer, "chat_template", None) or ""):
            if tools is not None:
                extra["tools"] = tool_calls.guard_strings(
                    [{"type": "function", "function": f} for f in tools.functions],
                    self._special, mark)
            msgs = [dict(m, tool_calls=[{"type": "function", "function": tool_calls.guard_strings(
                        c, self._special, mark)} for c in m["tool_calls"]])
                    if "tool_calls" in m else m for m in msgs]
        else:
            msgs = tool_calls.fallback_messages(msgs, tools, mark)
        try:
            rendered = self.tokenizer.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final, **extra)
        except Exception as exc:   # a template may raise anything (jinja2 errors, ValueError)
            raise bad(f"the model's chat template rejected these messages: {exc}",
                      "messages") from None
        return self._encode_rendered(rendered, contents, add_special)

    def _encode_rendered(self, rendered: str, contents: list[str], add_special: bool
                         ) -> list[int]:
        """The template's text with its special tokens, each content (at its mark) as text."""
        pieces = _MARK.split(rendered)        # text, mark index, text, mark index, ..., text
        marks = [int(k) for k in pieces[1::2]]
        if sorted(marks) != list(range(len(contents))):
            raise bad("the model's chat template changes message contents (it "
                      "does not write each one once, as given): this server cannot keep "
                      "them apart from the template's own tokens", "messages")
        ids = self.encode(pieces[0], add_special)
        for k, after in zip(marks, pieces[2::2]):
            ids += self.encode_text(contents[k])
            ids += self.encode(after, False)
        return ids

    def encode_text(self, s: str) -> list[int]:
        """Token ids of `s` read as text: special-token strings in it are not special."""
        if self._rust_text is not None:
            return self._rust_text.encode(s, add_special_tokens=False).ids
        return list(self.tokenizer.encode(s, add_special_tokens=False,
                                          split_special_tokens=True))

    @staticmethod
    def _content(v: Any, param: str) -> str:
        if v is None:            # (OpenAI allows it for assistant turns; harmless elsewhere)
            return ""
        if isinstance(v, str):
            return text(v, param)
        if not isinstance(v, list):
            raise bad(f"{param} must be a string or an array of text parts, got {kind(v)}", param)
        parts = []
        for j, p in enumerate(v):
            pf = Fields(p, frozenset({"type", "text"}), f"{param}[{j}].")
            if pf.str("type", None) != "text":
                raise bad(f"{param}[{j}].type must be 'text': this server reads text only",
                          f"{param}[{j}].type")
            parts.append(pf.str("text", None) or "")
        return "\n".join(parts)

    def encode(self, s: str, add_special: bool) -> list[int]:
        if self._rust is not None:
            return self._rust.encode(s, add_special_tokens=add_special).ids
        return list(self.tokenizer.encode(s, add_special_tokens=add_special))
