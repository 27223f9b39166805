"""Tokenizer calls among tenants, through a real gateway, a real Redis and a real ``ferry
worker``: one tenant's flood of large ``/tokenize`` calls is capped (429s past its
``tokenizer_max_inflight``, a bounded number of its calls held in Redis) and does not hold
back another tenant's ``/tokenize`` calls and generations, which the worker serves in turn.
Only orders and counts are asserted, never times."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from gateway.settings import GatewaySettings
from gateway.tenancy.naming import secret_key
from gateway.tenancy.principal import key_principal
from gateway.tenancy.quotas import tokenizer_key
from protocol.keys import Keys
from protocol.tokenizer_queue import BELL
from tests.gateway.server import GatewayServer
from tests.redis_server import RedisServer
from tests.worker.service.procs import WorkerProcess
from worker.models import default_model_path

KA, KB = "k-flooder", "k-neighbour"
CAP = 3
FLOOD = 12  # tenant a's calls, each from a client of its own
LARGE = 300_000  # characters per flood call


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[str]:
    logs: Path = tmp_path_factory.mktemp("tokenizer-tenants")
    settings = GatewaySettings(redis_url=redis_server.url, api_keys=(KA, KB),
                               tokenizer_timeout_s=120.0, tokenizer_max_inflight=CAP,
                               max_queue_lag=None)
    with WorkerProcess(str(default_model_path()), redis_server.url, "tok-tenants", logs
                       ) as worker, GatewayServer(settings) as gateway:
        worker.wait_live()
        yield gateway.url


def _client(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=300, headers={"Authorization": f"Bearer {key}"})


class Flood:
    """Tenant a: ``FLOOD`` clients, each retrying its large call until it is answered."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answered = 0  # calls answered so far (+= under the lock)
        self.refused: list[dict[str, Any]] = []  # the 429s' error bodies
        self.lock = threading.Lock()
        words = ("ferry", "queue", "token", "tenant", "flood", "redis")
        self.texts = [" ".join(f"{words[(i + k) % 6]}{k % 89}" for k in range(LARGE // 7))
                      for i in range(FLOOD)]
        self.threads = [threading.Thread(target=self._one, args=(t,), daemon=True)
                        for t in self.texts]

    def _one(self, text: str) -> None:
        with _client(self.url, KA) as client:
            while True:
                reply = client.post("/tokenize", json={"prompt": text})
                if reply.status_code == 200:
                    with self.lock:
                        self.answered += 1
                    return
                assert reply.status_code == 429, reply.text
                with self.lock:
                    self.refused.append(reply.json()["error"])
                time.sleep(0.05)

    def start(self) -> Flood:
        for thread in self.threads:
            thread.start()
        return self

    def join(self) -> None:
        for thread in self.threads:
            thread.join(600)
        assert not any(t.is_alive() for t in self.threads), "the flood never drained"


class HeldInRedis(threading.Thread):
    """Samples how many tokenizer calls Redis holds (waiting on any list of the model: a's
    and at most one of b's) and how many of tenant a's count as in flight."""

    def __init__(self, url: str, inflight_key: str) -> None:
        super().__init__(daemon=True)
        self.r = redis.Redis.from_url(url)
        self.inflight_key = inflight_key
        self.most_held = 0
        self.most_inflight = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            held = 0
            for key in self.r.scan_iter("ferry:tokenizer:*"):
                if b":reply:" not in key and self.r.type(key) == b"list":
                    held += sum(x != BELL for x in self.r.lrange(key, 0, -1))
            self.most_held = max(self.most_held, held)
            self.most_inflight = max(self.most_inflight, self.r.zcard(self.inflight_key))
            self.stop.wait(0.05)


def _inflight_key(url: str, r: redis.Redis, api_key: str) -> str:
    """The ZSET of the tokenizer calls in flight of ``api_key``'s tenant (named by an HMAC
    of the key under the deployment's secret, which a first call makes the gateway write)."""
    with _client(url, api_key) as client:
        assert client.get("/v1/models").status_code == 200
    secret = r.get(secret_key(Keys()))
    assert secret is not None
    return tokenizer_key(Keys(), key_principal(api_key, secret))


def test_a_flood_is_capped_and_another_tenant_is_served_in_turn(
        stack: str, redis_server: RedisServer) -> None:
    r = redis.Redis.from_url(redis_server.url)
    inflight = _inflight_key(stack, r, KA)
    held = HeldInRedis(redis_server.url, inflight)
    held.start()
    flood = Flood(stack).start()
    while flood.answered < 1:  # under way: the worker is busy with a's calls
        time.sleep(0.01)
    waited: list[int] = []  # a's calls answered while each of b's waited
    with _client(stack, KB) as b:
        for i in range(4):
            before = flood.answered
            reply = b.post("/tokenize", json={"prompt": f"neighbour call {i}"})
            assert reply.status_code == 200, reply.text
            waited.append(flood.answered - before)
        completions = []
        for i in range(2):
            before = flood.answered
            completions.append(b.post("/v1/completions", json={
                "prompt": f"The neighbour asks {i}", "max_tokens": 8, "temperature": 0}))
            waited.append(flood.answered - before)
        b_done_at = flood.answered
    flood.join()
    held.stop.set()
    held.join(5)
    assert all(c.status_code == 200 for c in completions), [c.text for c in completions]
    # b's calls did not wait behind a's queue (first come, first served: behind all of it)
    assert b_done_at < FLOOD, (b_done_at, waited)
    assert max(waited[:4]) <= 2, waited
    # a's flood was capped: 429s naming the quota, and never more than CAP of its calls in
    # Redis (besides b's one)
    assert flood.refused, "no call of the flood was refused"
    assert {e["code"] for e in flood.refused} == {"quota_tokenizer_inflight"}
    assert held.most_held <= CAP + 1 and 0 < held.most_inflight <= CAP, (
        held.most_held, held.most_inflight)
    assert r.zcard(inflight) == 0  # every call gave its slot back
    for key in r.scan_iter("ferry:tokenizer:*"):
        assert r.ttl(key) > 0, key  # nothing without a TTL
