"""Structured output on the wire: the one constraint a request's text must follow.

``StructuredOutput`` is ``SamplingParams.structured_output``: exactly one of a JSON schema,
"any JSON object", a regular expression, a list of choices or an EBNF grammar. Its shape
is validated here, once, so every producer gets the same error naming the field. The
grammar text for the engine (llguidance's format) is built here too, because the gateway
checks a grammar compiles before enqueueing it and the worker compiles the same text:
both sides must agree on it byte for byte. llguidance is imported lazily, so importing the
protocol never needs it.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from protocol.structured.json_schema import prepare
from protocol.structured.tool_syntax import DEFAULT_SYNTAX, tool_grammar
from protocol.structured.tools import Syntax, ToolCalls
from protocol.values import first_path, unencodable

MAX_SCHEMA_BYTES = 256 * 1024
MAX_PATTERN_CHARS = 16 * 1024
MAX_GRAMMAR_CHARS = 64 * 1024
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 4096
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "tools")

# JSON is generated compact (no whitespace between tokens): a model left free to emit
# whitespace can fill max_tokens with newlines and never close the object. A schema may
# override this with llguidance's "x-guidance" key, e.g. {"whitespace_flexible": true}.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


class StructuredOutput(BaseModel):
    """Exactly one constraint; see docs/protocol.md §1.2."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    json_schema: dict[str, Any] | None = Field(
        default=None, description="A JSON Schema the output must validate against.")
    json_object: bool = Field(default=False, description="Any JSON object.")
    regex: str | None = Field(default=None, min_length=1, max_length=MAX_PATTERN_CHARS)
    choice: list[str] | None = Field(default=None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = Field(
        default=None, min_length=1, max_length=MAX_GRAMMAR_CHARS,
        description="EBNF (GBNF, as llama.cpp and vLLM) or Lark grammar text.")
    tools: ToolCalls | None = Field(default=None, description=(
        "Tool calls (protocol/structured/tools.py): calls to these functions, or text per "
        "its mode."))

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutput:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of {', '.join(KINDS)} "
                f"(got {', '.join(given) or 'none'})")
        broken = first_path({given[0]: self._value(given[0])}, unencodable)
        if broken:  # llguidance (and msgpack) take UTF-8 only: keys are text too
            raise ValueError(f"{broken}: not valid Unicode text (a lone surrogate?)")
        if self.json_schema is not None:
            try:
                size = len(json.dumps(self.json_schema, allow_nan=False))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"json_schema: not representable as JSON ({exc})") from None
            if size > MAX_SCHEMA_BYTES:
                raise ValueError(f"json_schema: {size} bytes exceeds {MAX_SCHEMA_BYTES}")
        if self.choice is not None and any(
            not c or len(c) > MAX_CHOICE_CHARS for c in self.choice
        ):
            raise ValueError(f"choice: every choice must have 1 to {MAX_CHOICE_CHARS} characters")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def _value(self, kind: str) -> Any:
        value = getattr(self, kind)
        return value.model_dump(mode="json") if isinstance(value, BaseModel) else value

    def cache_key(self) -> str:
        """Canonical text of the constraint: equal constraints compile once."""
        value = self._value(self.kind)
        return self.kind + ":" + json.dumps(value, sort_keys=True, separators=(",", ":"))


def grammar_for(spec: StructuredOutput, syntax: Syntax = DEFAULT_SYNTAX) -> str:
    """llguidance grammar text for ``spec``; ValueError naming the field if it cannot be built.
    ``syntax``: how the model writes tool calls (its chat template's family).

    Building does not check the grammar; ``check_grammar`` (or constructing a matcher) does.
    """
    import llguidance

    matcher = llguidance.LLMatcher
    kind = spec.kind
    try:
        if kind == "json_schema":
            return matcher.grammar_from_json_schema(
                prepare(spec.json_schema or {}), defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        if kind == "json_object":
            return matcher.grammar_from_json_schema(
                {"type": "object"}, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        if kind == "regex":
            return matcher.grammar_from_regex(spec.regex or "")
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(spec.choice))
        if kind == "tools":
            return matcher.grammar_from_lark(tool_grammar(spec.tools, syntax))  # type: ignore[arg-type]
        return llguidance.grammar_from("ebnf", spec.grammar or "")
    except Exception as exc:  # the GBNF converter raises plain Exception
        raise ValueError(f"{kind}: {_one_line(exc)}") from None


def check_grammar(spec: StructuredOutput) -> str | None:
    """Why ``spec`` cannot compile (a message naming the field), or None if it can.

    Tokenizer-independent: the gateway runs it with no model at hand. A grammar that passes
    can, rarely, still fail against a particular vocabulary; the worker then reports it.
    """
    import llguidance

    try:
        grammar = grammar_for(spec)
    except ValueError as exc:
        return str(exc)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    return f"{spec.kind}: {_one_line(error)}" if error else None


def _one_line(message: object) -> str:
    text = " ".join(str(message).split())
    return text if len(text) <= 500 else text[:497] + "..."
