"""The gateway's fleet view of vLLM's names: one scrape of its ``/metrics`` answers what a
KEDA/HPA rule or a dashboard written for vLLM asks (``vllm:num_requests_waiting`` and the
rest), from the queue and the workers' heartbeats in Redis.

Real Redis, a real gateway over HTTP; the heartbeats are written the way workers write
them (``protocol.store.write_heartbeat``, the tally a worker encodes), without a model.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from gateway.settings import GatewaySettings
from observability.vllm_metrics import QUEUE_ENGINE, EngineTally
from protocol.client import FerryClient
from protocol.codec import request_fields
from protocol.keys import Keys
from protocol.models import GenerateRequest, SamplingParams, WorkerHeartbeat
from protocol.store import Ttls, ensure_group, write_heartbeat
from tests.gateway.server import GatewayServer
from tests.redis_server import RedisServer

KEYS = Keys()


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


def _samples(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
           **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def _request(rid: str) -> GenerateRequest:
    return GenerateRequest(request_id=rid, prompt="hello", params=SamplingParams(max_tokens=4))


def test_queued_requests_are_waiting_with_no_worker_live(server: RedisServer) -> None:
    """Three requests in the fair backlog (how the gateway and producers enqueue) and one
    XADDed straight into the high lane: four waiting, with no worker anywhere."""
    client = FerryClient.from_url(server.url)
    r = redis.Redis.from_url(server.url)
    try:
        client.ensure_group()
        for i in range(3):
            client.enqueue(_request(f"fair-{i}"))
        r.xadd(KEYS.requests_for(-10), request_fields(_request("direct")))  # type: ignore[arg-type]
        with GatewayServer(GatewaySettings(redis_url=server.url)) as gateway:
            samples = _samples(gateway.url)
        assert _value(samples, "vllm:num_requests_waiting",
                      model_name="default", engine=QUEUE_ENGINE) == 4
        with GatewayServer(GatewaySettings(redis_url=server.url,
                                           served_model_name="my-model")) as gateway:
            samples = _samples(gateway.url)
        assert _value(samples, "vllm:num_requests_waiting",
                      model_name="my-model", engine=QUEUE_ENGINE) == 4
        assert _value(samples, "ferry_gateway_inflight_streams") == 0  # its own, kept
    finally:
        client.close()
        r.close()


def _beat(worker_id: str, model: str, stats: dict[str, float | int | str]) -> WorkerHeartbeat:
    now = time.time()
    return WorkerHeartbeat(worker_id=worker_id, model=model, started_at=now, updated_at=now,
                           stats=stats)


def test_each_live_worker_is_a_series_of_its_own(server: RedisServer) -> None:
    """Two workers' tallies as they reported them, per ``engine`` (the worker id), beside
    the queue; a heartbeat without a readable tally is left out, not a 500."""
    r = redis.Redis.from_url(server.url)
    ensure_group(r, KEYS)
    a, b = EngineTally(), EngineTally()
    a.running, a.waiting, a.kv_usage = 3, 1, 0.25
    a.finished("stop", 0.05, 0.9, 0.01, prompt_tokens=11, output_tokens=5)
    a.finished("cancelled", None, 2.0, 2.0, prompt_tokens=7, output_tokens=0)
    b.running = 2
    b.finished("length", 0.2, 1.5, 0.1, prompt_tokens=30, output_tokens=16)
    pipe = r.pipeline()
    write_heartbeat(pipe, KEYS, _beat("w-a", "tiny", {"vllm": a.encode()}), Ttls())
    write_heartbeat(pipe, KEYS, _beat("w-b", "tiny", {"vllm": b.encode()}), Ttls())
    write_heartbeat(pipe, KEYS, _beat("w-old", "tiny", {"vllm": "{not json"}), Ttls())
    pipe.execute()
    try:
        with GatewayServer(GatewaySettings(redis_url=server.url)) as gateway:
            samples = _samples(gateway.url)
    finally:
        r.close()
    running = {e: _value(samples, "vllm:num_requests_running", model_name="tiny", engine=e)
               for e in ("w-a", "w-b", "w-old")}
    assert running == {"w-a": 3, "w-b": 2, "w-old": None}
    assert _value(samples, "vllm:kv_cache_usage_perc", model_name="tiny", engine="w-a") == 0.25
    assert _value(samples, "vllm:gpu_cache_usage_perc", model_name="tiny", engine="w-a") == 0.25
    assert _value(samples, "vllm:prompt_tokens_total", model_name="tiny", engine="w-a") == 18
    assert _value(samples, "vllm:prompt_tokens_total", model_name="tiny", engine="w-b") == 30
    assert _value(samples, "vllm:request_success_total", model_name="tiny", engine="w-a",
                  finished_reason="abort") == 1
    assert _value(samples, "vllm:request_success_total", model_name="tiny", engine="w-b",
                  finished_reason="length") == 1
    assert _value(samples, "vllm:e2e_request_latency_seconds_count", model_name="tiny",
                  engine="w-a") == 2
    assert _value(samples, "vllm:time_to_first_token_seconds_bucket", model_name="tiny",
                  engine="w-a", le="0.06") == 1
    assert _value(samples, "vllm:num_requests_waiting", model_name="tiny",
                  engine=QUEUE_ENGINE) == 0  # the first live worker's model
