"""Errors name the field (docs/protocol.md §8): every union-typed field of the request
bodies, given a value no branch takes, is a 400 whose ``param`` is the field, never a
pydantic branch (``stop.str``); a value of one branch's shape is named inside it
(``stop.0``); OpenAI's ``allowed_tools`` tool_choice works on chat and responses; and a
route this server does not serve is a 404 in OpenAI's shape that says so. Real uvicorn,
real Redis, a scripted fake worker, the openai SDK where it applies."""

from __future__ import annotations

import typing
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.field_errors import _members, _strip
from gateway.openai_api.responses_body import ResponsesRequest
from gateway.openai_api.schemas import ChatCompletionRequest, CompletionRequest
from gateway.settings import GatewaySettings
from tests.gateway import openai_helpers as h
from tests.gateway.server import GatewayServer
from tests.protocol.fake_worker import FakeWorker, Script
from tests.redis_server import RedisServer

gateway = h.gateway
M = [{"role": "user", "content": "hi"}]
NOTHING_FITS = 12.5  # a number: no union field of these bodies takes one
# (route, dotted field) -> a body with that field set to ``NOTHING_FITS``
UNIONS: dict[tuple[str, str], Any] = {
    ("chat", "stop"): lambda v: {"messages": M, "stop": v},
    ("chat", "tool_choice"): lambda v: {"messages": M, "tool_choice": v},
    ("chat", "guided_json"): lambda v: {"messages": M, "guided_json": v},
    ("chat", "structured_outputs.json"): lambda v: {"messages": M,
                                                    "structured_outputs": {"json": v}},
    ("chat", "messages.content"): lambda v: {"messages": [{"role": "user", "content": v}]},
    ("completions", "prompt"): lambda v: {"prompt": v},
    ("completions", "stop"): lambda v: {"prompt": "x", "stop": v},
    ("completions", "guided_json"): lambda v: {"prompt": "x", "guided_json": v},
    ("completions", "structured_outputs.json"): lambda v: {
        "prompt": "x", "structured_outputs": {"json": v}},
    ("responses", "input"): lambda v: {"input": v},
    ("responses", "input.content"): lambda v: {"input": [{"role": "user", "content": v}]},
    ("responses", "input.output"): lambda v: {"input": [
        {"type": "function_call_output", "call_id": "c", "output": v}]},
    ("responses", "instructions"): lambda v: {"input": "x", "instructions": v},
    ("responses", "tool_choice"): lambda v: {"input": "x", "tool_choice": v},
    ("responses", "conversation"): lambda v: {"input": "x", "conversation": v},
    ("responses", "text.format"): lambda v: {"input": "x", "text": {"format": v}},
}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
         "responses": "/v1/responses"}
MODELS = {"chat": ChatCompletionRequest, "completions": CompletionRequest,
          "responses": ResponsesRequest}


def _union_fields(model: Any, prefix: str = "", seen: frozenset[Any] = frozenset()
                  ) -> set[str]:
    """Every field of ``model`` (and the models inside it) whose type is a union."""
    found: set[str] = set()
    for name, info in model.model_fields.items():
        path = prefix + (info.alias or name)
        kind = _strip(info.annotation)
        if _members(kind) is not None:
            found.add(path)
        for inner in _models_in(kind):
            if inner not in seen:
                found |= _union_fields(inner, path + ".", seen | {model})
    return found


def _models_in(kind: Any) -> list[Any]:
    kind = _strip(kind)
    if isinstance(kind, type) and hasattr(kind, "model_fields"):
        return [kind]
    return [m for arg in typing.get_args(kind) for m in _models_in(arg)]


def test_every_union_field_is_listed() -> None:
    for route, model in MODELS.items():
        assert _union_fields(model) == {f for r, f in UNIONS if r == route}, route


@pytest.mark.parametrize("route,field", sorted(UNIONS))
def test_a_union_field_is_named(gateway: GatewayServer, route: str, field: str) -> None:
    reply = h.post(gateway, PATHS[route], UNIONS[route, field](NOTHING_FITS))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    want = field.replace("messages.", "messages.0.").replace("input.", "input.0.")
    assert error["param"] == want and error["message"].startswith(f"{want}: expected "), error


@pytest.mark.parametrize("body,param", [
    ({"messages": M, "stop": [1]}, "stop.0"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages.0.content.0.text"),
    ({"messages": M, "tool_choice": {"type": "function", "function": {"name": 5}}},
     "tool_choice.function.name"),
    ({"messages": M, "tool_choice": {"type": "allowed_tools", "allowed_tools": {
        "mode": "sometimes", "tools": [{"type": "function", "function": {"name": "f"}}]}}},
     "tool_choice.allowed_tools.mode"),
    ({"messages": M, "tool_choice": {"type": "custom", "name": "f"}}, "tool_choice"),
])
def test_a_value_of_one_branchs_shape_is_named_inside_it(
        gateway: GatewayServer, body: dict[str, Any], param: str) -> None:
    reply = h.post(gateway, "/v1/chat/completions", body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


@pytest.fixture
def fake(redis_server: RedisServer) -> Iterator[FakeWorker]:
    with FakeWorker(redis_server.url, Script(tokens=["ok"])) as worker:
        yield worker


TOOLS: Any = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
              for n in ("get_weather", "get_time", "add")]


def test_allowed_tools_reach_the_wire(gateway: GatewayServer, fake: FakeWorker) -> None:
    """pydantic-ai sends ``allowed_tools`` whenever it offers two tools or more."""
    client = h.sdk(gateway)
    client.chat.completions.create(
        model="fake-model", messages=M, tools=TOOLS, tool_choice={
            "type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
                {"type": "function", "function": {"name": "get_time"}},
                {"type": "function", "function": {"name": "add"}}]}})
    spec = fake.seen[-1].params.structured_output
    assert spec is not None and spec.tools is not None
    assert (spec.tools.mode, spec.tools.allowed) == ("required", ["get_time", "add"])
    assert len(spec.tools.tools) == 3  # every tool is still rendered
    client.responses.create(
        model="fake-model", input="x", tools=[{"type": "function", **t["function"]}
                                              for t in TOOLS],
        tool_choice={"type": "allowed_tools", "mode": "auto",
                     "tools": [{"type": "function", "name": "add"}]})
    spec = fake.seen[-1].params.structured_output
    assert spec is not None and spec.tools is not None
    assert (spec.tools.mode, spec.tools.allowed) == ("auto", ["add"])
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="fake-model", messages=M, tools=TOOLS, tool_choice={
                "type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
                    {"type": "function", "function": {"name": "nope"}}]}})
    assert caught.value.body["param"] == (  # type: ignore[index]
        "tool_choice.allowed_tools.tools.0.function.name")


UNSERVED = ["/v1/embeddings", "/pooling", "/score", "/rerank", "/v1/rerank", "/v1/score",
            "/v1/audio/transcriptions", "/sleep", "/wake_up", "/v2/rerank", "/nope/at/all"]


@pytest.mark.parametrize("path", UNSERVED)
def test_unserved_routes_say_so(gateway: GatewayServer, path: str) -> None:
    for method in ("GET", "POST"):
        reply = httpx.request(method, gateway.url + path, json={"input": "x"}, timeout=15)
        assert reply.status_code == 404, reply.text
        error = reply.json()["error"]
        assert error["message"] == f"{method} {path}: not supported by this server"
        assert error["type"] == "invalid_request_error" and error["code"] == "not_supported"


def test_unserved_routes_with_the_sdk_and_api_keys(redis_server: RedisServer) -> None:
    settings = GatewaySettings(redis_url=redis_server.url, api_keys=("key-a",))
    with GatewayServer(settings) as gw:
        assert httpx.post(f"{gw.url}/v1/embeddings", json={}).status_code == 401  # key first
        with pytest.raises(openai.NotFoundError) as caught:
            h.sdk(gw, "key-a").embeddings.create(model="m", input="x")
        assert "/v1/embeddings: not supported by this server" in str(caught.value)
        chat = httpx.get(f"{gw.url}/v1/chat/completions", headers={
            "Authorization": "Bearer key-a"})
        assert chat.status_code == 405  # a served route's other methods: as they were
