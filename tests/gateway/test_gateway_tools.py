"""Tool fields on the wire and calls read back, against a scripted fake worker (real
uvicorn, real Redis, the openai SDK): what reaches the queue for each ``tool_choice``,
history turns, and the parsing of each family's output, whole and streamed, through chat
completions and ``/v1/responses`` (docs/tools.md). The grammar's enforcement on a real
model is ``tests/worker/service/test_service_tools.py``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.gateway import openai_helpers as h
from tests.gateway.server import GatewayServer
from tests.protocol.fake_worker import FakeWorker, Script
from tests.redis_server import RedisServer

gateway = h.gateway
sdk, post = h.sdk, h.post
TOOL: Any = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MESSAGES: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
CALLS = {
    "hermes": ['<tool_call>\n{"name":"get_weather",', '"arguments":{"city":"Paris"}}',
               '\n</tool_call>\n<tool_call>\n{"name":"get_weather","arguments":',
               '{"city":"Rome"}}\n</tool_call>'],
    "llama3_json": ['{"name":"get_weather","parameters":', '{"city":"Paris"}}; ',
                    '{"name":"get_weather","parameters":{"city":"Rome"}}'],
    "mistral": ['[TOOL_CALLS][{"name":"get_weather","arguments":{"city":"Paris"}}', ', ',
                '{"name":"get_weather","arguments":{"city":"Rome"}}]'],
}
WANT = [("get_weather", '{"city":"Paris"}'), ("get_weather", '{"city":"Rome"}')]


@pytest.fixture
def scripted(redis_server: RedisServer, request: Any) -> Iterator[FakeWorker]:
    with FakeWorker(redis_server.url, Script(tokens=request.param)) as fake:
        yield fake


def test_tool_choice_reaches_the_wire(gateway: GatewayServer, redis_server: RedisServer) -> None:
    with FakeWorker(redis_server.url, Script(tokens=["Hi"])) as worker:
        client = sdk(gateway)
        client.chat.completions.create(model="fake-model", messages=MESSAGES, tools=[TOOL])
        spec = worker.seen[-1].params.structured_output
        assert spec is not None and spec.tools is not None
        assert spec.tools.mode == "auto" and spec.tools.parallel and spec.tools.max_calls == 8
        client.chat.completions.create(
            model="fake-model", messages=MESSAGES, tools=[TOOL], parallel_tool_calls=False,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        spec = worker.seen[-1].params.structured_output
        assert spec is not None and spec.tools is not None
        assert (spec.tools.mode, spec.tools.name, spec.tools.parallel) == (
            "named", "get_weather", False)
        client.chat.completions.create(model="fake-model", messages=MESSAGES, tools=[TOOL],
                                       tool_choice="none")
        assert worker.seen[-1].params.structured_output is None
        client.chat.completions.create(
            model="fake-model", messages=MESSAGES, tools=[TOOL],
            response_format={"type": "json_object"})
        spec = worker.seen[-1].params.structured_output
        assert spec is not None and spec.tools is not None
        assert spec.tools.final_schema == {"type": "object"}


def test_history_turns_reach_the_wire(gateway: GatewayServer, redis_server: RedisServer) -> None:
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    with FakeWorker(redis_server.url, Script(tokens=["Sunny."])) as worker:
        sdk(gateway).chat.completions.create(model="fake-model", messages=history, tools=[TOOL])
        sent = worker.seen[-1].messages
        assert sent is not None and sent[1].tool_calls is not None
        assert sent[1].tool_calls[0].arguments == '{"city":"Paris"}'
        assert sent[2].role == "tool" and sent[2].tool_call_id == "call_1"


@pytest.mark.parametrize("scripted", list(CALLS.values()), ids=list(CALLS), indirect=True)
def test_calls_are_read_back_whole_and_streamed(gateway: GatewayServer,
                                                scripted: FakeWorker) -> None:
    client = sdk(gateway)
    body: dict[str, Any] = dict(model="fake-model", messages=MESSAGES, tools=[TOOL],
                                tool_choice="required")
    whole = client.chat.completions.create(**body).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    calls = whole.message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in calls] == WANT
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls)
    with client.chat.completions.stream(**body) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments)
            for c in final.message.tool_calls or []] == WANT
    out = client.responses.create(model="fake-model", input="Weather?", tools=[{
        "type": "function", "name": "get_weather", "parameters": TOOL["function"][
            "parameters"], "strict": False}], tool_choice="required")
    assert [(i.name, i.arguments) for i in out.output if i.type == "function_call"] == WANT


@pytest.mark.parametrize("scripted", [["Sunny", " in Paris."]], indirect=True)
def test_text_stays_text(gateway: GatewayServer, scripted: FakeWorker) -> None:
    client = sdk(gateway)
    whole = client.chat.completions.create(model="fake-model", messages=MESSAGES, tools=[TOOL])
    assert whole.choices[0].message.content == "Sunny in Paris."
    assert whole.choices[0].finish_reason == "stop" and not whole.choices[0].message.tool_calls
    deltas = [c.choices[0].delta.content for c in client.chat.completions.create(
        model="fake-model", messages=MESSAGES, tools=[TOOL], stream=True) if c.choices]
    assert "".join(d or "" for d in deltas) == "Sunny in Paris."
    events = [e.type for e in client.responses.create(model="fake-model", input="x", stream=True)]
    assert events[0] == "response.created" and events[-1] == "response.completed"
    assert "response.output_text.delta" in events


class _Served:
    async def resolve(self, name: str | None, tenant: object = None) -> str:
        return "m"

    async def route(self, name: str | None, tenant: object = None) -> object:
        from gateway.served.models import Route

        return Route("m", "m", "m")

    def tenant_of(self, owner: str) -> None:
        return None


def test_a_batch_line_with_tools_runs_as_the_route_does() -> None:
    """A Batch API line is a chat body: the same constraint goes on the wire, a bad schema
    is the route's 400 in the error file, and the result line carries tool_calls."""
    import asyncio

    from gateway.batcher.lines import BatchLine, LinePlan, finished_result, plan_line
    from gateway.settings import GatewaySettings
    from protocol.models import TokenEvent, Usage

    settings = GatewaySettings()
    body = {"messages": MESSAGES, "tools": [TOOL], "tool_choice": "required"}
    plan = asyncio.run(plan_line(BatchLine(0, "a", body), "batch_x", "/v1/chat/completions",
                                 settings, _Served()))  # type: ignore[arg-type]
    assert isinstance(plan, LinePlan)
    spec = plan.requests[0].params.structured_output
    assert spec is not None and spec.tools is not None and spec.tools.mode == "required"
    text = "".join(CALLS["hermes"])
    final = TokenEvent(request_id=plan.requests[0].request_id, seq=0, text=text,
                       finish_reason="stop", usage=Usage(prompt_tokens=3, completion_tokens=9,
                                                          total_tokens=12))
    result = json.loads(finished_result("batch_x", plan, [[final]]).line)
    choice = result["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert [(c["function"]["name"], c["function"]["arguments"])
            for c in choice["message"]["tool_calls"]] == WANT
    bad = {"messages": MESSAGES, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {
            "a": {"type": "string", "format": "weird"}}}}}], "tool_choice": "required"}
    refused = asyncio.run(plan_line(BatchLine(1, "b", bad), "batch_x", "/v1/chat/completions",
                                    settings, _Served()))  # type: ignore[arg-type]
    assert not isinstance(refused, LinePlan)
    error = json.loads(refused.line)["response"]["body"]["error"]
    assert error["param"] == "tools.0.function.parameters"
