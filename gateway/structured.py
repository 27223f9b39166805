"""OpenAI ``response_format`` and vLLM's ``guided_*`` fields -> the protocol's StructuredOutput.

Both OpenAI routes take the same fields (``StructuredFields``, mixed into their bodies);
the jobs API takes ``params.structured_output`` as is. Every constraint is checked here
with the worker's own grammar engine (llguidance, torch-free, tokenizer-independent), so a
schema, regex or grammar that cannot compile is a 400 naming the field before anything is
enqueued. Verdicts are cached by the constraint's canonical text.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from pydantic import BaseModel, ValidationError

from gateway.errors import APIError
from protocol.codec import describe_validation_error
from protocol.sampling import SamplingParams
from protocol.structured import StructuredOutput, check_grammar

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_KIND_OF = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
            "guided_grammar": "grammar"}


class StructuredFields(BaseModel):
    """The structured-output fields of /v1/completions and /v1/chat/completions."""

    response_format: dict[str, Any] | None = None
    # vLLM extensions
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_output(self) -> StructuredOutput | None:
        """The one constraint the body asks for (None: free text); APIError 400 otherwise."""
        given: list[tuple[str, str, Any]] = []  # (param, kind, value)
        from_format = _from_response_format(self.response_format)
        if from_format is not None:
            given.append(from_format)
        for name in _GUIDED:
            value = getattr(self, name)
            if value is not None:
                if name == "guided_json":
                    value = _json_object(value, name)
                given.append((name, _KIND_OF[name], value))
        if not given:
            return None
        if len(given) > 1:
            names = ", ".join(param.split(".")[0] for param, _, _ in given)
            raise APIError(400, f"{given[1][0]}: only one structured-output constraint per "
                           f"request (got {names})", param=given[1][0])
        param, kind, value = given[0]
        spec = _model(kind, value, param)
        check(spec, param)
        return spec


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


def _json_object(value: dict[str, Any] | str, param: str) -> dict[str, Any]:
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
