"""Tool-call grammars per family and the parser that reads calls back (protocol 6).

Each family's grammar is compiled with llguidance and driven byte by byte (a matcher over
a byte-level tokenizer), so these check what the worker enforces, not just the text.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest

from protocol.structured.constraint import StructuredOutput, check_grammar, grammar_for
from protocol.structured.tool_syntax import FAMILIES, complete_calls, detect_syntax, parse_calls
from protocol.structured.tools import FunctionTool, ToolCalls

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
    got = parse_calls(cut, {"weather", "noop"}, cut=True)  # the cut call as written
    assert got is not None and got[1][0] == ("weather", '{"city":"Paris"}')
    assert got[1][1] in (("noop", ""), ("noop", "{}"))  # cut in its key, or in its close
    assert complete_calls(cut, {"weather", "noop"}) == [("weather", '{"city":"Paris"}')]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_cut_call_is_a_call_at_every_length(family: str) -> None:
    """Cut anywhere (max_tokens), a list of calls reads back as calls: the complete ones,
    then the one being written with its arguments as far as they got; never as text."""
    names = {"weather", "noop"}
    text = _calls(family, [("weather", {"city": "Paris"}), ("noop", {})])
    first_call = len(FAMILIES[family].opener) + len('{"name":"weather"')
    for k in range(1, len(text)):
        parsed = parse_calls(text[:k], names, cut=True)
        assert parsed is not None and parsed[0] is None, (k, text[:k])
        got = parsed[1]
        assert got[:1] == [] or got[0][0] in ("", "weather"), (k, got)
        if k >= first_call:  # the name is written: it is the call's, arguments follow it
            assert got[0][0] == "weather" and '{"city":"Paris"}'.startswith(got[0][1])
        assert all(n in names or n == "" for n, _ in got), (k, got)
    cut = _calls(family, [("weather", {"city": "Paris"})])
    cut = cut[:cut.index("Par") + 3]
    assert parse_calls(cut, names, cut=True) == (None, [("weather", '{"city":"Par')])


def test_a_cut_name_is_completed_only_when_one_function_begins_so() -> None:
    names = {"get_weather", "get_time"}
    assert parse_calls('<tool_call>\n{"name":"get_w', names, True) == (
        None, [("get_weather", "")])
    assert parse_calls('<tool_call>\n{"name":"get_', names, True) == (None, [("get_", "")])
    assert parse_calls('<tool_call>\n{"na', {"only"}, True) == (None, [("only", "")])
    # a family's opener begun is no text, even where nothing can be read back
    assert parse_calls('<tool_call>\n{"name":"other"', names, True) == (None, [])
    # text before a hermes call stays text; a JSON answer is not a llama3 call
    assert parse_calls('Let me check.\n<tool_call>\n{"name":"get_t', names, True) == (
        "Let me check.", [("get_time", "")])
    assert parse_calls('{"answer": "sun', names, True) is None
    assert parse_calls("Sunny in Par", names, True) is None


def test_allowed_tools_limit_what_a_call_may_name() -> None:
    """OpenAI's allowed_tools: every tool is in the prompt, only these may be called."""
    family = "hermes"
    spec = ToolCalls(tools=TOOLS, mode="required", allowed=["noop"])
    assert _accepts(spec, family, _calls(family, [("noop", {})]))
    assert not _accepts(spec, family, _calls(family, [("weather", {"city": "Paris"})]))
    auto = ToolCalls(tools=TOOLS, allowed=["weather"])
    assert _accepts(auto, family, "Sunny.")
    assert not _accepts(auto, family, _calls(family, [("noop", {})]))
    with pytest.raises(ValueError, match="not one of the tools"):
        ToolCalls(tools=TOOLS, allowed=["other"])
    with pytest.raises(ValueError, match="not with mode 'named'"):
        ToolCalls(tools=TOOLS, mode="named", name="noop", allowed=["noop"])


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
