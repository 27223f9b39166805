"""Which model names this gateway answers to: one name everywhere, unknown names are 404.

The names are the configured ``served_model_name`` (``FERRY_SERVED_MODEL_NAME``) and the
models that live workers advertise in their heartbeats (``ferry worker
--served-model-name``, default the checkpoint directory's name). A request naming another
model gets 404 ``model_not_found``, as vLLM answers, instead of a completion from a model
it did not ask for; a request naming none is answered as the served model, and that is the
name ``/v1/models`` lists. While nothing is configured and no worker is live, any name is
accepted: the request waits in the queue for whichever worker comes.

The heartbeat read is cached for ``ttl_s`` so that a burst of requests costs one Redis
round trip, not one each; an empty read is not cached, and a name missing from the cache
is looked up again before the 404 (a worker that just started is not refused).
"""

from __future__ import annotations

import time

from gateway.errors import APIError
from protocol.aclient import AsyncFerryClient
from protocol.models import WorkerHeartbeat
from protocol.shard_health import ShardDownError

FALLBACK_NAME = "default"
"""Answered when nothing is configured and no worker is live (the embedded model's name)."""


class ServedModels:
    def __init__(self, client: AsyncFerryClient, configured: str | None, ttl_s: float = 2.0):
        self.client = client
        self.configured = configured
        self.ttl_s = ttl_s
        self._workers: list[WorkerHeartbeat] = []
        self._read_at = float("-inf")

    async def workers(self, fresh: bool = False) -> list[WorkerHeartbeat]:
        stale = time.monotonic() - self._read_at > self.ttl_s or not self._workers
        if fresh or stale:
            try:
                self._workers = await self.client.live_workers()
            except ShardDownError:  # the heartbeats' shard is lost: go on with the last seen
                return self._workers
            self._read_at = time.monotonic()
        return self._workers

    async def names(self, fresh: bool = False) -> list[str]:
        """Served names, the configured one first."""
        advertised = sorted({w.model for w in await self.workers(fresh)})
        if self.configured is None:
            return advertised
        return [self.configured, *(n for n in advertised if n != self.configured)]

    async def resolve(self, requested: str | None) -> str:
        """The name to answer with; ``APIError`` 404 for a model this gateway does not
        serve."""
        names = await self.names()
        if requested is None:
            return names[0] if names else FALLBACK_NAME
        if names and requested not in names:
            names = await self.names(fresh=True)
        if names and requested not in names:
            raise APIError(
                404, f"model: the model {requested!r} does not exist (served: "
                f"{', '.join(names)})", param="model", code="model_not_found")
        return requested
