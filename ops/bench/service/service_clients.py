"""The service benchmark's two clients: 64 concurrent streams, all opened at once.

* ``redis_streams``: ``protocol.aclient`` straight on Redis (subscribe, then enqueue), as
  a service with a Redis client would.
* ``http_streams``: OpenAI streaming completions through ``ferry gateway`` (SSE), as an
  HTTP user would.

Both record, per request, the wall-clock arrival of every event by ``seq`` (the HTTP
client counts text chunks: with the benchmark's word-level tokenizer each token carries
text, so the k-th chunk is event k), which the benchmark subtracts from the worker's
emit time to get the latency the service adds.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from ops.bench.engine.workload import Job
from protocol.aclient import AsyncFerryClient
from protocol.models import GenerateRequest
from protocol.sampling import SamplingParams


def requests_for(jobs: list[Job], tag: str) -> list[GenerateRequest]:
    return [GenerateRequest(request_id=f"{tag}-{i}", prompt_token_ids=j.prompt, params=
                            SamplingParams(temperature=0, max_tokens=j.max_tokens,
                                           ignore_eos=True)) for i, j in enumerate(jobs)]


async def redis_streams(url: str, prefix: str, requests: list[GenerateRequest]
                        ) -> dict[str, Any]:
    """Open every subscription, then enqueue all at once and time until the last event."""
    client = AsyncFerryClient.from_url(url, prefix=prefix)
    subs = [client.subscribe(r.request_id) for r in requests]
    for sub in subs:
        await sub.open()
    arrivals: dict[tuple[str, int], float] = {}

    async def follow(sub: Any, rid: str) -> None:
        while not sub.finished:
            for event in await sub.next_events(5.0):
                arrivals[(rid, event.seq)] = time.time()

    start = time.perf_counter()
    for r in requests:
        await client.enqueue(r)
    await asyncio.gather(*(follow(s, r.request_id) for s, r in zip(subs, requests, strict=True)))
    elapsed = time.perf_counter() - start
    for sub in subs:
        await sub.close()
    await client.aclose()
    return {"elapsed": elapsed, "arrivals": arrivals}


async def http_streams(base_url: str, requests: list[GenerateRequest]) -> dict[str, Any]:
    """POST every streaming completion at once; time until the last stream ends."""
    import httpx

    arrivals: dict[tuple[str, int], float] = {}
    limits = httpx.Limits(max_connections=len(requests) + 8)

    async def one(http: httpx.AsyncClient, req: GenerateRequest) -> None:
        body = {"prompt": req.prompt_token_ids, "max_tokens": req.params.max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "request_id": req.request_id}
        seq = 0
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"{req.request_id}: HTTP {resp.status_code}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                if json.loads(line[6:])["choices"][0].get("text"):
                    arrivals[(req.request_id, seq)] = time.time()
                    seq += 1

    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(one(http, r) for r in requests))
        elapsed = time.perf_counter() - start
    return {"elapsed": elapsed, "arrivals": arrivals}
