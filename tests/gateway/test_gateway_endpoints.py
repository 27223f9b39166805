"""Client-facing extras of the gateway, through a real uvicorn on a real Redis: CORS for
browsers, ``HEAD /health``, ``X-Request-Id``, ``GET /v1/models/{id}`` (the SDK's
``models.retrieve``) and the tokenizer routes' answers when no worker can answer them.
(A real worker answering them: tests/worker/service/sidecars/test_tokenizer_endpoints.py.)"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis

from gateway.main import settings_env
from gateway.settings import GatewaySettings
from protocol.keys import Keys
from protocol.models import WorkerHeartbeat
from protocol.store import Ttls, remove_heartbeat, write_heartbeat
from protocol.tokenizer_queue import ready_key
from tests.gateway.server import GatewayServer
from tests.redis_server import RedisServer

KEYS = Keys()
KEY = "k-endpoints"
AUTH = {"Authorization": f"Bearer {KEY}"}
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def gateway(redis_server: RedisServer) -> Iterator[GatewayServer]:
    settings = GatewaySettings(redis_url=redis_server.url, api_keys=(KEY,),
                               tokenizer_timeout_s=0.6)
    with GatewayServer(settings) as server:
        yield server


@pytest.fixture
def beat(redis_client: redis.Redis) -> Iterator[None]:
    """A live worker heartbeat for model ``org/tiny-model`` (a hub id, with its slash); no
    process behind it, so nothing answers its tokenizer requests."""
    now = time.time()
    heartbeat = WorkerHeartbeat(worker_id="silent-1", model="org/tiny-model",
                                started_at=now - 5, updated_at=now)
    pipe = redis_client.pipeline()
    write_heartbeat(pipe, KEYS, heartbeat, Ttls(heartbeat_s=30))
    pipe.execute()
    yield
    pipe = redis_client.pipeline()
    remove_heartbeat(pipe, KEYS, "silent-1")
    pipe.execute()


def _error(reply: httpx.Response) -> dict[str, object]:
    error: dict[str, object] = reply.json()["error"]
    return error


def test_models_retrieve_is_the_listed_card(gateway: GatewayServer, beat: None) -> None:
    sdk = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=KEY, max_retries=0)
    [listed] = sdk.models.list().data
    got = sdk.models.retrieve("org/tiny-model")
    assert got.model_dump() == listed.model_dump()
    assert got.id == "org/tiny-model" and got.object == "model" and got.owned_by == "ferry"
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.models.retrieve("no-such-model")
    assert caught.value.code == "model_not_found"
    assert httpx.get(f"{gateway.url}/v1/models/org/tiny-model").status_code == 401  # no key


def test_tokenize_without_a_live_worker_is_503(redis_server: RedisServer) -> None:
    settings = GatewaySettings(redis_url=redis_server.url, api_keys=(KEY,))
    with GatewayServer(settings) as gw:  # its own: no heartbeat cached from other tests
        for method, path, body in (("POST", "/tokenize", {"prompt": "hi"}),
                                   ("POST", "/detokenize", {"tokens": [1, 2]}),
                                   ("GET", "/tokenizer_info", None)):
            reply = httpx.request(method, gw.url + path, json=body, headers=AUTH)
            assert reply.status_code == 503, reply.text
            assert reply.headers["retry-after"] == "2"
            assert "no live worker" in str(_error(reply)["message"])
        assert httpx.post(f"{gw.url}/tokenize", json={"prompt": "hi"}).status_code == 401


def test_tokenize_nobody_answers_is_503_and_taken_back(
    gateway: GatewayServer, beat: None, redis_client: redis.Redis
) -> None:
    """A worker is live but its responder does not answer (here: none at all): 503 once
    tokenizer_timeout_s passed, and the request is off the list (no one runs it later)."""
    started = time.monotonic()
    reply = httpx.post(f"{gateway.url}/tokenize", json={"model": "org/tiny-model",
                                                        "prompt": "hi"}, headers=AUTH)
    assert reply.status_code == 503 and "retry-after" in reply.headers
    assert "answered within 0.6s" in str(_error(reply)["message"])
    assert time.monotonic() - started >= 0.6
    base = KEYS.tokenizer_requests("org/tiny-model")
    assert list(redis_client.scan_iter(base + ":q:*")) == []  # off its tenant's list
    assert redis_client.zcard(ready_key(base)) == 0


def test_tokenize_bad_bodies_name_the_field(gateway: GatewayServer, beat: None) -> None:
    """Checked before any worker is asked (none would answer here)."""
    cases = [
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
         "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "b"}],
                       "chat_template": "{{ x }}"}, "chat_template"),
        ("/tokenize", {"messages": [{"role": "user", "content": "b"}],
                       "add_generation_prompt": True, "continue_final_message": True},
         "continue_final_message"),
        ("/tokenize", {"prompt": "x" * 400_001}, "prompt"),
        ("/detokenize", {"tokens": [1, -3]}, "tokens"),
        ("/detokenize", {"tokens": "12"}, "tokens"),
        ("/detokenize", {"tokens": [True]}, "tokens.0"),
        ("/detokenize", {"tokens": list(range(32_769))}, "tokens"),
    ]
    for path, body, param in cases:
        reply = httpx.post(gateway.url + path, json=body, headers=AUTH)
        assert reply.status_code == 400, (body, reply.text)
        assert _error(reply)["param"] == param, (body, reply.text)
    reply = httpx.post(f"{gateway.url}/tokenize", json={"model": "nope", "prompt": "x"},
                       headers=AUTH)
    assert reply.status_code == 404 and _error(reply)["code"] == "model_not_found"


def test_head_health_follows_readiness(gateway: GatewayServer, redis_client: redis.Redis
                                       ) -> None:
    reply = httpx.head(f"{gateway.url}/health")
    assert reply.status_code == 503 and reply.content == b""
    now = time.time()
    pipe = redis_client.pipeline()
    write_heartbeat(pipe, KEYS, WorkerHeartbeat(worker_id="head-1", model="m",
                                                started_at=now, updated_at=now),
                    Ttls(heartbeat_s=30))
    pipe.execute()
    try:
        reply = httpx.head(f"{gateway.url}/health")
        assert reply.status_code == 200 and reply.content == b""
    finally:
        pipe = redis_client.pipeline()
        remove_heartbeat(pipe, KEYS, "head-1")
        pipe.execute()


def test_request_id_is_echoed_or_made(gateway: GatewayServer) -> None:
    sent = "client-req-42/a.b"
    reply = httpx.get(f"{gateway.url}/v1/models", headers={**AUTH, "X-Request-Id": sent})
    assert reply.status_code == 200 and reply.headers["x-request-id"] == sent
    made = httpx.get(f"{gateway.url}/healthz").headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made)
    assert httpx.get(f"{gateway.url}/healthz").headers["x-request-id"] != made
    # errors carry it too (401 before any route runs, 404)
    assert httpx.get(f"{gateway.url}/v1/models", headers={"X-Request-Id": sent}
                     ).headers["x-request-id"] == sent
    assert httpx.get(f"{gateway.url}/nowhere", headers={"X-Request-Id": sent}
                     ).headers["x-request-id"] == sent
    # unusable ids are replaced, never written back: too long, a space, a control char
    for bad in ("x" * 129, "two words", "tab\there"):
        got = httpx.get(f"{gateway.url}/healthz", headers={"X-Request-Id": bad})
        assert re.fullmatch(r"[0-9a-f]{32}", got.headers["x-request-id"]), bad
        assert got.headers.get_list("x-request-id") == [got.headers["x-request-id"]]


def test_cors_is_off_unless_origins_are_set(gateway: GatewayServer) -> None:
    preflight = httpx.options(f"{gateway.url}/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers
    plain = httpx.get(f"{gateway.url}/healthz", headers={"Origin": ORIGIN})
    assert "access-control-allow-origin" not in plain.headers


def test_cors_with_allowed_origins(redis_server: RedisServer) -> None:
    settings = GatewaySettings(redis_url=redis_server.url, api_keys=(KEY,),
                               allowed_origins=(ORIGIN,))
    with GatewayServer(settings) as gw:
        preflight = httpx.options(f"{gw.url}/v1/chat/completions", headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        # answered before the key check: a browser's preflight never carries the key
        assert preflight.status_code == 200, preflight.text
        assert preflight.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        listed = httpx.get(f"{gw.url}/v1/models", headers={**AUTH, "Origin": ORIGIN})
        assert listed.status_code == 200
        assert listed.headers["access-control-allow-origin"] == ORIGIN
        assert "x-request-id" in listed.headers["access-control-expose-headers"].lower()
        refused = httpx.get(f"{gw.url}/v1/models", headers={"Origin": ORIGIN})
        assert refused.status_code == 401  # the page still sees why
        assert refused.headers["access-control-allow-origin"] == ORIGIN
        other = httpx.options(f"{gw.url}/v1/models", headers={
            "Origin": "https://evil.example", "Access-Control-Request-Method": "GET"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    with GatewayServer(settings.model_copy(update={"allowed_origins": ("*",)})) as gw:
        reply = httpx.get(f"{gw.url}/healthz", headers={"Origin": "https://any.example"})
        assert reply.headers["access-control-allow-origin"] == "*"


def test_allowed_origins_from_env() -> None:
    env = {"FERRY_ALLOWED_ORIGINS": "https://a.example, http://localhost:3000,"}
    settings = GatewaySettings.from_env(env)
    assert settings.allowed_origins == ("https://a.example", "http://localhost:3000")
    assert GatewaySettings.from_env(settings_env(settings)) == settings  # --workers > 1
    assert GatewaySettings.from_env({}).allowed_origins == ()
