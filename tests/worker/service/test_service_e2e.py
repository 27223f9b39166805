"""End to end: the official openai client -> gateway (uvicorn) -> Redis -> ``ferry worker``.

Every output is compared with the in-process engine running the same request alone, so
a token lost, duplicated, reordered or mixed up between concurrent streams fails a test.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import msgpack
import openai
import pytest
import redis

from gateway.settings import GatewaySettings
from protocol.client import FerryClient
from protocol.keys import Keys
from protocol.models import GenerateRequest
from protocol.sampling import SamplingParams
from tests.gateway.server import GatewayServer
from tests.worker.service.procs import WorkerProcess, assert_contiguous

KEYS = Keys()
LONG = SamplingParams(max_tokens=450, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def stack(redis_server: Any, checkpoint: str, tmp_path_factory: Any) -> Iterator[Any]:
    log_dir = tmp_path_factory.mktemp("logs")
    with WorkerProcess(checkpoint, redis_server.url, "e2e-1", log_dir) as worker:
        worker.wait_live()
        with GatewayServer(GatewaySettings(redis_url=redis_server.url)) as gateway:
            yield SimpleNamespace(worker=worker, gateway=gateway, redis_url=redis_server.url,
                                  url=gateway.url)


def _wait_idle(worker: WorkerProcess, timeout: float = 20.0) -> dict[str, Any]:
    """Poll heartbeats until nothing runs and every KV block is free again."""
    deadline = time.monotonic() + timeout
    stats: dict[str, Any] = {}
    while time.monotonic() < deadline:
        beat = worker.heartbeat()
        stats = dict(beat.stats) if beat else {}
        if stats and stats["running"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]:
            return stats
        time.sleep(0.1)
    raise AssertionError(f"worker did not free its blocks: {stats}")


def test_openai_completion_stream(stack: Any, reference: Any) -> None:
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused")
    chunks = client.completions.create(
        model="llama", prompt="def fibonacci(n):", max_tokens=16, temperature=0, stream=True
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    _ids, expected = reference.run("def fibonacci(n):", SamplingParams(max_tokens=16,
                                                                       temperature=0))
    assert text == expected


def test_openai_chat_stream(stack: Any, reference: Any) -> None:
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "The quick brown fox"}]
    chunks = client.chat.completions.create(
        model="llama", messages=messages, max_tokens=12, temperature=0, stream=True,  # type: ignore[arg-type]
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    _ids, expected = reference.run(None, SamplingParams(max_tokens=12, temperature=0),
                                   messages=messages)
    assert text == expected


def test_fifty_concurrent_streams_match_solo_runs(stack: Any, reference: Any) -> None:
    """Half greedy, half seeded sampling, varied lengths; each equals its solo run."""
    jobs = []
    for i in range(50):
        sampled = i % 2 == 1
        params = dict(max_tokens=8 + i % 13, temperature=0.9 if sampled else 0.0,
                      seed=1000 + i if sampled else None)
        jobs.append((f"Ferry serves language models {i}", params))

    async def run_all() -> list[str]:
        client = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused")

        async def one(prompt: str, params: dict[str, Any]) -> str:
            chunks = await client.completions.create(model="llama", prompt=prompt, stream=True,
                                                     **params)
            return "".join([c.choices[0].text async for c in chunks if c.choices])

        try:
            return await asyncio.gather(*(one(p, kw) for p, kw in jobs))
        finally:
            await client.close()

    texts = asyncio.run(run_all())
    for (prompt, params), text in zip(jobs, texts, strict=True):
        _ids, expected = reference.run(prompt, SamplingParams(**params))
        assert text == expected, prompt


def test_hand_written_msgpack_entry(stack: Any, reference: Any) -> None:
    """A producer in any language: XADD a map built from docs/protocol.md, read events."""
    r = redis.Redis.from_url(stack.redis_url)
    rid = "raw-" + uuid.uuid4().hex
    entry = {"version": 1, "request_id": rid, "prompt": "class Queue:",
             "params": {"max_tokens": 10, "temperature": 0.0}, "created_at": time.time()}
    pubsub = r.pubsub()
    pubsub.subscribe(f"ferry:tokens:{rid}")
    assert pubsub.get_message(timeout=5)["type"] == "subscribe"  # type: ignore[index]
    r.xadd("ferry:requests", {"data": msgpack.packb(entry, use_bin_type=True)})
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + 30
    while not (events and "finish_reason" in events[-1]) and time.monotonic() < deadline:
        msg = pubsub.get_message(timeout=1)
        if msg and msg["type"] == "message":
            events.append(msgpack.unpackb(msg["data"], raw=False))
    pubsub.close()
    assert [e["seq"] for e in events] == list(range(len(events)))
    ids, text = reference.run("class Queue:", SamplingParams(max_tokens=10, temperature=0))
    assert [t for e in events for t in e["token_ids"]] == ids
    assert "".join(e["text"] for e in events) == text
    final = events[-1]
    assert final["usage"]["completion_tokens"] == len(ids) and final["worker_id"] == "e2e-1"
    assert r.hget(f"ferry:job:{rid}", "state") == b"done"
    assert len(r.lrange(f"ferry:events:{rid}", 0, -1)) == len(events)
    r.close()


def test_cancel_mid_stream_frees_blocks(stack: Any) -> None:
    client = FerryClient.from_url(stack.redis_url)
    request = GenerateRequest(prompt="The quick brown fox", params=LONG)
    with client.subscribe(request.request_id) as sub:
        client.enqueue(request)
        events = []
        while len(events) < 3:
            events += sub.next_events(10)
        assert client.cancel(request.request_id, "enough") == "running"
        events += list(sub.events(timeout=10))
    client.close()
    assert_contiguous(events)
    assert events[-1].finish_reason == "cancelled" and events[-1].error == "enough"
    assert sum(len(e.token_ids) for e in events) < LONG.max_tokens
    _wait_idle(stack.worker)


def test_client_disconnect_cancels(stack: Any) -> None:
    rid = "disc-" + uuid.uuid4().hex
    body = {"model": "llama", "prompt": "The quick brown fox", "stream": True,
            "max_tokens": 450, "temperature": 0, "ignore_eos": True, "request_id": rid}
    with httpx.Client(base_url=stack.url, timeout=30) as http, \
            http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        seen = 0
        while seen < 3:
            seen += next(lines).startswith("data: ")
    r = redis.Redis.from_url(stack.redis_url)
    deadline = time.monotonic() + 20
    while r.hget(KEYS.job(rid), "state") != b"cancelled" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert r.hget(KEYS.job(rid), "state") == b"cancelled"
    r.close()
    _wait_idle(stack.worker)


def test_models_and_context_overflow(stack: Any) -> None:
    models = httpx.get(stack.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["llama"]
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 512") as e:
        client.completions.create(model="llama", prompt="fox " * 300, max_tokens=400)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
