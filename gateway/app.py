"""App factory: wires settings, the Redis client, middleware, error handlers and routes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import redis.asyncio as aredis
import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import RedisError

from gateway import routes_health, routes_jobs, routes_openai
from gateway.admission import BodyLimitMiddleware
from gateway.engine import Engine
from gateway.errors import APIError, install_error_handlers, unavailable
from gateway.metrics import Metrics, MetricsMiddleware
from gateway.served_models import ServedModels
from gateway.settings import GatewaySettings
from protocol.aclient import AsyncFerryClient

log = structlog.get_logger("ferry.gateway")


def _redis(settings: GatewaySettings) -> aredis.Redis:
    # One quick retry: it re-dials a pooled connection that a Redis restart closed (the
    # command never ran), and a request still gets its 503 in about a second, not a hang.
    # It must be redis.asyncio's Retry: the sync one, given to the asyncio client, only
    # wraps the creation of the coroutine and so never retries anything.
    return aredis.Redis.from_url(
        settings.redis_url,
        socket_timeout=settings.redis_timeout_s,
        socket_connect_timeout=min(settings.redis_timeout_s, 2.0),
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 1),
        health_check_interval=30,
        # redis-py's default pool (100) answered "Too many connections" (503) at ~64
        # concurrent streams when each held its own pub/sub connection; now they share one
        # (protocol/pubsub_hub.py), but a burst of requests still runs commands at once.
        max_connections=settings.redis_max_connections,
    )


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    """A gateway app; ``settings`` default to ``GatewaySettings.from_env()``."""
    settings = settings or GatewaySettings.from_env()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = AsyncFerryClient(
            _redis(settings), settings.keys, settings.ttls, settings.poll_interval_s
        )
        app.state.engine = Engine(client, settings, metrics)
        app.state.served = ServedModels(client, settings.served_model_name)
        try:
            await client.ensure_group()  # so queue lag is measurable before a worker starts
        except (RedisError, OSError) as exc:
            log.warning("redis_unreachable_at_startup", url=settings.redis_url, error=str(exc))
        try:
            yield
        finally:
            await client.aclose()

    app = FastAPI(title="Ferry gateway", version="1", lifespan=lifespan)
    app.state.settings = settings
    install_error_handlers(app, settings.retry_after_s)
    _install_fallback_handlers(app, settings.retry_after_s)
    app.include_router(routes_health.router)
    app.include_router(routes_openai.router)
    app.include_router(routes_jobs.router)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # outermost: sees every status
    return app


def _install_fallback_handlers(app: FastAPI, retry_after_s: int) -> None:
    """Whatever escapes the specific handlers still gets an OpenAI-style JSON body: any
    Redis error (an unexpected reply such as LOADING or OOM) a 503, anything else a 500,
    never Starlette's plain-text "Internal Server Error"."""

    async def on_redis(_: Request, exc: Exception) -> JSONResponse:
        log.warning("redis_error", error=f"{type(exc).__name__}: {exc}")
        return unavailable(exc, retry_after_s).response()

    async def on_anything(_: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled_error", error=f"{type(exc).__name__}: {exc}")
        return APIError(500, f"internal error: {type(exc).__name__}", type_="server_error"
                        ).response()

    app.add_exception_handler(RedisError, on_redis)
    app.add_exception_handler(Exception, on_anything)
