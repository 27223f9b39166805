"""Tool calls end to end with the official openai SDK: a real gateway, a real ``ferry
worker`` on the default model, a real Redis (docs/tools.md).

The default model was never taught tools, so every call it makes well-formed is the
grammar's doing: these tests check the enforcement, not the model.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from protocol.structured.tool_syntax import parse_calls, whole_arguments

WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
ADD: dict[str, Any] = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 100},
        "b": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _valid(calls: Any) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def test_required_and_named_calls_validate(openai_stack: Any) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        for seed in range(2):
            out = openai_stack.client.chat.completions.create(
                model="default", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=80)
            message = out.choices[0].message
            assert out.choices[0].finish_reason == "tool_calls", out
            calls = _valid(message.tool_calls)
            assert calls and message.content is None
            if isinstance(choice, dict):
                assert {name for name, _ in calls} == {"add"}


def test_parallel_calls_are_bounded(openai_stack: Any) -> None:
    """Parallel calls: at most MAX_CALLS (8) of them; cut by max_tokens, the complete
    ones are returned, then the one being written (its arguments as far as they got),
    with finish_reason length."""
    out = openai_stack.client.chat.completions.create(
        model="default", messages=MESSAGES, tools=TOOLS, tool_choice="required",
        temperature=1.0, seed=0, max_tokens=100)
    choice = out.choices[0]
    calls = choice.message.tool_calls or []
    assert choice.finish_reason in ("tool_calls", "length") and 1 <= len(calls) <= 8
    cut = choice.finish_reason == "length" and not whole_arguments(
        calls[-1].function.arguments)
    assert len(_valid(calls[:-1] if cut else calls)) == len(calls) - cut
    assert choice.message.content is None


def test_auto_is_text_or_valid_calls(openai_stack: Any) -> None:
    for seed in range(3):
        out = openai_stack.client.chat.completions.create(
            model="default", messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=seed,
            parallel_tool_calls=False, max_tokens=40)
        choice = out.choices[0]
        if choice.message.tool_calls:
            _valid(choice.message.tool_calls)
            assert choice.finish_reason == "tool_calls"
        else:
            assert "<tool_call>" not in (choice.message.content or "")


def test_streamed_calls_equal_the_whole_ones(openai_stack: Any) -> None:
    body: dict[str, Any] = dict(model="default", messages=MESSAGES, tools=TOOLS,
                                tool_choice="required", temperature=1.0, seed=7,
                                parallel_tool_calls=False, max_tokens=100)
    whole = openai_stack.client.chat.completions.create(**body)
    with openai_stack.client.chat.completions.stream(**body) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    got = final.choices[0]
    assert got.finish_reason == "tool_calls"
    assert _valid(got.message.tool_calls) == _valid(whole.choices[0].message.tool_calls)


def test_tools_with_response_format(openai_stack: Any) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 30},
                                               "sure": {"type": "boolean"}},
              "required": ["answer", "sure"], "additionalProperties": False}
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather",
                         "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"}]
    for seed in range(3):
        out = openai_stack.client.chat.completions.create(
            model="default", messages=history, tools=TOOLS, temperature=1.0, seed=seed,
            parallel_tool_calls=False, max_tokens=80, response_format={
                "type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
        message = out.choices[0].message
        if message.tool_calls:
            _valid(message.tool_calls)
        else:
            jsonschema.validate(json.loads(message.content or ""), schema)


class Weather(BaseModel):
    city: str
    unit: str


def test_parse_with_pydantic_function_tool(openai_stack: Any) -> None:
    out = openai_stack.client.chat.completions.parse(
        model="default", messages=MESSAGES, temperature=1.0, seed=1, max_tokens=60,
        tools=[openai.pydantic_function_tool(Weather, name="weather")], tool_choice="required",
        parallel_tool_calls=False)
    calls = out.choices[0].message.tool_calls or []
    assert calls and all(isinstance(c.function.parsed_arguments, Weather) for c in calls)


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "format": "weird"}}}}}],
      "tool_choice": "required"}, "tools.0.function.parameters"),
    ({"tools": [{"type": "code_interpreter", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_tools_are_400s(openai_stack: Any, body: dict[str, Any], param: str) -> None:
    reply = httpx.post(f"{openai_stack.url}/v1/chat/completions", timeout=30,
                       json={"messages": MESSAGES, "max_tokens": 5, **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text


def test_jobs_api_takes_tool_calls(openai_stack: Any) -> None:
    spec = {"tools": {"tools": [t["function"] for t in TOOLS], "mode": "required",
                      "parallel": False}}
    reply = httpx.post(f"{openai_stack.url}/v1/jobs", timeout=60, json={
        "messages": MESSAGES, "stream": False,
        "params": {"max_tokens": 80, "temperature": 1.0, "seed": 3,
                   "structured_output": spec}})
    assert reply.status_code == 202, reply.text
    job_id = reply.json()["id"]
    deadline = time.monotonic() + 60
    while (job := httpx.get(f"{openai_stack.url}/v1/jobs/{job_id}", timeout=10).json())[
            "state"] in ("queued", "running"):
        assert time.monotonic() < deadline, job
        time.sleep(0.2)
    assert job["state"] == "done", job
    text = job["text"]

    parsed = parse_calls(text, set(SCHEMAS))
    assert parsed is not None, text
    for name, args in parsed[1]:
        jsonschema.validate(json.loads(args), SCHEMAS[name])
