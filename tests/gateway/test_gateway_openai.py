"""OpenAI routes end to end: real uvicorn, real Redis, a scripted fake worker."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis

from gateway.settings import GatewaySettings
from protocol.codec import decode_cancel
from protocol.keys import Keys
from protocol.tenants import fair
from tests.gateway.server import GatewayServer
from tests.protocol.fake_worker import FakeWorker, Script
from tests.redis_server import RedisServer

KEYS = Keys()


@pytest.fixture(scope="module")
def gateway(redis_server: RedisServer) -> Iterator[GatewayServer]:
    settings = GatewaySettings(redis_url=redis_server.url, keepalive_s=0.5)
    with GatewayServer(settings) as server:
        yield server


@pytest.fixture
def worker(redis_server: RedisServer, redis_client: redis.Redis) -> Iterator[FakeWorker]:
    with FakeWorker(redis_server.url, Script(tokens=["Hel", "lo", "!"])) as fake:
        yield fake


def _sse_data(text: str) -> list[str]:
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def test_completion_non_stream(gateway: GatewayServer, worker: FakeWorker) -> None:
    body = {"model": "fake-model", "prompt": "Say hi", "max_tokens": 5, "temperature": 0,
            "stop": "\n", "top_k": 3, "priority": 2}
    reply = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=10)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    assert data["object"] == "text_completion" and data["choices"][0]["text"] == "Hello!"
    assert data["choices"][0]["finish_reason"] == "stop"
    assert data["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    sent = worker.seen[-1]
    assert sent.prompt == "Say hi" and sent.priority == 2 and sent.model == "fake-model"
    assert sent.params.max_tokens == 5 and sent.params.stop == ["\n"] and sent.params.top_k == 3


def test_chat_stream_sse_framing(gateway: GatewayServer, worker: FakeWorker) -> None:
    body = {"model": "fake-model", "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body,
                      timeout=10) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        text = reply.read().decode()
    data = _sse_data(text)
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert content == "Hello!"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 6
    assert worker.seen[-1].messages[0].content == "hi"  # type: ignore[index]


def test_openai_sdk_works(gateway: GatewayServer, worker: FakeWorker) -> None:
    sdk = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    chat = sdk.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=4
    )
    assert chat.choices[0].message.content == "Hello!"
    pieces = [c.choices[0].text for c in sdk.completions.create(
        model="fake-model", prompt=[1, 2, 3], stream=True) if c.choices]
    assert "".join(pieces) == "Hello!"
    assert worker.seen[-1].prompt_token_ids == [1, 2, 3]
    assert worker.seen[-2].params.max_tokens == 4


def test_worker_error_maps_to_http_status(
    gateway: GatewayServer, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    script = Script(tokens=[], finish_reason="error", error="chat template missing",
                    error_kind="invalid_request")
    with FakeWorker(redis_server.url, script):
        body = {"messages": [{"role": "user", "content": "hi"}]}
        reply = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=10)
        assert reply.status_code == 400
        assert reply.json()["error"]["message"] == "chat template missing"
        stream = httpx.post(f"{gateway.url}/v1/chat/completions",
                            json={**body, "stream": True}, timeout=10)
    # known before the first token: a 400 before the stream starts, not an in-band error
    assert stream.status_code == 400, stream.text
    assert stream.json()["error"]["message"] == "chat template missing"


def test_client_disconnect_publishes_cancel(
    gateway: GatewayServer, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    control = redis_client.pubsub()
    control.subscribe(KEYS.control)
    assert control.get_message(timeout=2)["type"] == "subscribe"
    with FakeWorker(redis_server.url, Script(tokens=["a", "b", "c"], hang_after=1)) as fake:
        body = {"prompt": "x", "stream": True, "request_id": "gone-1"}
        with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body,
                          timeout=10) as reply:
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    break  # first token arrived; hang up mid-generation
        message = control.get_message(timeout=5)
        while message is not None and message["type"] != "message":
            message = control.get_message(timeout=5)
        assert message is not None
        cancel = decode_cancel(message["data"])
        assert cancel.request_id == "gone-1" and "disconnect" in cancel.reason
        deadline = time.monotonic() + 5
        while (state := redis_client.hget(KEYS.job("gone-1"), "state")) != b"cancelled":
            assert time.monotonic() < deadline, state
            time.sleep(0.02)
        assert fake.seen[-1].request_id == "gone-1"
    control.close()


def test_non_stream_client_disconnect_cancels(
    gateway: GatewayServer, redis_client: redis.Redis
) -> None:
    # No worker: the request waits queued; the client gives up after 0.5 s.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gateway.url}/v1/completions", timeout=0.5,
                   json={"prompt": "x", "request_id": "impatient"})
    deadline = time.monotonic() + 5
    while redis_client.hget(KEYS.job("impatient"), "state") != b"cancelled":
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_models_and_metrics(gateway: GatewayServer, worker: FakeWorker) -> None:
    models = httpx.get(f"{gateway.url}/v1/models", timeout=5).json()
    assert [m["id"] for m in models["data"]] == ["fake-model"]
    httpx.post(f"{gateway.url}/v1/completions", json={"prompt": "x"}, timeout=10)
    text = httpx.get(f"{gateway.url}/metrics", timeout=5).text
    assert 'ferry_gateway_requests_total{method="POST",route="/v1/completions",status="200"}' \
        in text
    for name in ("ferry_gateway_inflight_streams", "ferry_gateway_time_to_first_token_seconds",
                 "ferry_gateway_request_latency_seconds", "ferry_gateway_enqueue_errors"):
        assert name in text


def test_more_open_streams_than_redis_pys_default_pool(
    gateway: GatewayServer, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """120 open streams, all waiting for a worker: none is refused (with a pub/sub
    connection per stream, redis-py's default pool of 100 answered 503 from ~64 on)."""
    import asyncio

    n = 120
    redis_client.delete(KEYS.requests, fair.bell(KEYS.requests))

    async def one(http: httpx.AsyncClient, i: int) -> str:
        body = {"prompt": f"p{i}", "max_tokens": 3, "stream": True, "request_id": f"many-{i}"}
        async with http.stream("POST", "/v1/completions", json=body) as reply:
            assert reply.status_code == 200, await reply.aread()
            text = "".join([line async for line in reply.aiter_lines()])
        return "".join(json.loads(d)["choices"][0]["text"] for d in _sse_data(
            text.replace("data: ", "\ndata: ")) if d.startswith("{"))

    async def run() -> list[str]:
        limits = httpx.Limits(max_connections=n + 8)
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60, limits=limits) as http:
            tasks = [asyncio.create_task(one(http, i)) for i in range(n)]
            while redis_client.xlen(fair.bell(KEYS.requests)) < n:  # subscribed and enqueued
                assert not any(t.done() for t in tasks), [t.result() for t in tasks if t.done()]
                await asyncio.sleep(0.05)
            with FakeWorker(redis_server.url, Script(tokens=["Hel", "lo", "!"])):
                return await asyncio.gather(*tasks)

    assert asyncio.run(run()) == ["Hello!"] * n
