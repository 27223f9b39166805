"""OpenAI ``response_format``, vLLM's ``structured_outputs`` and ``guided_*`` fields -> the
protocol's StructuredOutput.

Both OpenAI routes take the same fields (``StructuredFields``, mixed into their bodies);
the jobs API takes ``params.structured_output`` as is. vLLM >= 0.10 spells constraints
``structured_outputs: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}``
(the ``guided_*`` fields are its deprecated spellings); its options are honoured or
refused, never dropped: ``whitespace_pattern`` (and ``guided_whitespace_pattern``) becomes
llguidance's ``x-guidance.whitespace_pattern`` in the schema, ``disable_additional_properties``
closes every object of the schema, ``structural_tag`` is refused. Every constraint is
checked here with the worker's own grammar engine (llguidance, torch-free, tokenizer
independent), so one that cannot compile is a 400 naming the field before anything is
enqueued. Verdicts are cached by the constraint's canonical text.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.errors import APIError
from protocol.codec import describe_validation_error
from protocol.sampling import SamplingParams
from protocol.structured.constraint import StructuredOutput, check_grammar
from protocol.structured.json_schema import close_objects

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_KIND_OF = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
            "guided_grammar": "grammar", "json": "json_schema", "regex": "regex",
            "choice": "choice", "grammar": "grammar"}


class StructuredOutputsIn(BaseModel):
    """vLLM's ``structured_outputs`` (StructuredOutputsParams); unknown keys are a 400."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False  # compact JSON is Ferry's default either way
    disable_additional_properties: bool = False
    disable_fallback: bool = False  # one grammar engine: nothing to fall back to


class StructuredFields(BaseModel):
    """The structured-output fields of /v1/completions and /v1/chat/completions."""

    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputsIn | None = None
    # vLLM's deprecated spellings
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None

    def structured_output(self) -> StructuredOutput | None:
        """The one constraint the body asks for (None: free text); APIError 400 otherwise."""
        given = self._given()
        if not given:
            return None
        if len(given) > 1:
            names = ", ".join(param.split(".")[0] for param, _, _ in given)
            raise APIError(400, f"{given[1][0]}: only one structured-output constraint per "
                           f"request (got {names})", param=given[1][0])
        param, kind, value = given[0]
        kind, value = self._with_options(kind, value)
        spec = _model(kind, value, param)
        check(spec, param)
        return spec

    def _given(self) -> list[tuple[str, str, Any]]:
        """(param, kind, value) of every constraint in the body."""
        given: list[tuple[str, str, Any]] = []
        from_format = _from_response_format(self.response_format)
        if from_format is not None:
            given.append(from_format)
        for name in _GUIDED:
            value = getattr(self, name)
            if value is not None:
                given.append((name, _KIND_OF[name], _schema(value, name)
                              if name == "guided_json" else value))
        so = self.structured_outputs
        if so is not None:
            if so.structural_tag is not None:
                raise APIError(400, "structured_outputs.structural_tag: not supported",
                               param="structured_outputs.structural_tag")
            for name in ("json", "regex", "choice", "grammar"):
                value = so.json_ if name == "json" else getattr(so, name)
                if value is not None:
                    param = f"structured_outputs.{name}"
                    given.append((param, _KIND_OF[name],
                                  _schema(value, param) if name == "json" else value))
            if so.json_object:
                given.append(("structured_outputs.json_object", "json_object", True))
        return given

    def _with_options(self, kind: str, value: Any) -> tuple[str, Any]:
        """Apply whitespace_pattern / disable_additional_properties to a JSON constraint."""
        so = self.structured_outputs
        pattern = (so.whitespace_pattern if so else None) or self.guided_whitespace_pattern
        close = bool(so and so.disable_additional_properties)
        if kind not in ("json_schema", "json_object") or not (pattern or close):
            return kind, value
        schema: dict[str, Any] = {"type": "object"} if kind == "json_object" else dict(value)
        if close:
            schema = close_objects(schema)
        if pattern:
            schema["x-guidance"] = {**schema.get("x-guidance", {}),
                                    "whitespace_pattern": pattern}
        return "json_schema", schema


def _from_response_format(fmt: dict[str, Any] | None) -> tuple[str, str, Any] | None:
    if fmt is None:
        return None
    kind = fmt.get("type", "text")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise APIError(400, f"response_format.type: unknown type {kind!r} (supported: "
                       f"{', '.join(RESPONSE_FORMAT_TYPES)})", param="response_format.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", "json_object", True
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise APIError(400, "response_format.json_schema: required, an object with 'name' and "
                       "'schema'", param="response_format.json_schema")
    schema = spec.get("schema")
    param = "response_format.json_schema.schema"
    if not isinstance(schema, dict):
        raise APIError(400, f"{param}: required, a JSON Schema object", param=param)
    return param, "json_schema", schema


def _schema(value: dict[str, Any] | str, param: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise APIError(400, f"{param}: not valid JSON ({exc})", param=param) from None
    if not isinstance(value, dict):
        raise APIError(400, f"{param}: must be a JSON Schema object", param=param)
    return value


def _model(kind: str, value: Any, param: str) -> StructuredOutput:
    try:
        return StructuredOutput.model_validate({kind: value})
    except ValidationError as exc:
        detail = describe_validation_error(exc).split(": ", 1)[-1]
        raise APIError(400, f"{param}: {detail}", param=param) from None


@functools.lru_cache(maxsize=1024)
def _verdict(cache_key: str) -> str | None:
    """check_grammar by canonical text: a schema sent a thousand times is checked once."""
    kind, value = cache_key.split(":", 1)
    return check_grammar(StructuredOutput.model_validate({kind: json.loads(value)}))


def check_params(params: SamplingParams) -> None:
    """The jobs API: 400 naming ``params.structured_output.<kind>`` if it cannot compile."""
    spec = params.structured_output
    if spec is not None:
        check(spec, f"params.structured_output.{spec.kind}")


def check(spec: StructuredOutput | None, param: str) -> None:
    """400 naming ``param`` if ``spec`` cannot compile."""
    if spec is None:
        return
    error = _verdict(spec.cache_key())
    if error is not None:
        detail = error.split(": ", 1)[-1] if error.startswith(spec.kind + ": ") else error
        raise APIError(400, f"{param}: {detail}", param=param)
