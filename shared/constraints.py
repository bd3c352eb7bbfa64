"""What an OutputConstraint means: its llguidance grammar (the gateway and the scheduler agree).

The gateway compiles a request's constraint once to refuse a bad schema, regex or grammar
with a 400 before queueing; the scheduler compiles it again (cached by spec) to build the
matchers whose bitmasks constrain sampling. llguidance needs neither torch nor numpy.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

from shared.messages import OutputConstraint

if TYPE_CHECKING:
    import llguidance

KINDS = ("json_schema", "regex", "choice", "grammar")
# Whitespace a JSON schema's output may hold between two tokens of JSON: none, one space,
# or one newline and an indent of up to 12 (pretty-printed JSON fits). llguidance's default
# allows any run of whitespace, and a sampled small model can then write newlines until
# max_tokens. A schema's own "x-guidance" options override this.
JSON_WHITESPACE = r"(\n[ \t]{0,12}| )?"


class GrammarError(ValueError):
    """A constraint that does not compile (the gateway refuses these before queueing)."""


def grammar_text(constraint: OutputConstraint) -> str:
    """The llguidance grammar of a constraint. Raises GrammarError naming the problem."""
    import llguidance

    kind, spec = constraint.kind, constraint.spec
    try:
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(
                spec, defaults={"whitespace_pattern": JSON_WHITESPACE})
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            choices = json.loads(spec)
            if (not isinstance(choices, list) or not choices
                    or not all(isinstance(c, str) for c in choices)):
                raise GrammarError("choice must be a non-empty list of strings")
            return llguidance.grammar_from("choice", choices)
        if kind == "grammar":
            return llguidance.grammar_from("grammar", spec)
    except GrammarError:
        raise
    except Exception as exc:     # llguidance raises ValueError/RuntimeError with the reason
        raise GrammarError(f"invalid {kind}: {exc}") from None
    raise GrammarError(f"unknown constraint kind {kind!r}")


def validate(constraint: OutputConstraint, tokenizer: llguidance.LLTokenizer | None) -> str:
    """The compiled grammar text; raises GrammarError when it does not compile."""
    import llguidance

    grammar = grammar_text(constraint)
    try:
        problem = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    except Exception as exc:     # whatever the input, a reason and never a traceback
        problem = str(exc) or type(exc).__name__
    if problem and not problem.startswith("WARNING"):
        raise GrammarError(f"invalid {constraint.kind}: {problem.strip()}")
    return grammar
