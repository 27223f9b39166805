"""Structured output end to end: producers -> Redis -> a real ``ferry worker`` process.

A producer that bypasses the gateway (any Redis client, docs/protocol.md) can send a
grammar that does not compile: the worker must answer with an ``invalid_request`` error
event and keep serving. Through the gateway, constrained outputs hold on a random model
(the mask alone makes them valid).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import jsonschema
import msgpack
import openai
import pytest
import redis

from gateway.settings import GatewaySettings
from tests.gateway.server import GatewayServer
from tests.worker.service.procs import WorkerProcess

SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "color": {"enum": ["red", "green"]}}, "required": ["ok", "n", "color"],
    "additionalProperties": False}


@pytest.fixture(scope="module")
def stack(redis_server: Any, checkpoint: str, tmp_path_factory: Any) -> Iterator[Any]:
    log_dir = tmp_path_factory.mktemp("logs")
    with WorkerProcess(checkpoint, redis_server.url, "structured-1", log_dir) as worker:
        worker.wait_live()
        with GatewayServer(GatewaySettings(redis_url=redis_server.url)) as gateway:
            yield SimpleNamespace(worker=worker, redis_url=redis_server.url, url=gateway.url)


def _raw(redis_url: str, params: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """XADD a hand-built msgpack map, collect its events from pub/sub."""
    r = redis.Redis.from_url(redis_url)
    rid = "raw-" + uuid.uuid4().hex
    entry = {"version": 1, "request_id": rid, "prompt": "x = ", "params": params,
             "created_at": time.time()}
    pubsub = r.pubsub()
    pubsub.subscribe(f"ferry:tokens:{rid}")
    assert pubsub.get_message(timeout=5)["type"] == "subscribe"  # type: ignore[index]
    r.xadd("ferry:requests", {"data": msgpack.packb(entry, use_bin_type=True)})
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + 60
    while not (events and "finish_reason" in events[-1]) and time.monotonic() < deadline:
        msg = pubsub.get_message(timeout=1)
        if msg and msg["type"] == "message":
            events.append(msgpack.unpackb(msg["data"], raw=False))
    pubsub.close()
    r.close()
    return rid, events


@pytest.mark.parametrize("constraint,field", [
    ({"regex": "a(b"}, "regex"),
    ({"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/missing"}}}},
     "json_schema"),
    ({"grammar": 'root ::= "a" nowhere'}, "grammar"),
])
def test_uncompilable_grammar_is_an_invalid_request_event(
    stack: Any, constraint: dict[str, Any], field: str
) -> None:
    rid, events = _raw(stack.redis_url, {"max_tokens": 8, "structured_output": constraint})
    assert len(events) == 1, events
    final = events[0]
    assert final["finish_reason"] == "error" and final["error_kind"] == "invalid_request"
    assert final["error"].startswith(f"{field}:"), final["error"]
    r = redis.Redis.from_url(stack.redis_url)
    assert r.hget(f"ferry:job:{rid}", "state") == b"failed"
    r.close()
    assert stack.worker.proc.poll() is None  # still running


def test_raw_producer_gets_constrained_tokens(stack: Any) -> None:
    _rid, events = _raw(stack.redis_url, {
        "max_tokens": 40, "temperature": 1.0, "seed": 3,
        "structured_output": {"json_schema": SCHEMA}})
    assert events[-1]["finish_reason"] == "stop", events[-1]
    jsonschema.validate(json.loads("".join(e["text"] for e in events)), SCHEMA)


def test_openai_client_through_the_gateway(stack: Any) -> None:
    sdk = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    for seed in range(4):
        chat = sdk.chat.completions.create(
            model="llama", messages=[{"role": "user", "content": "a record"}], seed=seed,
            max_completion_tokens=40,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "rec", "schema": SCHEMA, "strict": True}})
        assert chat.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(chat.choices[0].message.content or ""), SCHEMA)
        done = sdk.completions.create(model="llama", prompt="x", seed=seed, max_tokens=8,
                                      extra_body={"guided_choice": ["yes", "no", "maybe"]})
        assert done.choices[0].text in ("yes", "no", "maybe")
        stream = sdk.completions.create(
            model="llama", prompt="x", seed=seed, max_tokens=12, stream=True,
            extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isalpha()
    with pytest.raises(openai.BadRequestError) as err:
        sdk.chat.completions.create(model="llama", messages=[{"role": "user", "content": "x"}],
                                    response_format={"type": "yaml"})  # type: ignore[arg-type, typeddict-item]
    assert err.value.status_code == 400 and "response_format.type" in str(err.value)
