"""Liveness, readiness and metrics: unauthenticated, for orchestrators and Prometheus."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError

from gateway.engine import Engine

router = APIRouter()


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process serves HTTP; says nothing about Redis (a restart would not help)."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    """Ready when Redis answers and at least one worker heartbeat is live."""
    engine: Engine = request.app.state.engine
    try:
        await engine.client.ping()
        workers = await engine.client.live_workers()
    except (RedisError, OSError) as exc:
        return JSONResponse({"ready": False, "reason": f"redis: {exc}"}, status_code=503)
    if not workers:
        return JSONResponse({"ready": False, "reason": "no live worker", "workers": 0},
                            status_code=503)
    return JSONResponse({"ready": True, "workers": len(workers)})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    engine: Engine = request.app.state.engine
    return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)
