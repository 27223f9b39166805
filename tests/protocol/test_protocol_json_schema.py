"""JSON Schema preparation (protocol/structured/json_schema.py) and text checks on keys.

Bounds on unbounded numbers (checked with llguidance itself: a 20-digit integer no longer
matches, int64's extremes do), ``$ref`` cycles with no base case refused while ordinary
recursive schemas pass, and lone surrogates found in map keys as well as values.
"""

from __future__ import annotations

from typing import Any

import llguidance
import pytest

from protocol.models import GenerateRequest
from protocol.structured.constraint import StructuredOutput, check_grammar, grammar_for
from protocol.structured.json_schema import INT_MAX, INT_MIN, bound_numbers, close_objects, prepare


def _matches(schema: dict[str, Any], text: str) -> bool:
    """Whether llguidance's grammar for ``schema`` (as Ferry builds it) accepts ``text``."""
    import llguidance.hf

    from tests.checkpoints import build_tokenizer

    tok = build_tokenizer()
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok),
                                   grammar_for(StructuredOutput(json_schema=schema)))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_integers_are_bounded_to_int64_by_default() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert _matches(schema, '{"n":9223372036854775807}')
    assert _matches(schema, f'{{"n":{INT_MIN}}}')
    assert not _matches(schema, '{"n":9223372036854775808}')
    assert not _matches(schema, '{"n":' + "1" * 170 + "}")
    free = {**schema, "x-ferry": {"bounded_numbers": False}}
    assert _matches(free, '{"n":' + "1" * 170 + "}")


def test_numbers_get_a_sane_length() -> None:
    schema = {"type": "array", "items": {"type": "number"}}
    assert _matches(schema, "[1.5,-3,0.123456789,999999999999999]")
    assert not _matches(schema, "[0.1234567890]")  # a tenth decimal
    assert not _matches(schema, "[1e5]")  # no exponent
    assert not _matches(schema, "[10000000000000000]")


def test_given_bounds_and_values_are_kept() -> None:
    schema = {"$defs": {"a": {"type": "integer", "minimum": 5}},
              "properties": {"b": {"type": ["integer", "null"], "exclusiveMaximum": 9},
                             "c": {"type": "number", "minimum": 1e30},
                             "d": {"type": "integer", "enum": [10**30]}}}
    out = bound_numbers(schema)
    assert out["$defs"]["a"] == {"type": "integer", "minimum": 5, "maximum": INT_MAX}
    assert out["properties"]["b"] == {"type": ["integer", "null"], "exclusiveMaximum": 9,
                                      "minimum": INT_MIN}
    assert out["properties"]["c"] == {"type": "number", "minimum": 1e30, "multipleOf": 1e-9}
    assert out["properties"]["d"] == {"type": "integer", "enum": [10**30]}
    assert schema["$defs"]["a"] == {"type": "integer", "minimum": 5}  # a copy


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"type": "object", "properties": {"x": {"$ref": "#/definitions/l"}},
     "definitions": {"l": {"type": "array", "minItems": 1, "items": {"$ref": "#/definitions/l"}}}},
    {"anyOf": [{"$ref": "#"}, {"$ref": "#"}]},
])
def test_ref_cycles_without_a_base_case_are_refused(schema: dict[str, Any]) -> None:
    error = check_grammar(StructuredOutput(json_schema=schema))
    assert error is not None and "unsatisfiable" in error and "$ref cycle" in error
    with pytest.raises(ValueError):
        prepare(schema)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"$ref": "#"}}},  # optional: {} ends it
    {"$defs": {"node": {"type": "object", "required": ["next"], "properties": {
        "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}}},
     "$ref": "#/$defs/node"},  # a linked list ending in null
    {"type": "array", "items": {"$ref": "#"}},  # [] ends it
    {"$ref": "#/$defs/t", "$defs": {"t": {"type": ["object", "string"], "required": ["t"],
                                          "properties": {"t": {"$ref": "#/$defs/t"}}}}},
])
def test_recursive_schemas_with_a_base_case_pass(schema: dict[str, Any]) -> None:
    assert check_grammar(StructuredOutput(json_schema=schema)) is None


def test_close_objects() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "object"},
                                               "b": {"type": "object",
                                                     "additionalProperties": True}}}
    out = close_objects(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["b"]["additionalProperties"] is True


def test_objects_that_list_their_properties_are_closed_by_default() -> None:
    """vLLM's default backend's rule: an object schema that lists its properties and says
    nothing of other keys admits no other key (pydantic's ``model_json_schema()``, nested
    models in ``$defs`` included); ``additionalProperties: true`` or ``x-ferry``
    ``closed_objects: false`` keeps it open, a bare object stays any object."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                               "at": {"$ref": "#/$defs/Place"}},
              "required": ["city"],
              "$defs": {"Place": {"type": "object", "properties": {"x": {"type": "integer"}},
                                  "required": ["x"]}}}
    assert _matches(schema, '{"city":"Paris"}')
    assert not _matches(schema, '{"city":"Paris","country":"FR"}')
    assert not _matches(schema, '{"city":"Paris","at":{"x":1,"y":2}}')
    assert _matches({**schema, "additionalProperties": True},
                    '{"city":"Paris","country":"FR"}')
    assert _matches({**schema, "x-ferry": {"closed_objects": False}},
                    '{"city":"Paris","at":{"x":1,"y":2}}')
    assert _matches({"type": "object"}, '{"anything":1}')
    out = prepare({"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}],
                   "properties": {"c": {"type": "object", "properties": {}},
                                  "d": {"properties": {}, "required": ["e"]}}})
    assert "additionalProperties" not in out  # its keys are its allOf members'
    assert all("additionalProperties" not in m for m in out["allOf"])
    assert out["properties"]["c"]["additionalProperties"] is False  # {} only: no arguments
    assert "additionalProperties" not in out["properties"]["d"]  # requires what it omits


@pytest.mark.parametrize("spec,where", [
    ({"json_schema": {"properties": {"\ud800": {"type": "string"}}}},
     "json_schema.properties.\\ud800 (a key)"),
    ({"json_schema": {"enum": ["ok", "\udfff"]}}, "json_schema.enum.1"),
    ({"choice": ["a", "\ud800"]}, "choice.1"),
    ({"regex": "a\ud800"}, "regex"),
])
def test_lone_surrogates_anywhere_in_a_constraint(spec: dict[str, Any], where: str) -> None:
    with pytest.raises(ValueError) as caught:
        StructuredOutput.model_validate(spec)
    message = str(caught.value)
    assert where in message and ("not valid Unicode" in message or "unicode" in message)


def test_lone_surrogate_keys_in_a_request() -> None:
    with pytest.raises(ValueError, match=r"params.logit_bias|not valid Unicode"):
        GenerateRequest.model_validate({"prompt": "x", "params": {"logit_bias": {"\ud800": 1}}})
    request = GenerateRequest(prompt="x")
    assert request.model_dump()  # and ordinary requests are untouched
    assert llguidance  # the grammar engine the checks above drive
