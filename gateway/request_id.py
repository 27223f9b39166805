"""``X-Request-Id``: every response carries one, the client's own when it sent a usable one.

As vLLM does with ``--enable-request-id-headers`` (here always on: one header costs
nothing): a client-sent ``X-Request-Id`` is echoed on the response, else a fresh one
(32 hex digits) is made. The id is bound to the request's log lines (``x_request_id``), so
a client's report can be matched to the gateway's log. A sent id is used only if it is at
most ``MAX_LENGTH`` visible ASCII characters (no spaces, no control characters): anything
else is replaced by a fresh id instead of being written back into a header.
"""

from __future__ import annotations

import re
import uuid

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"
MAX_LENGTH = 128
_USABLE = re.compile(rb"^[\x21-\x7e]{1,%d}$" % MAX_LENGTH)


def request_id_of(scope: Scope) -> str:
    """The client's ``X-Request-Id`` if usable, else a fresh one."""
    for name, value in scope.get("headers") or ():
        if name == HEADER and _USABLE.match(value):
            return str(value.decode("ascii"))
    return uuid.uuid4().hex


class RequestIdMiddleware:
    """Pure ASGI (no buffering: SSE streams pass through); sets the response header."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id_of(scope)
        structlog.contextvars.bind_contextvars(x_request_id=rid)
        header = (HEADER, rid.encode("ascii"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, header]}
            await send(message)

        await self.app(scope, receive, send_with_id)
