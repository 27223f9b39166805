"""The HTTP contract clients rely on: OpenAI's 400 error shape, lone surrogates refused,
one model name everywhere with 404 for others, logit_bias carried, unsupported fields
refused instead of ignored. Real uvicorn, real Redis, the scripted fake worker."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
import redis

from gateway.settings import GatewaySettings
from protocol.keys import Keys
from tests.gateway.server import GatewayServer
from tests.protocol.fake_worker import FakeWorker, Script
from tests.redis_server import RedisServer

KEYS = Keys()
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def gateway(redis_server: RedisServer) -> Iterator[GatewayServer]:
    with GatewayServer(GatewaySettings(redis_url=redis_server.url)) as server:
        yield server


@pytest.fixture
def worker(redis_server: RedisServer, redis_client: redis.Redis) -> Iterator[FakeWorker]:
    with FakeWorker(redis_server.url, Script(tokens=["Hel", "lo"]), model="coder-1") as fake:
        yield fake


def _post(gw: GatewayServer, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{gw.url}{path}", json=body, timeout=10)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": "a\udfffb"}]}, "messages.0.content"),
    ("/v1/completions", {"prompt": "x", "stop": ["ok", "\ud800"]}, "params.stop.1"),
    ("/v1/jobs", {"prompt": "\ud800"}, "prompt"),
])
def test_lone_surrogates_are_400_naming_the_field(
    gateway: GatewayServer, redis_client: redis.Redis, path: str, body: object, param: str
) -> None:
    # httpx would refuse to encode a lone surrogate: send the JSON escape itself.
    import json

    raw = json.dumps(body, ensure_ascii=True)
    reply = httpx.post(f"{gateway.url}{path}", content=raw, timeout=10,
                       headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["message"].startswith(f"{param}:"), error
    assert redis_client.xlen(KEYS.requests) == 0


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    (CHAT, {"messages": [{"content": "x"}]}, "messages.0.role"),
    ("/v1/jobs", {"prompt": "x", "bogus": 1}, "bogus"),
])
def test_validation_errors_are_openai_400s(
    gateway: GatewayServer, redis_client: redis.Redis, path: str, body: object, param: str
) -> None:
    reply = _post(gateway, path, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert isinstance(error["code"], str)


def test_the_sdk_raises_bad_request_for_invalid_input(gateway: GatewayServer) -> None:
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="coder-1", prompt="x", temperature=500)  # type: ignore[arg-type]


def test_one_model_name_everywhere_and_404_for_others(
    gateway: GatewayServer, worker: FakeWorker
) -> None:
    listed = httpx.get(f"{gateway.url}/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in listed] == ["coder-1"]
    plain = _post(gateway, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert plain.status_code == 200 and plain.json()["model"] == "coder-1"
    named = _post(gateway, CHAT, {"model": "coder-1", "messages": MESSAGES})
    assert named.status_code == 200 and named.json()["model"] == "coder-1"
    for path, body in (("/v1/completions", {"prompt": "x", "model": "gpt-4o"}),
                       (CHAT, {"messages": MESSAGES, "model": "gpt-4o"}),
                       ("/v1/jobs", {"prompt": "x", "model": "gpt-4o"})):
        reply = _post(gateway, path, body)
        assert reply.status_code == 404, reply.text
        error = reply.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="x")


def test_configured_served_model_name(redis_server: RedisServer, redis_client: redis.Redis) -> None:
    """``FERRY_SERVED_MODEL_NAME`` names the model even before any worker is live."""
    settings = GatewaySettings(redis_url=redis_server.url, served_model_name="prod-llm")
    with GatewayServer(settings) as gw:
        listed = httpx.get(f"{gw.url}/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in listed] == ["prod-llm"]
        reply = _post(gw, "/v1/jobs", {"prompt": "x", "model": "other"})
        assert reply.status_code == 404
        assert _post(gw, "/v1/jobs", {"prompt": "x", "model": "prod-llm"}).status_code == 202


def test_logit_bias_reaches_the_wire(gateway: GatewayServer, worker: FakeWorker) -> None:
    reply = _post(gateway, "/v1/completions",
                  {"prompt": "x", "max_tokens": 2, "logit_bias": {"17": -100, "3": 5.5}})
    assert reply.status_code == 200, reply.text
    assert worker.seen[-1].params.logit_bias == {17: -100.0, 3: 5.5}
    bad = _post(gateway, "/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logit_bias"
    far = _post(gateway, "/v1/completions", {"prompt": "x", "logit_bias": {"3": 101}})
    assert far.status_code == 400 and far.json()["error"]["param"] == "logit_bias"


@pytest.mark.parametrize(("field", "value"), [
    ("functions", [{"name": "f", "parameters": {}}]),
    ("function_call", "auto"),
    ("tool_choice", "required"),
    ("tool_choice", {"type": "function", "function": {"name": "f"}}),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}),
])
def test_unsupported_chat_fields_are_refused(
    gateway: GatewayServer, redis_client: redis.Redis, field: str, value: object
) -> None:
    reply = _post(gateway, CHAT, {"messages": MESSAGES, field: value})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field
    assert redis_client.xlen(KEYS.requests) == 0


def test_harmless_chat_fields_are_accepted(gateway: GatewayServer, worker: FakeWorker) -> None:
    body = {"messages": MESSAGES, "tool_choice": "none", "user": "u1", "store": False,
            "metadata": {"team": "a"}, "modalities": ["text"], "parallel_tool_calls": True}
    assert _post(gateway, CHAT, body).status_code == 200
