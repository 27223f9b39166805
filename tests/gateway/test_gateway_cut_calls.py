"""A tool call cut short is a call, in every route and mode (docs/tools.md): against a
scripted fake worker (real uvicorn, real Redis, the openai SDK), an output cut by
``max_tokens`` inside a call comes back in ``tool_calls`` (``/v1/responses``: a
``function_call`` item, status ``incomplete``) with its arguments as far as they got,
streamed or not; call markup never reaches ``content``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.gateway import openai_helpers as h
from tests.gateway.server import GatewayServer
from tests.protocol.fake_worker import FakeWorker, Script
from tests.redis_server import RedisServer

gateway = h.gateway
TOOLS: Any = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    for name in ("get_weather", "get_time")]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
MESSAGES: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
CUTS = {  # script -> the calls read back: (name, arguments)
    "in the name": (['<tool_call>\n{"na', 'me":"get_wea'], [("get_weather", "")]),
    "in the arguments": (['<tool_call>\n{"name":"get_weather",', '"arguments":{"city":"Par'],
                         [("get_weather", '{"city":"Par')]),
    "in the opener": (["<tool_", "c"], [("", "")]),
    "after a call": ([CALL, '\n<tool_call>\n{"name":"get_time","arguments":{"ci'],
                     [("get_weather", '{"city":"Paris"}'), ("get_time", '{"ci')]),
}


@pytest.fixture
def fake(redis_server: RedisServer) -> Iterator[FakeWorker]:
    with FakeWorker(redis_server.url) as worker:
        yield worker


def _calls(message: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


@pytest.mark.parametrize("choice", ["required", "auto",
                                    {"type": "function", "function": {"name": "get_weather"}}])
@pytest.mark.parametrize("where", sorted(CUTS))
def test_a_cut_call_is_a_call_in_chat(gateway: GatewayServer, fake: FakeWorker,
                                      where: str, choice: Any) -> None:
    tokens, want = CUTS[where]
    if isinstance(choice, dict) and where == "in the opener":
        want = [("get_weather", "")]  # one function may be called: the call is its
    if isinstance(choice, dict) and where == "after a call":
        return  # a named function is the only one the grammar lets the model call
    fake.script = Script(tokens=tokens, finish_reason="length")
    client = h.sdk(gateway)
    body: dict[str, Any] = dict(model="fake-model", messages=MESSAGES, tools=TOOLS,
                                tool_choice=choice, max_tokens=9)
    whole = client.chat.completions.create(**body).choices[0]
    assert whole.finish_reason == "length"
    assert whole.message.content is None and _calls(whole.message) == want
    content, calls, finish = _streamed(gateway, {**body, "stream": True})
    assert content == "" and calls == want and finish == "length"


def _streamed(gw: GatewayServer, body: dict[str, Any]) -> tuple[str, list[Any], str]:
    """A stream's content, its calls reassembled as the SDK does (the SDK's helper raises
    on ``finish_reason: length``), and its finish reason."""
    content, calls, finish = "", {}, ""
    for chunk in h.raw_stream(gw, "/v1/chat/completions", body):
        choice = chunk["choices"][0]
        content += choice["delta"].get("content") or ""
        for call in choice["delta"].get("tool_calls") or []:
            name, args = calls.get(call["index"], ("", ""))
            function = call.get("function") or {}
            calls[call["index"]] = (name + function.get("name", ""),
                                    args + function.get("arguments", ""))
        finish = choice["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("where", ["in the name", "in the arguments"])
def test_a_cut_call_is_an_incomplete_item_in_responses(gateway: GatewayServer,
                                                       fake: FakeWorker, where: str) -> None:
    tokens, want = CUTS[where]
    fake.script = Script(tokens=tokens, finish_reason="length")
    client = h.sdk(gateway)
    body: dict[str, Any] = dict(model="fake-model", input="Weather?", tools=RESPONSES_TOOLS,
                                tool_choice="required", max_output_tokens=9)
    out = client.responses.create(**body)
    assert out.status == "incomplete" and [i.type for i in out.output] == ["function_call"]
    [item] = out.output
    assert (item.name, item.arguments, item.status) == (*want[0], "incomplete")
    with client.responses.stream(**body) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[-1] == "response.incomplete" and "response.output_text.delta" not in kinds
    [item] = events[-1].response.output  # type: ignore[union-attr]
    assert item.type == "function_call" and (item.name, item.arguments) == want[0]
    assert item.status == "incomplete"


def test_text_then_a_cut_call(gateway: GatewayServer, fake: FakeWorker) -> None:
    """``auto``: text before a call stays ``content``, the cut call is a call."""
    fake.script = Script(tokens=["Let me check.\n", '<tool_call>\n{"name":"get_time",'],
                         finish_reason="length")
    whole = h.sdk(gateway).chat.completions.create(
        model="fake-model", messages=MESSAGES, tools=TOOLS, max_tokens=9).choices[0]
    assert whole.message.content == "Let me check." and _calls(whole.message) == [
        ("get_time", "")]


def test_a_whole_answer_is_unchanged(gateway: GatewayServer, fake: FakeWorker) -> None:
    """Calls that completed, and text cut short, read as they did."""
    fake.script = Script(tokens=[CALL], finish_reason="stop")
    whole = h.sdk(gateway).chat.completions.create(
        model="fake-model", messages=MESSAGES, tools=TOOLS, tool_choice="required")
    assert whole.choices[0].finish_reason == "tool_calls"
    assert _calls(whole.choices[0].message) == [("get_weather", '{"city":"Paris"}')]
    fake.script = Script(tokens=["Sunny in ", "Par"], finish_reason="length")
    text = h.sdk(gateway).chat.completions.create(
        model="fake-model", messages=MESSAGES, tools=TOOLS, max_tokens=2).choices[0]
    assert text.message.content == "Sunny in Par" and not text.message.tool_calls
