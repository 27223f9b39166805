"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``.

OpenAI SDKs surface ``message`` to the user, so every message starts with the field it is
about (``"max_tokens: 9000 exceeds the limit of 8192"``) and ``param`` names it again.
Invalid input is a 400 with type ``invalid_request_error``, as OpenAI and vLLM answer
(clients branch on 400, not on FastAPI's 422); ``code`` is a short string (OpenAI's
``model_not_found``, or one derived from the status), never a bare number.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from gateway.field_errors import field_error
from protocol.cluster.nodes import NotReplicatedError
from protocol.cluster.shard_health import ShardDownError
from protocol.codec import ProtocolError
from protocol.models import TokenEvent

log = structlog.get_logger("ferry.gateway")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    503: "service_unavailable",
    504: "timeout",
}
_CODES = {
    400: "invalid_request", 401: "invalid_api_key", 404: "not_found", 409: "conflict",
    413: "request_too_large", 429: "rate_limit_exceeded", 499: "cancelled",
    500: "internal_error", 502: "bad_gateway", 503: "unavailable", 504: "timeout",
}


class APIError(Exception):
    """An HTTP error with an OpenAI-style body; raise it anywhere in a handler."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str | None = None,
        headers: Mapping[str, str] | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or _TYPES.get(status, "server_error" if status >= 500 else "error")
        self.headers = dict(headers) if headers else None
        self.code = code or _CODES.get(status, "error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    message: str, type_: str, param: str | None, code: str | None
) -> dict[str, Any]:
    return {"error": {"message": scrub(message), "type": type_, "param": param,
                      "code": code}}


# Where a traceback starts: Python's, a frame line of one, C++'s (torch: "Exception raised
# from f at /path/x.cpp:12 (most recent call first):").
_TRACEBACK = re.compile(r'Traceback \(most recent call last\)|\bFile "[^"\n]*", line \d+'
                        r'|\(most recent call first\)|Exception raised from ')
# An absolute path (not a URL's: nothing before it but a space, a quote or a bracket)
_PATH = re.compile(r"(?<![\w.~:/-])/([\w.@+-]+)(?:/[^\s'\"(),;:]*)?")
_ROOTS = frozenset(os.listdir("/")) if os.path.isdir("/") else frozenset()


def scrub_error(record: dict[str, Any]) -> dict[str, Any]:
    """A job's status or event as the jobs API shows it: its ``error`` scrubbed."""
    if isinstance(record.get("error"), str):
        record["error"] = scrub(record["error"])
    return record


def scrub(message: str) -> str:
    """``message`` without a traceback or a path on this server: the log has them, the
    client is told neither how the server is laid out nor what its code looks like. A path
    counts when its first directory exists here (``/etc/...``, ``/usr/...``, the install
    directory), so routes (``/v1/embeddings``) and the client's own paths stay."""
    found = _TRACEBACK.search(message)
    if found is not None:
        message = message[:found.start()].rstrip() + " (details are in the server's log)"
    return _PATH.sub(lambda m: "<path>" if m.group(1) in _ROOTS else m.group(0), message)


def unavailable(exc: Exception, retry_after_s: int) -> APIError:
    """503 with Retry-After. The message names the kind of failure only: Redis' own
    message holds its host and port, which is no business of an unauthenticated caller
    (the log has it)."""
    log.warning("queue_unavailable", error=f"{type(exc).__name__}: {exc}")
    # Ferry's own "no replica confirmed" names the request and the WAIT, and "stream shard
    # k is unreachable" the shard, no address: the caller should learn why its request was
    # not accepted (docs/operations.md).
    why = str(exc) if isinstance(exc, (NotReplicatedError, ShardDownError)) \
        else type(exc).__name__
    return APIError(503, f"queue unavailable ({why}); retry later",
                    headers={"Retry-After": str(retry_after_s)})


def install_error_handlers(app: FastAPI, retry_after_s: int) -> None:
    """Map every error the gateway can meet to an OpenAI-style JSON response."""

    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return exc.response()

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = list(exc.errors())
        skip = 1 if errors and tuple(errors[0].get("loc", ()))[:1] == ("body",) else 0
        message, param = field_error(errors, skip_loc=skip)
        return APIError(400, message, param=param).response()

    async def on_http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    async def on_redis(_: Request, exc: Exception) -> JSONResponse:
        log.warning("redis_unavailable", error=str(exc))
        return unavailable(exc, retry_after_s).response()

    async def on_protocol(_: Request, exc: Exception) -> JSONResponse:
        log.error("bad_message_from_queue", error=str(exc))
        return APIError(502, f"bad message from the queue: {exc}", type_="server_error").response()

    async def on_client_gone(_: Request, exc: Exception) -> Response:
        # the client hung up while its body was being read: nobody to answer (499)
        return Response(status_code=499)

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        # Never a plain-text 500: an OpenAI-shaped body, and the traceback in the log.
        log.error("unhandled_error", error=f"{type(exc).__name__}: {exc}", exc_info=exc)
        return APIError(500, f"internal error: {type(exc).__name__}").response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(Exception, on_unexpected)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(RedisConnectionError, on_redis)
    app.add_exception_handler(RedisTimeoutError, on_redis)
    app.add_exception_handler(ProtocolError, on_protocol)
    app.add_exception_handler(ClientDisconnect, on_client_gone)


_KIND_STATUS = {"invalid_request": 400, "internal": 500, "unavailable": 503}
_REASON_STATUS = {"timeout": 504, "abort": 503, "cancelled": 499}
_DEFAULT_MESSAGES = {
    "error": "the worker failed to run the request",
    "timeout": "the request timed out",
    "abort": "the request was aborted by the worker; retry",
    "cancelled": "the request was cancelled",
}
_HTTP_PARAM = {"prompt_token_ids": "prompt"}  # wire field -> the HTTP body's


def failure(event: TokenEvent) -> APIError | None:
    """The HTTP error a terminal event stands for, or None for stop/length: ``error`` by
    the worker's ``error_kind`` (invalid_request -> 400, e.g. a model without a chat
    template), ``timeout`` -> 504, ``abort`` -> 503 (retry), ``cancelled`` -> 499 (gRPC's
    CANCELLED over HTTP); the worker's ``error_code`` and ``error_param`` are kept."""
    reason = event.finish_reason
    if reason in (None, "stop", "length"):
        return None
    if reason == "error":
        status = _KIND_STATUS.get(event.error_kind or "internal", 500)
    else:
        status = _REASON_STATUS[reason]
    message = event.error or _DEFAULT_MESSAGES[reason]
    type_ = "invalid_request_error" if status == 400 else None
    param = _HTTP_PARAM.get(event.error_param or "", event.error_param)
    return APIError(status, message, type_=type_, param=param, code=event.error_code)
