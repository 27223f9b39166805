"""Tenants see, follow and cancel only their own jobs; their request ids are their own.

A real gateway (``FERRY_API_KEYS=key-a,key-b``: each key its own tenant) over a real
redis-server; the fake worker speaks the real Redis contract (``tests/protocol``) so the
jobs end. Another tenant's job is 404 on every route, exactly like an unknown id.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
import redis

from gateway.settings import GatewaySettings
from gateway.tenancy.naming import secret_key
from gateway.tenancy.tenants import key_tenant_id
from protocol.keys import Keys
from protocol.tenants import fair
from protocol.tenants.ids import scoped_id
from tests.gateway.server import GatewayServer
from tests.protocol.fake_worker import FakeWorker, Script
from tests.redis_server import RedisServer

KEYS = Keys()
A, B = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
HANG = Script(tokens=["x", "y", "z"], hang_after=1)  # one token, then waits for a cancel


def _tenant(r: redis.Redis, api_key: str) -> str:
    """The tenant a FERRY_API_KEYS key got (named with the deployment's secret)."""
    secret = r.get(secret_key(KEYS))
    assert secret is not None, "no authenticated request has named the tenants yet"
    return key_tenant_id(api_key, secret)


@pytest.fixture(scope="module")
def gateway(redis_server: RedisServer) -> Iterator[GatewayServer]:
    settings = GatewaySettings(redis_url=redis_server.url, api_keys=("key-a", "key-b"),
                               keepalive_s=0.5)
    with GatewayServer(settings) as server:
        yield server


def _job(gw: GatewayServer, who: dict[str, str], rid: str, prompt: str) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/jobs", headers=who, json={
        "request_id": rid, "prompt": prompt, "params": {"max_tokens": 2}})


def test_another_tenants_job_is_not_found_on_every_route(
        gateway: GatewayServer, redis_client: redis.Redis) -> None:
    assert _job(gateway, A, "only-a", "a's secret").status_code == 202
    url = f"{gateway.url}/v1/jobs/only-a"
    for reply in (httpx.get(url, headers=B), httpx.get(url + "/events", headers=B),
                  httpx.delete(url, headers=B)):
        assert reply.status_code == 404, reply.text
        assert "a's secret" not in reply.text and reply.json()["error"]["param"] == "id"
    own = httpx.get(url, headers=A)  # still queued (no worker): nothing was cancelled
    assert own.status_code == 200 and own.json()["state"] == "queued"
    assert own.json()["id"] == own.json()["request_id"] == "only-a"
    # stored under a's namespace: the key names a's tenant, never the API key
    stored = scoped_id(_tenant(redis_client, "key-a"), "only-a")
    assert redis_client.hget(KEYS.job(stored), "state") == b"queued"
    assert not redis_client.exists(KEYS.job("only-a"))
    assert httpx.delete(url, headers=A).status_code == 202


def test_the_same_id_in_two_tenants_is_two_jobs(gateway: GatewayServer,
                                                 redis_server: RedisServer,
                                                 redis_client: redis.Redis) -> None:
    """b cannot pre-claim a's id: both get 202 and their own job; a reuse within one
    tenant is still 409."""
    assert _job(gateway, B, "shared-1", "from b").status_code == 202
    assert _job(gateway, A, "shared-1", "from a").status_code == 202
    again = _job(gateway, A, "shared-1", "from a again")
    assert again.status_code == 409 and again.json()["error"]["param"] == "request_id"
    assert again.json()["error"]["message"] == "request_id: 'shared-1' is already in use"
    with FakeWorker(redis_server.url, Script(tokens=["o", "k"])) as worker:
        for who in (A, B):
            reply = httpx.get(f"{gateway.url}/v1/jobs/shared-1/events", headers=who,
                              timeout=10)
            events = [json.loads(line[6:]) for line in reply.text.splitlines()
                      if line.startswith("data: ")]
            assert events[-1]["finish_reason"] == "stop"
            assert {e["request_id"] for e in events} == {"shared-1"}
    mine = [q for q in worker.seen if q.request_id.endswith("::shared-1")]
    assert sorted(q.prompt or "" for q in mine) == ["from a", "from b"]  # not "again"
    tenants = sorted(q.tenant or "" for q in mine)
    assert tenants == sorted([_tenant(redis_client, "key-a"), _tenant(redis_client, "key-b")])


def test_cancel_reaches_only_the_owners_running_job(gateway: GatewayServer,
                                                    redis_server: RedisServer) -> None:
    with FakeWorker(redis_server.url, HANG):
        assert _job(gateway, A, "run-a", "long").status_code == 202
        url = f"{gateway.url}/v1/jobs/run-a"
        for _ in range(200):
            if httpx.get(url, headers=A).json()["state"] == "running":
                break
        assert httpx.delete(url, headers=B).status_code == 404
        assert httpx.get(url, headers=A).json()["state"] == "running"
        assert httpx.delete(url, headers=A).status_code == 202


def test_openai_routes_use_the_callers_namespace(gateway: GatewayServer,
                                                 redis_server: RedisServer) -> None:
    body = {"model": "fake-model", "prompt": "p", "max_tokens": 2, "request_id": "c-1"}
    with FakeWorker(redis_server.url, Script(tokens=["h", "i"])):
        ra = httpx.post(f"{gateway.url}/v1/completions", headers=A, json=body, timeout=10)
        rb = httpx.post(f"{gateway.url}/v1/completions", headers=B, json=body, timeout=10)
    assert (ra.status_code, rb.status_code) == (200, 200), (ra.text, rb.text)
    assert ra.json()["id"] == rb.json()["id"] == "cmpl-c-1"
    assert ra.json()["choices"][0]["text"] == "hi"
    # the completion's job belongs to a alone
    assert httpx.get(f"{gateway.url}/v1/jobs/c-1", headers=A).status_code == 200
    assert httpx.get(f"{gateway.url}/v1/jobs/c-1", headers=B).status_code == 200  # b's own


def test_bad_keys_and_ids_are_refused_and_shared_routes_stay_shared(
        gateway: GatewayServer, redis_client: redis.Redis) -> None:
    assert httpx.get(f"{gateway.url}/v1/jobs/x").status_code == 401
    wrong = httpx.get(f"{gateway.url}/v1/jobs/x", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    scoped = _job(gateway, A, "evil::id", "x")  # the namespace separator
    assert scoped.status_code == 400 and scoped.json()["error"]["param"] == "request_id"
    other = _tenant(redis_client, "key-b") + "::only-b"  # naming b's namespace from a: not found
    assert httpx.get(f"{gateway.url}/v1/jobs/{other}", headers=A).status_code == 404
    assert httpx.get(f"{gateway.url}/healthz").status_code == 200
    for who in (A, B):
        assert httpx.get(f"{gateway.url}/v1/models", headers=who).status_code == 200


def test_a_batch_runs_as_its_owners_tenant(redis_server: RedisServer,
                                           redis_client: redis.Redis) -> None:
    """Batch lines are requests of the batch owner's tenant: its namespace, its weight (the
    batcher reads the same tenants); another tenant cannot see the batch."""
    from tests.gateway.test_batches_api import GOOD, line, stack, submit, wait

    with stack(redis_server, api_keys=("key-a", "key-b")) as (gateway, client), \
            FakeWorker(redis_server.url, Script(tokens=["o", "k"])) as worker:
        batch = submit(client, [line("c0", GOOD)])
        done = wait(client, batch.id)
        other = httpx.get(f"{gateway.url}/v1/batches/{batch.id}", headers=B)
    assert done.status == "completed" and other.status_code == 404
    [request] = [q for q in worker.seen if batch.id in q.request_id]
    owner = _tenant(redis_client, "key-a")
    assert request.tenant == owner and request.request_id.startswith(owner + "::")
    assert redis_client.hget(fair.weights(KEYS.requests_band("low")), owner) == b"1.0"
