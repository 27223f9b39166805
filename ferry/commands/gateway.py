"""``ferry gateway``: the HTTP gateway (OpenAI-compatible API + jobs API) over Redis.

Torch-free by construction: this module imports only typer, and the command imports only
``gateway`` and ``protocol``, so a gateway container needs no GPU stack (a test checks
that ``torch`` never gets imported).
"""

from __future__ import annotations

from typing import Annotated

import typer


def gateway(
    redis_url: Annotated[str | None, typer.Option(
        envvar="FERRY_REDIS_URL", help="Redis URL (default redis://localhost:6379/0).",
    )] = None,
    host: Annotated[str, typer.Option(envvar="FERRY_HOST")] = "0.0.0.0",
    port: Annotated[int, typer.Option(envvar="FERRY_PORT")] = 8000,
    prefix: Annotated[str | None, typer.Option(envvar="FERRY_PREFIX")] = None,
    log_level: Annotated[str, typer.Option(envvar="FERRY_LOG_LEVEL")] = "info",
) -> None:
    """Serve the HTTP API; other settings come from FERRY_* variables (docs/operations.md)."""
    from gateway.main import serve
    from observability.logging import configure_logging

    configure_logging(level=log_level)
    opts = {"prefix": prefix} if prefix is not None else {}
    serve(redis_url, host=host, port=port, log_level=log_level, **opts)
