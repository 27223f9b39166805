"""The fleet view on the gateway's ``/metrics``: vLLM's names (``vllm:*``) for every live
worker, read from the heartbeats in Redis at each scrape, and the queue's waiting requests.

Why per-worker series (``engine`` = the worker id) carrying each worker's own cumulative
counts, rather than counters the gateway keeps for what it saw: every gateway reads the
same heartbeats, so every gateway process and replica answers the same series with the
same values. A scrape through a Service (whichever replica answers) is right, and where
several replicas or the workers themselves are scraped too, ``max by (model_name,
engine)`` keeps one copy of each. A series is as monotonic as its worker's counter: it
ends when the worker's heartbeat does (a worker that restarts under the same id starts
again from zero, which ``rate()`` reads as a counter reset), so fleet rates are
``sum(rate(...))``, never ``rate(sum(...))``.

``vllm:num_requests_waiting`` adds the requests no worker has taken yet (the group's lag
and the tenants' fair backlogs on every lane: what KEDA's triggers count) as
``engine="(queue)"``, labelled with the served model (the configured one, else the first
live worker's, else ``default``): with no worker live a queued request is still counted.
"""

from __future__ import annotations

import structlog
from prometheus_client import CollectorRegistry, generate_latest
from redis.exceptions import RedisError

from gateway.served.models import FALLBACK_NAME
from observability import vllm_metrics as vllm
from protocol.aclient import AsyncFerryClient
from protocol.cluster.shard_health import ShardDownError
from protocol.models import WorkerHeartbeat

log = structlog.get_logger("ferry.gateway")


async def fleet_exposition(client: AsyncFerryClient, configured_model: str | None) -> bytes:
    """The fleet's ``vllm:*`` families in the text format; empty when Redis cannot be read
    (the scrape still gets the gateway's own metrics; the fleet series go stale)."""
    try:
        try:
            beats = await client.live_workers()
        except ShardDownError:  # the heartbeats' shard is lost: the queue is still known
            beats = []
        waiting = await client.queue_lag()
    except (RedisError, OSError, ShardDownError) as exc:
        log.warning("fleet_metrics_unreadable", error=f"{type(exc).__name__}: {exc}")
        return b""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(vllm.Snapshot(vllm.families(
        engines(beats), [(queue_model(beats, configured_model), waiting)])))
    return generate_latest(registry)


def engines(beats: list[WorkerHeartbeat]) -> list[vllm.Engine]:
    """Each live worker's tally (a heartbeat without a readable one is left out)."""
    found = []
    for beat in sorted(beats, key=lambda b: b.worker_id):
        tally = vllm.EngineTally.decode(beat.stats.get("vllm"))
        if tally is not None:
            found.append((beat.model, beat.worker_id, tally))
    return found


def queue_model(beats: list[WorkerHeartbeat], configured: str | None) -> str:
    """The ``model_name`` of the queue's series (the name ``/v1/models`` lists first)."""
    if configured is not None:
        return configured
    return min((b.model for b in beats), default=FALLBACK_NAME)
