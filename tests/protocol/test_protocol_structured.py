"""``SamplingParams.structured_output`` on the wire: round trip, strict shape, grammar check."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import msgpack
import pytest

from protocol.codec import ProtocolError, decode_request, encode_request
from protocol.models import GenerateRequest
from protocol.structured.constraint import StructuredOutput, check_grammar, grammar_for

SCHEMA = {"type": "object", "properties": {"a": {"const": None}, "b": {"type": "number",
          "maximum": 1.5}}, "required": ["a"]}


@pytest.mark.parametrize("spec", [
    {"json_schema": SCHEMA}, {"json_object": True}, {"regex": "[a-z]+"},
    {"choice": ["ja", "nein", "é\"\\"]}, {"grammar": 'root ::= "a" [0-9]+'},
])
def test_round_trip_and_compiles(spec: dict[str, Any]) -> None:
    request = GenerateRequest(prompt="x", params={"structured_output": spec})  # type: ignore[arg-type]
    decoded = decode_request(encode_request(request))
    assert decoded == request and decoded.params.structured_output is not None
    assert check_grammar(decoded.params.structured_output) is None
    assert grammar_for(decoded.params.structured_output)


def _raw(spec: Any) -> bytes:
    entry = {"version": 1, "prompt": "x", "params": {"structured_output": spec}}
    return msgpack.packb(entry, use_bin_type=True)  # type: ignore[no-any-return]


@pytest.mark.parametrize("spec,message", [
    ({}, "params.structured_output: give exactly one of"),
    ({"regex": "a", "choice": ["a"]}, "(got regex, choice)"),
    ({"json_object": False}, "(got none)"),
    ({"choice": []}, "params.structured_output.choice: List should have at least 1"),
    ({"choice": ["a", ""]}, "params.structured_output.choice: every choice"),
    ({"regex": 5}, "params.structured_output.regex: Input should be a valid string"),
    ({"regex": b"a+"}, "params.structured_output.regex"),
    ({"json_schema": "{}"}, "params.structured_output.json_schema"),
    ({"json_schema": {"a": float("inf")}}, "json_schema: not representable as JSON"),
    ({"yaml": "a: 1"}, "params.structured_output.yaml: Extra inputs are not permitted"),
    ("regex", "params.structured_output"),
])
def test_bad_shapes_name_the_field(spec: Any, message: str) -> None:
    with pytest.raises(ProtocolError) as err:
        decode_request(_raw(spec))
    assert message in str(err.value), str(err.value)


@pytest.mark.parametrize("spec,message", [
    ({"regex": "a(b"}, "regex: "),
    ({"regex": "(?=a)b"}, "look-around"),
    ({"json_schema": {"type": "strin"}}, "json_schema: Invalid type: strin"),
    ({"json_schema": {"$ref": "#/defs/x"}}, "json_schema: "),
    ({"grammar": "root ::= undefined"}, "grammar: "),
])
def test_check_grammar_names_the_problem(spec: dict[str, Any], message: str) -> None:
    error = check_grammar(StructuredOutput.model_validate(spec))
    assert error is not None and message in error, error


def test_cache_key_is_canonical() -> None:
    a = StructuredOutput(json_schema={"type": "object", "required": ["x"]})
    b = StructuredOutput(json_schema={"required": ["x"], "type": "object"})
    assert a.cache_key() == b.cache_key() != StructuredOutput(regex="x").cache_key()


def test_protocol_import_does_not_load_llguidance() -> None:
    probe = "import sys, protocol.codec, protocol.client; print('llguidance' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "False"
