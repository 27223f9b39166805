"""The gateway's client of the Redis queue: admit, subscribe-then-enqueue, follow, cancel on exit.

A ``Generation`` is one enqueued request as seen by one HTTP exchange. Whatever ends the
exchange (terminal event, client gone, deadline, error) must end in ``close()``, which
cancels the job unless its terminal event was seen: an abandoned request must not keep
burning GPU time.
"""

from __future__ import annotations

import contextlib
import time

import anyio
import structlog
from fastapi import Request
from redis.exceptions import RedisError

from gateway.admission import check_limits, check_queue
from gateway.errors import APIError, unavailable
from gateway.metrics.prometheus import Metrics
from gateway.settings import GatewaySettings
from gateway.tenancy.naming import NamedTenants
from gateway.tenancy.quotas import Quotas
from gateway.tenancy.tenants import DEFAULT, Tenant, TenantDirectory
from protocol.aclient import AsyncFerryClient, AsyncSubscription
from protocol.models import GenerateRequest, TokenEvent
from protocol.store import DuplicateRequestError
from protocol.streaming import StreamTimeout
from protocol.tenants.ids import public_id

log = structlog.get_logger("ferry.gateway")


class ClientGone(Exception):
    """The HTTP client disconnected while waiting for a non-streamed result."""


class QueueClient:
    """Shared by all handlers of one app; holds the async client, settings and metrics."""

    def __init__(self, client: AsyncFerryClient, settings: GatewaySettings, metrics: Metrics,
                 tenants: TenantDirectory | None = None):
        self.client = client
        self.settings = settings
        self.metrics = metrics
        self.tenants = NamedTenants(client, tenants or TenantDirectory())
        self.quotas = Quotas(client, settings.job_ttl_s, settings.retry_after_s)

    async def admit(self, requests: list[GenerateRequest], tenant: Tenant = DEFAULT) -> None:
        """Refuse before enqueueing: caps first (cheap, local), then the queue lag (once
        for all the requests of one exchange), then the tenant's quotas (which count the
        requests as admitted, so they run last)."""
        try:
            for request in requests:
                check_limits(request, self.settings)
        except APIError:
            self.metrics.rejections.labels("limits").inc()
            raise
        try:
            await check_queue(self.client, self.settings, requests)
        except APIError:
            self.metrics.rejections.labels("queue_full").inc()
            raise
        try:
            await self.quotas.admit(tenant, requests)
        except APIError as exc:
            quota = (exc.code or "quota").removeprefix("quota_")
            self.metrics.rejections.labels("quota").inc()
            self.metrics.tenant_rejections.labels(tenant.id, quota).inc()
            log.info("quota_refused", tenant=tenant.id, quota=quota)
            raise
        self.metrics.tenant_requests.labels(tenant.id).inc(len(requests))

    async def enqueue(self, request: GenerateRequest) -> None:
        """Enqueue with the weight of the request's tenant; 409 for an id in use (the
        tenant's concurrency is given back for anything else not enqueued: an id in use
        keeps its slot, which is the running job's)."""
        tenant = self.tenants.directory.tenant(request.tenant)
        try:
            await self.client.enqueue(request, weight=tenant.weight)
        except DuplicateRequestError:
            self.metrics.enqueue_errors.labels("duplicate_id").inc()
            mine = public_id(tenant.id, request.request_id)  # the caller's id, not Redis'
            raise APIError(409, f"request_id: {mine!r} is already in use",
                           param="request_id") from None
        except BaseException as exc:
            self.metrics.enqueue_errors.labels(type(exc).__name__).inc()
            with anyio.CancelScope(shield=True), contextlib.suppress(RedisError, OSError):
                await self.quotas.release(tenant, [request.request_id])
            raise

    async def start(self, request: GenerateRequest, received_at: float) -> Generation:
        """Subscribe to the request's tokens, *then* enqueue it: no token can be missed."""
        sub = await self.open(request.request_id)
        try:
            await self.enqueue(request)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await sub.close()
            raise
        self.metrics.inflight_streams.inc()
        return Generation(self, request, sub, received_at)

    async def open(self, request_id: str, after_seq: int = -1) -> AsyncSubscription:
        """An open subscription, or a 503 once ``redis_timeout_s`` passes without Redis
        confirming it (Redis away or restarting): a bounded wait, a JSON answer."""
        sub = self.client.subscribe(request_id, after_seq)
        try:
            return await sub.open(timeout=self.settings.redis_timeout_s)
        except StreamTimeout as exc:
            raise unavailable(exc, self.settings.retry_after_s) from None

    def deadline_s(self, request: GenerateRequest) -> float:
        if request.timeout_s is not None:
            return request.timeout_s + self.settings.timeout_grace_s
        return self.settings.request_timeout_s


class Generation:
    """Follows one request's events, with a deadline, metrics and cancel-on-close."""

    def __init__(self, queue: QueueClient, request: GenerateRequest, sub: AsyncSubscription,
                 received_at: float) -> None:
        self.queue = queue
        self.request = request
        self.sub = sub
        self.received_at = received_at
        self.deadline = time.monotonic() + queue.deadline_s(request)
        self.close_reason = "client disconnected"
        self._saw_token = False
        self._closed = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def finished(self) -> bool:
        return self.sub.finished

    async def next(self, wait: float) -> list[TokenEvent]:
        """Events that arrive within ``wait`` s (maybe none); StreamTimeout past the deadline."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.close_reason = "gateway timeout"
            raise StreamTimeout(f"request {self.request_id} did not finish in time")
        events = await self.sub.next_events(min(wait, left))
        self._observe(events)
        return events

    def _observe(self, events: list[TokenEvent]) -> None:
        metrics = self.queue.metrics
        for event in events:
            if event.token_ids and not self._saw_token:
                self._saw_token = True
                metrics.ttft.observe(time.time() - self.received_at)
            if event.is_final:
                tenant = self.request.tenant or DEFAULT.id
                self.queue.metrics.tenant_tokens.labels(tenant, "prompt").inc(
                    event.usage.prompt_tokens if event.usage else 0)
                self.queue.metrics.tenant_tokens.labels(tenant, "completion").inc(
                    event.usage.completion_tokens if event.usage else 0)
                latency = time.time() - self.received_at
                metrics.latency.labels(event.finish_reason or "").observe(latency)

    async def collect(self, http: Request) -> list[TokenEvent]:
        """All events through the terminal one; ClientGone if the client hangs up first."""
        events: list[TokenEvent] = []
        while not self.finished:
            batch = await self.next(self.queue.settings.disconnect_check_s)
            events.extend(batch)
            if not batch and await http.is_disconnected():
                raise ClientGone(self.request_id)
        return events

    async def close(self) -> None:
        """Idempotent; cancels the job unless finished. Shielded: runs even when cancelled."""
        if self._closed:
            return
        self._closed = True
        self.queue.metrics.inflight_streams.dec()
        with anyio.CancelScope(shield=True):
            try:
                if not self.sub.finished:
                    state = await self.queue.client.cancel(self.request_id, self.close_reason)
                    log.info("request_cancelled", request_id=self.request_id,
                             reason=self.close_reason, state=state)
            except (RedisError, OSError) as exc:
                log.warning("cancel_failed", request_id=self.request_id, error=str(exc))
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await self.sub.close()
