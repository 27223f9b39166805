"""Process entry point: ``ferry gateway --redis-url URL --port 8000`` calls ``serve``.

One process serves the app built in place. With ``workers > 1`` uvicorn's own
multi-process mode runs that many processes on one listening socket (bound once in
uvicorn's parent, handed to each child, which uvicorn restarts if it dies); each child
imports this module and builds its app with :func:`app_from_env`, so the settings travel
as ``FERRY_*`` variables, written out in full by :func:`settings_env` (and checked to
round-trip, so a setting that cannot travel is an error, not a silently different child).
"""

from __future__ import annotations

import ipaddress
import os
from typing import Any

import structlog
import uvicorn
from fastapi import FastAPI

from gateway.app import create_app
from gateway.settings import GatewaySettings, checked_settings

log = structlog.get_logger("ferry.gateway")


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable only from this machine (``localhost``, 127.x, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: assume it resolves to something others can reach


def settings_env(settings: GatewaySettings) -> dict[str, str]:
    """Every setting as the ``FERRY_*`` variable ``GatewaySettings.from_env`` reads back."""
    env: dict[str, str] = {}
    for name in GatewaySettings.model_fields:
        value = getattr(settings, name)
        if isinstance(value, tuple):
            text = ",".join(str(v) for v in value)
        elif value is None:
            text = "none"
        else:
            text = str(value)
        env[f"FERRY_{name.upper()}"] = text
    if GatewaySettings.from_env(env) != settings:
        raise ValueError("gateway settings do not survive the FERRY_* environment that "
                         "passes them to --workers processes (an api key with a comma?)")
    return env


def app_from_env() -> FastAPI:
    """uvicorn's factory in each ``--workers`` process: logging and settings from env."""
    from observability.logging import configure_logging

    configure_logging(level=os.environ.get("FERRY_LOG_LEVEL", "info"))
    return create_app(GatewaySettings.from_env())


def serve(
    redis_url: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    workers: int = 1,
    **opts: Any,
) -> None:
    """Run the gateway under uvicorn until SIGINT/SIGTERM.

    Settings come from ``FERRY_*`` variables, overridden by ``redis_url`` and ``opts``
    (any ``GatewaySettings`` field, e.g. ``api_keys=("k",)``, ``max_queue_lag=500``).
    """
    if workers < 1:
        raise ValueError(f"workers: {workers} must be >= 1")
    overrides = dict(opts)
    if redis_url is not None:
        overrides["redis_url"] = redis_url
    settings = checked_settings("ferry gateway", **overrides)
    from observability.logging import configure_logging

    configure_logging(level=log_level)  # structlog owns the handlers, uvicorn's too
    if not is_loopback(host) and not (settings.api_keys or settings.tenants_file):
        log.warning("gateway_open_without_api_keys", host=host, port=port,
                    hint="anyone who reaches this address can use the API: set "
                    "FERRY_API_KEYS or FERRY_TENANTS_FILE, or listen on 127.0.0.1")
    common: dict[str, Any] = dict(host=host, port=port, log_level=log_level, log_config=None,
                                  timeout_graceful_shutdown=10, proxy_headers=True)
    if workers == 1:
        uvicorn.run(create_app(settings), **common)
        return
    os.environ.update(settings_env(settings), FERRY_LOG_LEVEL=log_level)
    uvicorn.run("gateway.main:app_from_env", factory=True, workers=workers, **common)
