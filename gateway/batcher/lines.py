"""One batch line in, one result line out: the same checks and bodies as the HTTP routes.

A line of a batch input file is ``{"custom_id", "method": "POST", "url", "body"}``. Its
body goes through the very schema class and request builder of the route it names
(``CompletionRequest`` / ``ChatCompletionRequest``, ``to_generate_request``, the admission
caps), and its result body through the same formatter (``gateway/openai_api/format.py``), so a
line gets exactly the answer the endpoint would have given, refusals included: a body the
route would answer 400 becomes an error-file line whose ``response`` is that 400. What
only a batch can get wrong (not JSON, a missing ``custom_id``, another ``url``, a
duplicate ``custom_id``) is an error-file line with ``response: null`` and an ``error``
code, as OpenAI's error files have. Whatever else goes wrong while checking a line (a bug,
an input nobody foresaw) is that line's error too, code ``internal_error``: a line never
stops its batch (``check_line``).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from redis.exceptions import RedisError

from gateway.admission import check_limits
from gateway.body import MAX_DEPTH, brackets, check_depth, nesting_depth, validate
from gateway.errors import APIError
from gateway.openai_api.format import Formatter, failure
from gateway.openai_api.response_shape import ResponseShape
from gateway.openai_api.schemas import ENDPOINT_SCHEMAS as SCHEMAS
from gateway.served.models import ServedModels
from gateway.settings import GatewaySettings
from gateway.sse import json_bytes
from protocol.batch.progress import LineResult
from protocol.batch.records import BatchRecord, line_request_id
from protocol.lora.registry import public_name
from protocol.models import GenerateRequest, TokenEvent
from protocol.tenants.ids import DEFAULT_TENANT, scoped_id

log = structlog.get_logger("ferry.batcher")

MAX_CUSTOM_ID = 512
_CUSTOM_ID = re.compile(rb'"custom_id"\s*:\s*("(?:[^"\\]|\\.)*")')
ENDED_LINES = {
    "batch_cancelled": "The batch was cancelled before this request finished.",
    "batch_expired": "This request could not be executed before the completion window "
                     "expired.",
    "file_not_found": "The batch's input file was deleted or expired before this request "
                      "ran.",
    "batch_failed": "The batch failed before this request finished: the batcher could not "
                    "drive it (the batch's errors say why).",
}
"""The error of a line a batch never ran (or stopped), by the reason the batch ended."""


class BadLine(Exception):
    """A line that is not a request at all; ``code`` goes to its error-file line."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class BatchLine:
    """A well-formed line: who it is (``custom_id``) and the request body."""

    index: int
    custom_id: str
    body: dict[str, Any]


@dataclass(frozen=True)
class LinePlan:
    """The requests one line runs as (one per prompt of a prompt list) and how its result
    is shaped (the route's own ``ResponseShape``)."""

    index: int
    custom_id: str
    requests: tuple[GenerateRequest, ...]
    shape: ResponseShape

    @property
    def request_ids(self) -> list[str]:
        return [r.request_id for r in self.requests]

    @property
    def model(self) -> str:
        """The model as the batch's owner named it (an adapter: not its registry key)."""
        first = self.requests[0]
        return public_name(first.tenant, first.model or "")


def parse_line(raw: bytes, index: int, endpoint: str, max_bytes: int) -> BatchLine | None:
    """The line's custom_id and body; None for a blank line (not a request); ``BadLine``
    for anything else that is not a request for ``endpoint``; the route's 400
    (``APIError``) for a body nested too deep to parse (``gateway.body.check_depth``)."""
    text = raw.strip()
    if not text:
        return None
    where = f"line {index + 1}"
    if len(text) > max_bytes:
        raise BadLine("request_too_large", f"{where}: {len(text)} bytes exceed the request "
                      f"body limit of {max_bytes}")
    check_depth(text, outer=1)  # the body sits one level down in the line
    try:
        line = json.loads(text)
    except ValueError as exc:
        raise BadLine("invalid_json_line", f"{where}: not valid JSON ({exc})") from None
    if not isinstance(line, dict):
        raise BadLine("invalid_json_line", f"{where}: must be a JSON object")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID:
        raise BadLine("invalid_custom_id", f"{where}: custom_id must be a string of 1 to "
                      f"{MAX_CUSTOM_ID} characters")
    if line.get("method") != "POST":
        raise BadLine("invalid_method", f"{where}: method must be \"POST\"")
    if line.get("url") != endpoint:
        raise BadLine("invalid_url", f"{where}: url {line.get('url')!r} does not match the "
                      f"batch's endpoint {endpoint!r}")
    body = line.get("body")
    if not isinstance(body, dict):
        raise BadLine("invalid_body", f"{where}: body must be a JSON object")
    return BatchLine(index, custom_id, body)


def custom_id_of(raw: bytes) -> str | None:
    """The custom_id of a line, if it has a usable one (for the lines a batch never ran,
    and those too deep to parse)."""
    if nesting_depth(raw, MAX_DEPTH + 1) > MAX_DEPTH + 1:
        return _shallow_custom_id(raw)
    try:
        value = json.loads(raw).get("custom_id")
    except (ValueError, AttributeError, RecursionError):
        return None
    return value if isinstance(value, str) else None


def _shallow_custom_id(raw: bytes) -> str | None:
    """The custom_id of a line too deep for ``json.loads``: the first of the first few
    ``"custom_id": "..."`` that is a key of the line itself (outside strings, one level
    deep), found without parsing the rest."""
    for match in itertools.islice(_CUSTOM_ID.finditer(raw), 8):
        outside, in_string = brackets(raw[:match.start()])
        depth = (outside.count(b"[") + outside.count(b"{")
                 - outside.count(b"]") - outside.count(b"}"))
        if not in_string and depth == 1:
            try:
                value = json.loads(match.group(1))
            except ValueError:  # a bad escape, or not UTF-8
                return None
            return value if 0 < len(value) <= MAX_CUSTOM_ID else None
    return None


async def plan_line(line: BatchLine, batch_id: str, endpoint: str, settings: GatewaySettings,
                    served: ServedModels, owner: str = DEFAULT_TENANT) -> LinePlan | LineResult:
    """The line's requests, or the error result of a body its route would refuse.

    The route's own steps, in its order: the body schema, the served model's name, the
    request builder, the admission caps. The request id is the line's own
    (``line_request_id``) in the namespace of the batch's owner, whose tenant the requests
    run as (``protocol.tenants.ids``); the lane is the low one (``batch_priority``), and
    nothing streams.
    """
    try:
        if line.body.get("stream"):
            raise APIError(400, "stream: not supported in a batch", param="stream")
        body = {**line.body, "request_id": line_request_id(batch_id, line.index)}
        requests, shape = validate(SCHEMAS[endpoint], body).to_generate_requests(settings)
        who = served.tenant_of(owner)
        model = (await served.route(requests[0].model, who)).key
        for request in requests:
            check_limits(request, settings)
    except APIError as exc:
        return refused_result(batch_id, line.index, line.custom_id, exc)
    update = {"stream": False, "model": model, "tenant": None if owner == DEFAULT_TENANT
              else owner, "cache_scope": who.prefix_cache_group if who else None}
    planned = tuple(r.model_copy(update={**update, "priority": max(settings.batch_priority,
                                                                   r.priority),
                                         "request_id": scoped_id(owner, r.request_id)})
                    for r in requests)
    return LinePlan(line.index, line.custom_id, planned, shape)


async def check_line(raw: bytes, index: int, rec: BatchRecord, settings: GatewaySettings,
                     served: ServedModels,
                     seen: dict[str, int] | None = None) -> LinePlan | LineResult | None:
    """Line ``index`` of a batch: its plan, the error result of a line that cannot run, or
    None (blank). ``seen`` (validation only) finds duplicate custom_ids: the first runs.

    Any exception but Redis's (waited out by the run) becomes the line's ``internal_error``
    result: one line that breaks the checks must not crash its batch on every attempt.
    """
    try:
        return await _check_line(raw, index, rec, settings, served, seen)
    except (RedisError, OSError):
        raise
    except Exception as exc:
        log.exception("batch_line_check_failed", batch_id=rec.id, line=index + 1)
        return bad_line_result(rec.id, index, custom_id_of(raw), "internal_error",
                               f"line {index + 1}: could not be checked "
                               f"({type(exc).__name__}: {str(exc)[:200]})")


async def _check_line(raw: bytes, index: int, rec: BatchRecord, settings: GatewaySettings,
                      served: ServedModels,
                      seen: dict[str, int] | None) -> LinePlan | LineResult | None:
    try:
        line = parse_line(raw, index, rec.endpoint, settings.max_body_bytes)
    except BadLine as exc:
        return bad_line_result(rec.id, index, custom_id_of(raw), exc.code, exc.message)
    except APIError as exc:  # nested too deep to parse
        return refused_result(rec.id, index, custom_id_of(raw), exc)
    if line is None:
        return None
    first = index if seen is None else seen.setdefault(line.custom_id, index)
    if first != index:
        return bad_line_result(rec.id, index, line.custom_id, "duplicate_custom_id",
                               f"line {index + 1}: custom_id {line.custom_id!r} is already "
                               f"used by line {first + 1}")
    return await plan_line(line, rec.id, rec.endpoint, settings, served, rec.owner)


def _result(batch_id: str, index: int, custom_id: str | None, response: dict[str, Any] | None,
            error: dict[str, Any] | None) -> str:
    """One output or error file line, in OpenAI's batch output format."""
    line = {"id": f"batch_req_{batch_id.removeprefix('batch_')}-{index}",
            "custom_id": custom_id, "response": response, "error": error}
    return json_bytes(line).decode()


def bad_line_result(batch_id: str, index: int, custom_id: str | None, code: str,
                    message: str) -> LineResult:
    """The error-file line of a line that never ran."""
    return LineResult(index, False, _result(batch_id, index, custom_id, None,
                                            {"code": code, "message": message}))


def ended_result(batch_id: str, index: int, custom_id: str | None, code: str) -> LineResult:
    """The error-file line of a line the batch's end stopped (``ENDED_LINES``)."""
    return bad_line_result(batch_id, index, custom_id, code, ENDED_LINES[code])


def refused_result(batch_id: str, index: int, custom_id: str | None,
                   error: APIError) -> LineResult:
    """The error-file line of a body the endpoint refuses: its HTTP answer, as is."""
    response = {"status_code": error.status, "request_id": line_request_id(batch_id, index),
                "body": error.body()}
    return LineResult(index, False, _result(batch_id, index, custom_id, response, None))


def finished_result(batch_id: str, plan: LinePlan,
                    events: Sequence[Sequence[TokenEvent]]) -> LineResult:
    """The result line of a line whose requests all ended (``events``: each request's,
    through its terminal event): the endpoint's response body, or its error answer."""
    finals = [per_prompt[-1] for per_prompt in events]
    error = next((e for e in map(failure, finals) if e is not None), None)
    if error is None:
        body = Formatter(plan.shape.request_id, plan.model, plan.shape).response(events)
        status, ok = 200, True
    else:
        body, status, ok = error.body(), error.status, False
    response = {"status_code": status, "request_id": plan.shape.request_id, "body": body}
    usages = [f.usage for f in finals if f.usage is not None]
    return LineResult(plan.index, ok, _result(batch_id, plan.index, plan.custom_id, response,
                                              None),
                      sum(u.prompt_tokens for u in usages),
                      sum(u.completion_tokens for u in usages),
                      sum(u.cached_tokens or 0 for u in usages))
