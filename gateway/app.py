"""App factory: wires settings, the Redis client, middleware, error handlers and routes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import structlog
from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from redis.exceptions import RedisError

from gateway.admission import BodyLimitMiddleware, require_api_key
from gateway.errors import APIError, install_error_handlers, unavailable
from gateway.metrics.prometheus import Metrics, MetricsMiddleware
from gateway.queue_client import QueueClient
from gateway.redis_client import ferry_client
from gateway.request_id import HEADER as REQUEST_ID_HEADER
from gateway.request_id import RequestIdMiddleware
from gateway.routes import batches, files, health, jobs, lora, openai, responses, tokenize
from gateway.served.lora import LoraAdapters
from gateway.served.models import ServedModels
from gateway.settings import GatewaySettings
from gateway.tenancy.tenants import tenant_directory
from gateway.tokenizer_client import TokenizerClient

log = structlog.get_logger("ferry.gateway")


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    """A gateway app; ``settings`` default to ``GatewaySettings.from_env()``."""
    settings = settings or GatewaySettings.from_env()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = ferry_client(settings)
        app.state.queue = QueueClient(client, settings, metrics, app.state.tenants)
        app.state.served = ServedModels(client, settings.served_model_name)
        app.state.served.tenants = app.state.tenants
        app.state.tokenizer = TokenizerClient(client, app.state.served, settings, metrics)
        app.state.lora = LoraAdapters(client, app.state.served, app.state.tokenizer, settings)
        if settings.lora_dir is not None:
            app.state.served.resolver = app.state.lora.from_dir
        try:
            await client.ensure_group()  # so queue lag is measurable before a worker starts
        except (RedisError, OSError) as exc:
            log.warning("redis_unreachable_at_startup", url=settings.redis_url, error=str(exc))
        try:
            yield
        finally:
            await client.aclose()

    # The docs are routes of our own, so that FERRY_API_KEYS guards them like the API.
    app = FastAPI(title="Ferry gateway", version="1", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.settings = settings
    app.state.tenants = tenant_directory(settings)
    _install_docs(app)
    install_error_handlers(app, settings.retry_after_s)
    _install_fallback_handlers(app, settings.retry_after_s)
    app.add_exception_handler(404, _not_served)
    app.include_router(health.router)
    app.include_router(openai.router)
    app.include_router(responses.router)
    app.include_router(jobs.router)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(tokenize.router)
    app.include_router(lora.router)
    upload_limit = settings.batch_file_max_bytes + files.MULTIPART_SLACK
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes,
                       paths={"/v1/files": upload_limit})
    _install_cors(app, settings.allowed_origins)
    app.add_middleware(RequestIdMiddleware)  # every answer carries X-Request-Id
    app.add_middleware(MetricsMiddleware, metrics=metrics)  # outermost: sees every status
    return app


def _install_cors(app: FastAPI, origins: tuple[str, ...]) -> None:
    """CORS for browser clients, as vLLM's ``--allowed-origins``: off unless origins are
    set (``*``: any). Outside the body limit and the routes, so a preflight is answered
    without a key and a refusal (401, 413, 429) still reaches the page that asked."""
    if not origins:
        return
    app.add_middleware(
        CORSMiddleware, allow_origins=list(origins), allow_methods=["*"],
        allow_headers=["*"], allow_credentials=False,
        expose_headers=[REQUEST_ID_HEADER.decode(), "Retry-After", "Location"])


def _install_docs(app: FastAPI) -> None:
    """/openapi.json, /docs and /redoc, behind the API key when keys are configured."""
    guard = [Depends(require_api_key)]

    @app.get("/openapi.json", include_in_schema=False, dependencies=guard)
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=guard)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - docs")

    @app.get("/redoc", include_in_schema=False, dependencies=guard)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")


_MAX_ROUTE_CHARS = 200


async def _not_served(request: Request, exc: Exception) -> Response:
    """A path no route serves (``/v1/embeddings``, ``/rerank``, ``/sleep``, ...): 404 in
    OpenAI's shape, naming the route, so a client learns this server does not offer it
    (not that something it asked for is missing). With API keys the key is checked
    first, as on the routes that exist: without one, no route is told from another."""
    if "endpoint" in request.scope:  # a route raised it: its own 404
        detail = getattr(exc, "detail", "not found")
        return APIError(404, str(detail)).response()
    try:
        await require_api_key(request)
    except APIError as refused:
        return refused.response()
    route = f"{request.method} {request.url.path}"[:_MAX_ROUTE_CHARS]
    return APIError(404, f"{route}: not supported by this server", code="not_supported"
                    ).response()


def _install_fallback_handlers(app: FastAPI, retry_after_s: int) -> None:
    """Whatever escapes the specific handlers still gets an OpenAI-style JSON body: any
    Redis error (an unexpected reply such as LOADING or OOM) a 503, anything else a 500,
    never Starlette's plain-text "Internal Server Error". The 500 says ``Connection:
    close``: Starlette re-raises the error after it (for the server's log) and uvicorn then
    closes the connection, so a client that reused it for its next request had that one
    reset instead of answered."""

    async def on_redis(_: Request, exc: Exception) -> JSONResponse:
        log.warning("redis_error", error=f"{type(exc).__name__}: {exc}")
        return unavailable(exc, retry_after_s).response()

    async def on_anything(_: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled_error", error=f"{type(exc).__name__}: {exc}")
        return APIError(500, f"internal error: {type(exc).__name__}", type_="server_error",
                        headers={"Connection": "close"}).response()

    app.add_exception_handler(RedisError, on_redis)
    app.add_exception_handler(Exception, on_anything)
