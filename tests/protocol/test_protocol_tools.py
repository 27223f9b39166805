"""Tool-call grammars per family and the parser that reads calls back (protocol 6).

Each family's grammar is compiled with llguidance and driven byte by byte (a matcher over
a byte-level tokenizer), so these check what the worker enforces, not just the text.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest

from protocol.structured import StructuredOutput, check_grammar, grammar_for
from protocol.tool_syntax import FAMILIES, complete_calls, detect_syntax, parse_calls
from protocol.tools import FunctionTool, ToolCalls

PARAMS = {"type": "object", "properties": {"city": {"type": "string"},
                                           "n": {"type": "integer", "minimum": 0}},
          "required": ["city"], "additionalProperties": False}
TOOLS = [FunctionTool(name="weather", parameters=PARAMS), FunctionTool(name="noop")]


def _calls(family: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
    fam = FAMILIES[family]
    body = fam.sep.join(fam.call_open + json.dumps(
        {"name": n, fam.args_key: a}, separators=(",", ":")) + fam.call_close
        for n, a in calls)
    return fam.open + body + fam.close


@functools.cache
def _tokenizer() -> Any:
    import llguidance.hf
    from transformers import AutoTokenizer

    from worker.models import default_model_path

    hf = AutoTokenizer.from_pretrained(default_model_path())
    return hf, llguidance.hf.from_tokenizer(hf)  # type: ignore[arg-type]


def _accepts(spec: ToolCalls, family: str, text: str) -> bool:
    """Whether the grammar (compiled for the default model's vocabulary) accepts exactly
    ``text``."""
    import llguidance

    hf, tok = _tokenizer()
    grammar = grammar_for(StructuredOutput(tools=spec), family)  # type: ignore[arg-type]
    matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = hf.encode(text, add_special_tokens=False)
    return bool(matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids)
                and matcher.is_accepting())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_grammar_admits_exactly_the_allowed_calls(family: str) -> None:
    two = _calls(family, [("weather", {"city": "Paris"}), ("noop", {})])
    one = _calls(family, [("weather", {"city": "Paris", "n": 2})])
    bad_args = _calls(family, [("weather", {"town": "Paris"})])
    required = ToolCalls(tools=TOOLS, mode="required", syntax=family)  # type: ignore[arg-type]
    assert _accepts(required, family, two) and _accepts(required, family, one)
    assert not _accepts(required, family, bad_args)
    assert not _accepts(required, family, "Sunny.")
    single = required.model_copy(update={"parallel": False})
    assert _accepts(single, family, one) and not _accepts(single, family, two)
    named = ToolCalls(tools=TOOLS, mode="named", name="noop", syntax=family)  # type: ignore[arg-type]
    assert not _accepts(named, family, one)
    assert _accepts(named, family, _calls(family, [("noop", {})]))
    auto = ToolCalls(tools=TOOLS, syntax=family)  # type: ignore[arg-type]
    assert _accepts(auto, family, "Sunny.") and _accepts(auto, family, one)
    final = ToolCalls(tools=TOOLS, syntax=family,  # type: ignore[arg-type]
                      final_schema={"type": "object", "properties": {"a": {"type": "integer"}},
                                    "required": ["a"]})
    assert _accepts(final, family, '{"a":1}') and not _accepts(final, family, "Sunny.")
    assert _accepts(final, family, one)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("mode", ["auto", "required"])
def test_every_family_compiles(family: str, mode: str) -> None:
    spec = StructuredOutput(tools=ToolCalls(tools=TOOLS, mode=mode, syntax=family))  # type: ignore[arg-type]
    assert check_grammar(spec) is None


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_parse_round_trip(family: str) -> None:
    text = _calls(family, [("weather", {"city": "Paris"}), ("noop", {})])
    assert parse_calls(text, {"weather", "noop"}) == (
        None, [("weather", '{"city":"Paris"}'), ("noop", "{}")])
    assert parse_calls(text, {"noop"}) is None  # an unknown name is not a call
    cut = text[:-len(FAMILIES[family].close) - 4]
    assert parse_calls(cut, {"weather", "noop"}) is None
    assert parse_calls(cut, {"weather", "noop"}, cut=True) == (
        None, [("weather", '{"city":"Paris"}')])
    assert complete_calls(cut, {"weather", "noop"}) == [("weather", '{"city":"Paris"}')]


def test_plain_text_is_not_calls() -> None:
    assert parse_calls("The weather is fine.", {"weather"}) is None
    assert parse_calls('{"answer": 1}', {"weather"}) is None


def test_detect_syntax() -> None:
    assert detect_syntax("{% for t in tools %}<tool_call>{% endfor %}") == "hermes"
    assert detect_syntax("[TOOL_CALLS]{{ tools }}") == "mistral"
    assert detect_syntax("<|python_tag|>{{ tools }}") == "llama3_json"
    assert detect_syntax("{{ messages }}") == "hermes"  # the documented default
    assert detect_syntax(None) == "hermes"


def test_tool_calls_rules() -> None:
    with pytest.raises(ValueError, match="unique"):
        ToolCalls(tools=[TOOLS[0], TOOLS[0]])
    with pytest.raises(ValueError, match="not one of the tools"):
        ToolCalls(tools=TOOLS, mode="named", name="other")
    with pytest.raises(ValueError, match="final_schema"):
        ToolCalls(tools=TOOLS, mode="required", final_schema={"type": "object"})


def test_an_unenforceable_schema_is_named() -> None:
    bad = FunctionTool(name="f", parameters={"type": "object", "properties": {
        "a": {"type": "string", "format": "weird"}}})
    error = check_grammar(StructuredOutput(tools=ToolCalls(tools=[bad])))
    assert error is not None and "Unknown format: weird" in error


def test_defs_are_hoisted() -> None:
    """pydantic's ``$defs`` + ``$ref`` survive nesting under ``arguments``."""
    params = {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "required": ["p"],
              "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}}}}
    spec = ToolCalls(tools=[FunctionTool(name="f", parameters=params)], mode="required")
    assert check_grammar(StructuredOutput(tools=spec)) is None
