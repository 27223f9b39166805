"""The Redis client of the gateway's processes (the HTTP app and ``ferry batcher``).

One Redis or a Redis Cluster, from the same ``GatewaySettings``: the cluster client routes
each command by slot and follows MOVED and failovers itself; the single client retries a
command once, which re-dials a pooled connection that a Redis restart closed (the command
never ran), so a request still gets its 503 in about a second, not a hang.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from gateway.settings import GatewaySettings
from protocol.aclient import AsyncFerryClient
from protocol.cluster.nodes import async_cluster_client


def redis_for(settings: GatewaySettings) -> Any:
    """A ``redis.asyncio`` client for ``settings.redis_url`` (a cluster node when
    ``settings.redis_cluster``)."""
    if settings.redis_cluster:
        return async_cluster_client(
            settings.redis_url, socket_timeout=settings.redis_timeout_s,
            socket_connect_timeout=min(settings.redis_timeout_s, 2.0),
            max_connections=settings.redis_max_connections)
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
        # (protocol/cluster/pubsub_hub.py), but a burst of requests still runs commands at once.
        max_connections=settings.redis_max_connections,
    )


def ferry_client(settings: GatewaySettings) -> AsyncFerryClient:
    """The protocol client over ``redis_for(settings)``, with the deployment's key names,
    TTLs and replication (cluster: ``WAIT`` for replicas before a request is accepted)."""
    return AsyncFerryClient(redis_for(settings), settings.keys, settings.ttls,
                            settings.poll_interval_s, replication=settings.replication)
