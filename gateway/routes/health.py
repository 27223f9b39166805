"""Liveness, readiness, version and metrics: for orchestrators, load generators and
Prometheus, without an API key (``/metrics`` has its own, ``require_metrics_key``).

* ``/healthz``: the process serves HTTP (a liveness probe: a restart would not help Redis).
* ``/readyz`` and vLLM's ``/health`` (GET, HEAD) and ``/ping`` (GET, POST): 200 when a
  request can be served now — Redis answers and at least one worker heartbeat is live — else 503
  with the reason. guidellm checks ``/health`` before a benchmark, so a stack whose
  workers are still loading makes it wait or stop instead of measuring errors.
* ``/version``: ``{"version": "<ferry's package version>"}``, as vLLM answers.

Answers never name Redis' host or port (the log does).
"""

from __future__ import annotations

import functools
from importlib import metadata

import structlog
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError

from gateway.admission import require_metrics_key
from gateway.queue_client import QueueClient

router = APIRouter()
log = structlog.get_logger("ferry.gateway")


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process serves HTTP; says nothing about Redis (a restart would not help)."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    """Ready when Redis answers and at least one worker heartbeat is live."""
    queue: QueueClient = request.app.state.queue
    try:
        await queue.client.ping()
        workers = await queue.client.live_workers()
    except (RedisError, OSError) as exc:
        log.warning("readyz_redis_unreachable", error=f"{type(exc).__name__}: {exc}")
        return JSONResponse({"ready": False, "reason": "redis unreachable"}, status_code=503)
    if not workers:
        return JSONResponse({"ready": False, "reason": "no live worker", "workers": 0},
                            status_code=503)
    return JSONResponse({"ready": True, "workers": len(workers)})


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """vLLM's health check: 200 when a request can be served now (as ``/readyz``)."""
    return await readyz(request)


@router.head("/health")
async def health_head(request: Request) -> Response:
    """``HEAD /health``: the status of ``GET /health``, without a body, for load balancers
    and uptime checks that probe with HEAD."""
    answer = await readyz(request)
    return Response(status_code=answer.status_code)


@router.get("/ping")
async def ping(request: Request) -> JSONResponse:
    """vLLM's (SageMaker's) ping: the same answer as ``/health``."""
    return await readyz(request)


@router.post("/ping")
async def ping_post(request: Request) -> JSONResponse:
    return await readyz(request)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": _version()}


@functools.cache
def _version() -> str:
    try:
        return metadata.version("ferry")
    except metadata.PackageNotFoundError:  # running from a source tree
        return "unknown"


@router.get("/metrics", dependencies=[Depends(require_metrics_key)])
async def metrics(request: Request) -> Response:
    queue: QueueClient = request.app.state.queue
    return Response(queue.metrics.render(), media_type=CONTENT_TYPE_LATEST)
