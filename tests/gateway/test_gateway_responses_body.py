"""``/v1/responses``' body, field by field (docs/tools.md): strictly typed (``tools: 5``,
``store: "yes"``, ``store: 1`` are 400s naming the field, as ``store: true`` is), the
chat route's errors under the Responses names, ``include`` logprobs honoured streamed and
not, ``reasoning`` and ``truncation`` honoured or refused by name; and no error body, from
any route, carries a traceback or a server path. Real uvicorn, real Redis, a scripted
fake worker, the openai SDK where it applies."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.gateway import openai_helpers as h
from tests.gateway.server import GatewayServer
from tests.protocol.fake_worker import FakeWorker, Script
from tests.redis_server import RedisServer

gateway = h.gateway
TOOL = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {
    "a": {"type": "string"}}}}


@pytest.fixture
def fake(redis_server: RedisServer) -> Iterator[FakeWorker]:
    with FakeWorker(redis_server.url, Script(tokens=["Sun", "ny"])) as worker:
        yield worker


@pytest.mark.parametrize("body,param", [
    ({"tools": 5}, "tools"),
    ({"tools": True}, "tools"),
    ({"tools": [5]}, "tools.0"),
    ({"tools": [{"type": "function", "name": "f", "parameters": 5}]}, "tools.0.parameters"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"store": "yes"}, "store"),
    ({"store": 1}, "store"),
    ({"store": True}, "store"),
    ({"metadata": {"k": 5}}, "metadata.k"),
    ({"text": 5}, "text"),
    ({"text": {"format": {"type": "json_schema", "schema": 5}}}, "text.format.schema"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
     "input.0.content.0.text"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input.0.role"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0"),
    ({"input": []}, "input"),
    ({"max_output_tokens": "5"}, "max_output_tokens"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"include": ["everything"]}, "include.0"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"truncation": "sometimes"}, "truncation"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "format": "weird"}}}}],
      "tool_choice": "required"}, "tools.0.parameters"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "string", "format": "weird"}}}}, "text.format.schema"),
    ({"tools": [TOOL], "tool_choice": {"type": "allowed_tools", "mode": "auto",
                                       "tools": [{"type": "function", "name": "g"}]}},
     "tool_choice.tools.0.name"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
])
def test_a_bad_field_is_a_400_naming_it(gateway: GatewayServer, body: dict[str, Any],
                                        param: str) -> None:
    reply = h.post(gateway, "/v1/responses", {"input": "x", **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"].startswith(param + ":"), error


def test_a_lone_surrogate_anywhere_is_a_400(gateway: GatewayServer) -> None:
    """Every field is echoed in the Response: one JSON cannot carry is refused by name."""
    reply = h.raw(gateway, "/v1/responses", '{"input": "x", "metadata": {"k": "\\ud800"}}')
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "metadata.k"


def test_harmless_values_are_accepted(gateway: GatewayServer, fake: FakeWorker) -> None:
    """What the Agents SDK and others send by default: ``include: []``, nulls, ``store:
    false``, ``truncation: "disabled"``, a reasoning effort of ``none``."""
    out = h.sdk(gateway).responses.create(
        model="fake-model", input="x", include=[], store=False, truncation="disabled",
        reasoning={"effort": "none", "summary": None}, metadata={"k": "v"},
        prompt_cache_key="k", max_tool_calls=3, service_tier="auto")
    assert out.status == "completed" and out.output_text == "Sunny"


def test_include_logprobs_are_returned(gateway: GatewayServer, fake: FakeWorker) -> None:
    client = h.sdk(gateway)
    out = client.responses.create(model="fake-model", input="x", top_logprobs=2,
                                  include=["message.output_text.logprobs"])
    [part] = out.output[0].content  # type: ignore[union-attr]
    logprobs = part.logprobs  # type: ignore[union-attr]
    assert [lp.token for lp in logprobs or []] == ["Sun", "ny"]
    assert all(len(lp.top_logprobs) == 2 for lp in logprobs or [])
    assert fake.seen[-1].params.logprobs == 2
    with client.responses.stream(model="fake-model", input="x",
                                 include=["message.output_text.logprobs"]) as stream:
        deltas = [e for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert [lp.token for d in deltas for lp in d.logprobs] == ["Sun", "ny"]
    [part] = final.output[0].content  # type: ignore[union-attr]
    assert [lp.token for lp in part.logprobs or []] == ["Sun", "ny"]  # type: ignore[union-attr]
    plain = client.responses.create(model="fake-model", input="x")
    assert plain.output[0].content[0].logprobs == []  # type: ignore[union-attr]
    assert fake.seen[-1].params.logprobs is None


TRACEBACK = ('RuntimeError: boom\nTraceback (most recent call last):\n  File '
             f'"{os.getcwd()}/worker/engine/engine.py", line 9, in step\n'
             'RuntimeError: boom')
PATHS = f"cannot open {os.getcwd()}/worker/x.json nor /etc/ferry/secret"


@pytest.mark.parametrize("error", [TRACEBACK, PATHS])
def test_no_error_body_carries_a_traceback_or_a_server_path(
        gateway: GatewayServer, fake: FakeWorker, error: str) -> None:
    """A worker's failure shown to a client, whole or streamed (in-band, after the
    first token), on every OpenAI route and the jobs API."""
    fake.script = Script(tokens=["a", "b"], finish_reason="error", error=error,
                         error_kind="internal")
    bodies = {"/v1/chat/completions": {"model": "fake-model", "messages": h.MESSAGES},
              "/v1/completions": {"model": "fake-model", "prompt": "x"},
              "/v1/responses": {"model": "fake-model", "input": "x"}}
    seen = []
    for path, body in bodies.items():
        reply = h.post(gateway, path, body)
        assert reply.status_code == 500, reply.text
        seen.append(reply.text)
        with httpx.stream("POST", gateway.url + path, json={**body, "stream": True},
                            timeout=15) as streamed:
            seen.append(streamed.read().decode())
    job = h.post(gateway, "/v1/jobs", {"prompt": "x", "stream": False}).json()["id"]
    for _ in range(100):  # the jobs API shows the job's error, and its events
        status = httpx.get(f"{gateway.url}/v1/jobs/{job}", timeout=15)
        if status.json()["state"] == "failed":
            break
        time.sleep(0.05)
    seen.append(status.text)
    seen.append(httpx.get(f"{gateway.url}/v1/jobs/{job}/events", timeout=15).text)
    assert "boom" in seen[-1] or "cannot open" in seen[-1]
    for text in seen:
        assert "Traceback" not in text and 'File "' not in text, text
        assert os.getcwd() not in text and "/etc/" not in text, text
    assert "RuntimeError: boom" in seen[0] or "cannot open <path>" in seen[0]


def test_sdk_sees_the_field(gateway: GatewayServer) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        h.sdk(gateway).responses.create(model="fake-model", input="x",
                                        tools=5)  # type: ignore[arg-type]
    assert caught.value.body["param"] == "tools"  # type: ignore[index]


def test_docs_name_every_field() -> None:
    from pathlib import Path

    from gateway.openai_api.responses_body import ResponsesRequest

    docs = (Path(__file__).resolve().parents[2] / "docs" / "tools.md").read_text()
    missing = [name for name in ResponsesRequest.model_fields if f"`{name}`" not in docs]
    assert not missing, missing
