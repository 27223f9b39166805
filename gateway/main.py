"""Process entry point: ``ferry gateway --redis-url URL --port 8000`` calls ``serve``."""

from __future__ import annotations

from typing import Any

import uvicorn

from gateway.app import create_app
from gateway.settings import GatewaySettings


def serve(
    redis_url: str | None = None,
    host: str = "0.0.0.0",
    port: int = 8000,
    log_level: str = "info",
    **opts: Any,
) -> None:
    """Run the gateway under uvicorn until SIGINT/SIGTERM.

    Settings come from ``FERRY_*`` variables, overridden by ``redis_url`` and ``opts``
    (any ``GatewaySettings`` field, e.g. ``api_keys=("k",)``, ``max_queue_lag=500``).
    """
    overrides = dict(opts)
    if redis_url is not None:
        overrides["redis_url"] = redis_url
    settings = GatewaySettings.from_env(**overrides)
    from observability.logging import configure_logging

    configure_logging(level=log_level)  # structlog owns the handlers, uvicorn's too
    uvicorn.run(
        create_app(settings),
        host=host,
        port=port,
        log_level=log_level,
        log_config=None,
        timeout_graceful_shutdown=10,
        proxy_headers=True,
    )
