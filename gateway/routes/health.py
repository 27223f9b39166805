"""Liveness, readiness, version and metrics: for orchestrators, load generators and
Prometheus, without an API key (``/metrics`` has its own, ``require_metrics_key``).

* ``/healthz``: the process serves HTTP (a liveness probe: a restart would not help Redis).
* ``/readyz`` and vLLM's ``/health`` (GET, HEAD) and ``/ping`` (GET, POST): 200 when a
  request can be served now — Redis answers and at least one worker heartbeat is live — else 503
  with the reason (on a Redis Cluster with a shard lost and others up: 200, degraded,
  naming the lost shards). guidellm checks ``/health`` before a benchmark, so a stack whose
  workers are still loading makes it wait or stop instead of measuring errors.
* ``/version``: ``{"version": "<ferry's package version>"}``, as vLLM answers.
* ``/metrics``: this process's ``ferry_gateway_*`` metrics and the fleet's ``vllm:*`` view
  (``gateway.metrics.fleet``), read from Redis at each scrape.

Answers never name Redis' host or port (the log does).
"""

from __future__ import annotations

import functools
import time
from importlib import metadata

import structlog
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from redis.exceptions import RedisError

from gateway.admission import require_metrics_key
from gateway.metrics.fleet import fleet_exposition
from gateway.queue_client import QueueClient
from protocol.aclient import AsyncFerryClient
from protocol.cluster.shard_health import ShardDownError

router = APIRouter()
log = structlog.get_logger("ferry.gateway")


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process serves HTTP; says nothing about Redis (a restart would not help)."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    """Ready when Redis answers and at least one worker heartbeat is live. On a Redis
    Cluster with a stream shard lost (its master and replicas unreachable) but others up,
    still ready, ``"degraded": true``, naming the lost shards: requests on the others are
    served, those on a lost shard get a prompt 503."""
    client = request.app.state.queue.client
    try:
        reachable = await client.ping()
        lost = _lost(client)
        if not reachable:
            return JSONResponse({"ready": False, "reason": "every stream shard is unreachable",
                                 "lost_shards": lost}, status_code=503)
        workers = await client.live_workers()
    except ShardDownError as exc:  # the heartbeats' shard is the lost one
        log.warning("readyz_heartbeats_unreachable", shard=exc.shard)
        return JSONResponse({"ready": True, "degraded": True, "workers": None,
                             "reason": f"worker heartbeats unreachable: they live on stream "
                                       f"shard {exc.shard}, which is lost",
                             "lost_shards": _lost(client)})
    except (RedisError, OSError) as exc:
        log.warning("readyz_redis_unreachable", error=f"{type(exc).__name__}: {exc}")
        return JSONResponse({"ready": False, "reason": "redis unreachable"}, status_code=503)
    degraded = {"degraded": True, "lost_shards": lost,
                "reason": "stream shard(s) " + ", ".join(str(x["shard"]) for x in lost)
                + " unreachable: their requests get 503"} if lost else {}
    if not workers:
        return JSONResponse({"ready": False, "reason": "no live worker", "workers": 0,
                             **({"lost_shards": lost} if lost else {})}, status_code=503)
    return JSONResponse({"ready": True, "workers": len(workers), **degraded})


def _lost(client: AsyncFerryClient) -> list[dict[str, object]]:
    """The lost shards for an answer: number and for how long, never a host."""
    now = time.time()
    return [{"shard": k, "lost_for_s": round(now - lost.since, 1)}
            for k, lost in sorted(client.shard_health.lost().items())]


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
    fleet = await fleet_exposition(queue.client, request.app.state.settings.served_model_name)
    return Response(queue.metrics.render() + fleet, media_type=CONTENT_TYPE_LATEST)
