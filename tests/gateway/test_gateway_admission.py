"""Admission control and error mapping: 429, 413, 400, 401, 404, 503, health endpoints."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from gateway.settings import GatewaySettings
from protocol.keys import Keys
from protocol.models import WorkerHeartbeat
from protocol.store import Ttls, write_heartbeat
from tests.gateway.server import GatewayServer
from tests.redis_server import RedisServer, free_port

KEYS = Keys()


@pytest.fixture(scope="module")
def gateway(redis_server: RedisServer) -> Iterator[GatewayServer]:
    settings = GatewaySettings(
        redis_url=redis_server.url, max_queue_lag=2, retry_after_s=7, max_body_bytes=4096,
        max_prompt_chars=100, max_prompt_tokens=10, max_tokens_limit=50, max_prompts=3,
        max_messages=3,
    )
    with GatewayServer(settings) as server:
        yield server


def _post(gw: GatewayServer, path: str, body: object, **kwargs: object) -> httpx.Response:
    return httpx.post(f"{gw.url}{path}", json=body, timeout=10, **kwargs)  # type: ignore[arg-type]


def _error(reply: httpx.Response) -> tuple[str, str | None]:
    err = reply.json()["error"]
    return err["message"], err["param"]


def test_queue_lag_over_limit_gives_429(gateway: GatewayServer, redis_client: redis.Redis) -> None:
    for i in range(2):  # no worker: these stay queued (jobs API returns at once)
        assert _post(gateway, "/v1/jobs", {"prompt": f"p{i}"}).status_code == 202
    reply = _post(gateway, "/v1/completions", {"prompt": "one too many"})
    assert reply.status_code == 429 and reply.headers["retry-after"] == "7"
    assert "queue is full" in _error(reply)[0]
    assert _post(gateway, "/v1/jobs", {"prompt": "x"}).status_code == 429


def test_body_too_large_gives_413(gateway: GatewayServer, redis_client: redis.Redis) -> None:
    big = {"prompt": "x" * 5000}
    assert _post(gateway, "/v1/completions", big).status_code == 413

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit applies while reading
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    reply = httpx.post(f"{gateway.url}/v1/completions", content=chunks(), timeout=10,
                       headers={"content-type": "application/json"})
    assert reply.status_code == 413 and "body" in _error(reply)[0]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 51}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "max_completion_tokens": 99}, "max_tokens"),
        ("/v1/completions", {"prompt": "x" * 101}, "prompt"),
        ("/v1/completions", {"prompt": list(range(11))}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 101}]},
         "messages"),
        ("/v1/completions", {"prompt": "x", "n": 17}, "n"),
        ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 17}, "best_of"),
        ("/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
        ("/v1/completions", {"prompt": "x", "best_of": 2, "stream": True}, "best_of"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 99},
         "n"),
        ("/v1/jobs", {"prompt": "x", "stream": False, "params": {"n": 17}}, "n"),
        ("/v1/completions", {"prompt": ["a", "b", "c", "d"]}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 4},
         "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "tools": [{"type": "function"}]}, "tools.0.function"),
        ("/v1/jobs", {"prompt": "x", "params": {"max_tokens": 51}}, "max_tokens"),
    ],
)
def test_over_caps_give_400_naming_the_field(
    gateway: GatewayServer, redis_client: redis.Redis, path: str, body: object, param: str
) -> None:
    reply = _post(gateway, path, body)
    assert reply.status_code == 400, reply.text
    message, got = _error(reply)
    assert got == param and message.startswith(f"{param}:"), message


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": "x", "temperature": 500}, "temperature"),
        ("/v1/completions", {"max_tokens": 3}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages.0.role"),
        ("/v1/jobs", {"prompt": "x", "params": {"top_p": 2}}, "params.top_p"),
        ("/v1/jobs", {"prompt": "x", "prompt_token_ids": [1]}, "prompt"),
        ("/v1/jobs", {"prompt": "x", "bogus": 1}, "bogus"),
        ("/v1/jobs", {"prompt_token_ids": [1, 2**70]}, "prompt_token_ids.1"),
    ],
)
def test_schema_errors_give_400_naming_the_field(
    gateway: GatewayServer, redis_client: redis.Redis, path: str, body: object, field: str
) -> None:
    reply = _post(gateway, path, body)
    assert reply.status_code == 400, reply.text
    assert _error(reply)[0].startswith(f"{field}:"), reply.text


def test_api_keys_give_401(redis_server: RedisServer, redis_client: redis.Redis) -> None:
    settings = GatewaySettings(redis_url=redis_server.url, api_keys=("k1", "k2"))
    with GatewayServer(settings) as gw:
        body = {"prompt": "x", "temperature": "hot"}  # 400 once past auth
        assert _post(gw, "/v1/completions", body).status_code == 401
        bad = _post(gw, "/v1/completions", body, headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401 and bad.headers["www-authenticate"] == "Bearer"
        good = _post(gw, "/v1/completions", body, headers={"Authorization": "Bearer k2"})
        assert good.status_code == 400
        assert httpx.get(f"{gw.url}/v1/models").status_code == 401
        assert httpx.get(f"{gw.url}/healthz").status_code == 200  # probes need no key


def test_dead_redis_gives_503(redis_client: redis.Redis) -> None:
    settings = GatewaySettings(redis_url=f"redis://127.0.0.1:{free_port()}/0",
                               redis_timeout_s=1.0)
    with GatewayServer(settings) as gw:
        reply = _post(gw, "/v1/completions", {"prompt": "x"})
        assert reply.status_code == 503 and "queue unavailable" in _error(reply)[0]
        assert "retry-after" in reply.headers
        assert _post(gw, "/v1/jobs", {"prompt": "x"}).status_code == 503
        assert httpx.get(f"{gw.url}/v1/jobs/abc").status_code == 503
        assert httpx.get(f"{gw.url}/healthz").status_code == 200
        assert httpx.get(f"{gw.url}/readyz").status_code == 503


def test_readyz_follows_worker_heartbeats(
    gateway: GatewayServer, redis_client: redis.Redis
) -> None:
    reply = httpx.get(f"{gateway.url}/readyz")
    assert reply.status_code == 503 and reply.json()["reason"] == "no live worker"
    beat = WorkerHeartbeat(worker_id="w1", model="m", started_at=time.time(),
                           updated_at=time.time())
    pipe = redis_client.pipeline()
    write_heartbeat(pipe, KEYS, beat, Ttls(heartbeat_s=30))
    pipe.execute()
    reply = httpx.get(f"{gateway.url}/readyz")
    assert reply.status_code == 200 and reply.json() == {"ready": True, "workers": 1}
    assert httpx.get(f"{gateway.url}/healthz").json() == {"status": "ok"}


def test_settings_from_env() -> None:
    env = {"FERRY_REDIS_URL": "redis://r:1/2", "FERRY_API_KEYS": "a, b,", "FERRY_PREFIX": "p",
           "FERRY_MAX_QUEUE_LAG": "none", "FERRY_MAX_TOKENS_LIMIT": "77"}
    settings = GatewaySettings.from_env(env, retry_after_s=3)
    assert settings.redis_url == "redis://r:1/2" and settings.api_keys == ("a", "b")
    assert settings.max_queue_lag is None and settings.max_tokens_limit == 77
    assert settings.retry_after_s == 3 and settings.keys.job("x") == "p:job:x"
    with pytest.raises(ValueError, match="max_body_bytes"):
        GatewaySettings.from_env({"FERRY_MAX_BODY_BYTES": "lots"})
