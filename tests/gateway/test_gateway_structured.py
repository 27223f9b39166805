"""Structured output at the gateway: real uvicorn, real Redis, a scripted fake worker.

What each OpenAI / vLLM / jobs form turns into on the wire, and every bad input refused
with 400 naming the field before anything is enqueued.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import redis

from gateway.settings import GatewaySettings
from protocol.keys import Keys
from protocol.structured.constraint import StructuredOutput
from tests.gateway.server import GatewayServer
from tests.protocol.fake_worker import FakeWorker, Script
from tests.redis_server import RedisServer

KEYS = Keys()
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def gateway(redis_server: RedisServer) -> Iterator[GatewayServer]:
    with GatewayServer(GatewaySettings(redis_url=redis_server.url)) as server:
        yield server


@pytest.fixture
def worker(redis_server: RedisServer, redis_client: redis.Redis) -> Iterator[FakeWorker]:
    with FakeWorker(redis_server.url, Script(tokens=['{"n":', "1}"])) as fake:
        yield fake


def _sent(gateway: GatewayServer, worker: FakeWorker, path: str,
          body: dict[str, Any]) -> StructuredOutput | None:
    reply = httpx.post(f"{gateway.url}{path}", json=body, timeout=10)
    assert reply.status_code == 200, reply.text
    return worker.seen[-1].params.structured_output


@pytest.mark.parametrize("path,base", [
    ("/v1/chat/completions", {"messages": MESSAGES}),
    ("/v1/completions", {"prompt": "x"}),
])
def test_every_form_reaches_the_wire(gateway: GatewayServer, worker: FakeWorker, path: str,
                                     base: dict[str, Any]) -> None:
    json_schema = {"type": "json_schema",
                   "json_schema": {"name": "n", "schema": SCHEMA, "strict": True}}
    cases: list[tuple[dict[str, Any], dict[str, Any] | None]] = [
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        ({"response_format": json_schema}, {"json_schema": SCHEMA}),
        ({"response_format": {"type": "text"}}, None),
        ({"guided_json": SCHEMA}, {"json_schema": SCHEMA}),
        ({"guided_json": '{"type": "object"}'}, {"json_schema": {"type": "object"}}),
        ({"guided_regex": "[0-9]+"}, {"regex": "[0-9]+"}),
        ({"guided_choice": ["a", "b"]}, {"choice": ["a", "b"]}),
        ({"guided_grammar": 'root ::= "a" | "b"'}, {"grammar": 'root ::= "a" | "b"'}),
    ]
    for extra, expected in cases:
        got = _sent(gateway, worker, path, {**base, **extra, "max_tokens": 4})
        want = StructuredOutput.model_validate(expected) if expected is not None else None
        assert got == want, extra


def test_openai_sdk_response_format(gateway: GatewayServer, worker: FakeWorker) -> None:
    sdk = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    chat = sdk.chat.completions.create(
        model="fake-model", messages=MESSAGES,  # type: ignore[arg-type]
        response_format={"type": "json_schema",
                         "json_schema": {"name": "n", "schema": SCHEMA}})
    assert chat.choices[0].message.content == '{"n":1}'
    assert worker.seen[-1].params.structured_output == StructuredOutput(json_schema=SCHEMA)
    sdk.completions.create(model="fake-model", prompt="x",
                           extra_body={"guided_choice": ["yes", "no"]})
    assert worker.seen[-1].params.structured_output == StructuredOutput(choice=["yes", "no"])


def test_jobs_api_takes_params_structured_output(gateway: GatewayServer,
                                                 worker: FakeWorker) -> None:
    body = {"prompt": "x", "params": {"structured_output": {"regex": "[a-z]+"}}}
    reply = httpx.post(f"{gateway.url}/v1/jobs", json=body, timeout=10)
    assert reply.status_code == 202, reply.text
    rid = reply.json()["id"]
    status = httpx.get(f"{gateway.url}/v1/jobs/{rid}", timeout=10).json()
    for _ in range(50):
        if status["state"] == "done":
            break
        status = httpx.get(f"{gateway.url}/v1/jobs/{rid}", timeout=10).json()
    assert worker.seen[-1].params.structured_output == StructuredOutput(regex="[a-z]+")


BAD_OPENAI = [
    ({"response_format": {"type": "xml"}}, "response_format.type", "unknown type 'xml'"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "required"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema", "strin"),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}},
     "guided_json", "nope"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": "[1, 2]"}, "guided_json", "JSON Schema object"),
    ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ({"guided_regex": "(?=x)y"}, "guided_regex", "look-around"),
    ({"guided_choice": []}, "guided_choice", "at least 1"),
    ({"guided_grammar": 'root ::= "a" undefined'}, "guided_grammar", "undefined"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "only one"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "only one"),
]


@pytest.mark.parametrize("path,base", [
    ("/v1/chat/completions", {"messages": MESSAGES}),
    ("/v1/completions", {"prompt": "x"}),
])
@pytest.mark.parametrize("extra,param,words", BAD_OPENAI)
def test_bad_inputs_are_400_naming_the_field(
    gateway: GatewayServer, redis_client: redis.Redis, path: str, base: dict[str, Any],
    extra: dict[str, Any], param: str, words: str,
) -> None:
    before = redis_client.xlen(KEYS.requests) if redis_client.exists(KEYS.requests) else 0
    reply = httpx.post(f"{gateway.url}{path}", json={**base, **extra}, timeout=10)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: ")
    assert words in error["message"], error["message"]
    after = redis_client.xlen(KEYS.requests) if redis_client.exists(KEYS.requests) else 0
    assert after == before  # nothing enqueued


@pytest.mark.parametrize("spec,status,param", [
    ({"regex": "a(b"}, 400, "params.structured_output.regex"),
    ({"json_schema": {"type": "strin"}}, 400, "params.structured_output.json_schema"),
    ({"regex": "a", "choice": ["a"]}, 400, "params.structured_output"),
    ({"xml": "a"}, 400, "params.structured_output.xml"),
])
def test_jobs_api_bad_constraints(gateway: GatewayServer, spec: dict[str, Any], status: int,
                                  param: str) -> None:
    body = {"prompt": "x", "params": {"structured_output": spec}}
    reply = httpx.post(f"{gateway.url}/v1/jobs", json=body, timeout=10)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error
