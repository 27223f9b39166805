"""Prometheus metrics, one registry per app (tests build many apps in one process); served
on ``/metrics`` behind ``FERRY_METRICS_KEY`` (``gateway.admission.require_metrics_key``),
followed by the fleet's ``vllm:*`` view (``gateway.metrics.fleet``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)


class Metrics:
    """The gateway's metrics; names start with ``ferry_gateway_``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter(
            "ferry_gateway_requests", "HTTP requests by route template, method and status.",
            ["route", "method", "status"], registry=reg,
        )
        self.inflight_streams = Gauge(
            "ferry_gateway_inflight_streams",
            "Open token subscriptions (SSE streams and waiting non-stream requests).",
            registry=reg,
        )
        self.ttft = Histogram(
            "ferry_gateway_time_to_first_token_seconds",
            "From receiving the request to its first token event.",
            buckets=_TTFT_BUCKETS, registry=reg,
        )
        self.latency = Histogram(
            "ferry_gateway_request_latency_seconds",
            "End to end: from receiving the request to its terminal event.",
            ["finish_reason"], buckets=_LATENCY_BUCKETS, registry=reg,
        )
        self.enqueue_errors = Counter(
            "ferry_gateway_enqueue_errors", "Requests that could not be enqueued, by reason.",
            ["reason"], registry=reg,
        )
        self.rejections = Counter(
            "ferry_gateway_admission_rejections", "Requests refused by admission control.",
            ["reason"], registry=reg,
        )

        # per tenant (its name: the tenants file's, or a key's HMAC under the deployment's
        # secret, gateway.tenancy.naming): never derivable from a key alone
        self.tenant_requests = Counter(
            "ferry_gateway_tenant_requests", "Generation requests admitted, by tenant.",
            ["tenant"], registry=reg,
        )
        self.tenant_tokens = Counter(
            "ferry_gateway_tenant_tokens", "Tokens of finished requests seen by this gateway, "
            "by tenant and kind (prompt, completion).", ["tenant", "kind"], registry=reg,
        )
        self.tenant_rejections = Counter(
            "ferry_gateway_tenant_quota_rejections", "Requests refused with 429 by a tenant "
            "quota, by tenant and quota.", ["tenant", "quota"], registry=reg,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Counts every HTTP request by its route *template* (bounded label cardinality)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def tracking_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.metrics.requests.labels(route, scope.get("method", ""), str(status)).inc()
