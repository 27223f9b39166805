"""Agent frameworks against a real gateway + ``ferry worker`` (default model) + Redis:
``/v1/responses`` with the openai SDK's ``client.responses``, the OpenAI Agents SDK (a
two-tool agent with an ``output_type``) and LangChain's ``bind_tools`` /
``with_structured_output(method="function_calling")`` (docs/tools.md)."""

from __future__ import annotations

import json
from typing import Annotated, Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city.",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 20}}, "required": ["city"],
               "additionalProperties": False}, "strict": True}
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 30}},
          "required": ["answer"], "additionalProperties": False}


def test_responses_text_and_usage(openai_stack: Any) -> None:
    out = openai_stack.client.responses.create(model="default", input="Say hi.",
                                               instructions="Be brief.", max_output_tokens=8)
    assert out.object == "response" and out.status in ("completed", "incomplete")
    assert out.output[0].type == "message" and out.output_text
    assert out.usage is not None and out.usage.output_tokens > 0


def test_responses_tool_round_trip(openai_stack: Any) -> None:
    first = openai_stack.client.responses.create(
        model="default", input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=60, temperature=1.0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    second = openai_stack.client.responses.create(
        model="default", tools=[WEATHER], max_output_tokens=40, temperature=1.0,
        parallel_tool_calls=False, text={"format": {
            "type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}},
        input=[{"role": "user", "content": "Weather in Paris?"}, calls[0].model_dump(),
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "sunny"}])
    for item in second.output:
        if item.type == "function_call":
            jsonschema.validate(json.loads(item.arguments), WEATHER["parameters"])
        else:
            jsonschema.validate(json.loads(second.output_text), ANSWER)


def test_responses_streaming(openai_stack: Any) -> None:
    kinds = []
    with openai_stack.client.responses.stream(
            model="default", input="Weather in Paris?", tools=[WEATHER],
            tool_choice="required", parallel_tool_calls=False, max_output_tokens=60) as s:
        for event in s:
            kinds.append(event.type)
        final = s.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds
    call = next(item for item in final.output if item.type == "function_call")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_responses_refuses_store(openai_stack: Any) -> None:
    reply = httpx.post(f"{openai_stack.url}/v1/responses", timeout=30,
                       json={"input": "x", "store": True})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "store"
    reply = httpx.post(f"{openai_stack.url}/v1/responses", timeout=30,
                       json={"input": "x", "previous_response_id": "resp_1"})
    assert reply.json()["error"]["param"] == "previous_response_id"


class Answer(BaseModel):
    answer: str = Field(max_length=20)


def test_agents_sdk_two_tools_and_output_type(openai_stack: Any) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
        """The weather in a city."""
        return "sunny"

    @agents.function_tool
    def add(a: Annotated[int, Field(ge=0, le=99)], b: Annotated[int, Field(ge=0, le=99)]) -> int:
        """Add two integers."""
        return a + b

    client = openai.AsyncOpenAI(base_url=f"{openai_stack.url}/v1", api_key="x", max_retries=0)
    agent = agents.Agent(
        name="helper", instructions="Use the tools, then answer.",
        tools=[get_weather, add], output_type=Answer,
        model=agents.OpenAIResponsesModel(model="default", openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", temperature=1.0,
                                            max_tokens=150, parallel_tool_calls=False))
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=12)
    assert isinstance(result.final_output, Answer)
    assert any(getattr(i, "type", "") == "tool_call_item" for i in result.new_items)


class Weather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=12)


def test_langchain_bind_tools_and_structured_output(openai_stack: Any) -> None:
    lc = pytest.importorskip("langchain_openai")
    model = lc.ChatOpenAI(base_url=f"{openai_stack.url}/v1", api_key="x", model="default",
                          temperature=1.0, max_tokens=150, max_retries=0, seed=3)
    reply = model.bind_tools([Weather], tool_choice="required",
                             parallel_tool_calls=False).invoke("Weather in Paris?")
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "Weather"
    assert isinstance(reply.tool_calls[0]["args"]["city"], str)
    got = model.with_structured_output(Weather, method="function_calling",
                                       include_raw=True).invoke("Weather in Paris?")
    assert isinstance(got["parsed"], Weather), got


class City(BaseModel):
    """The weather in a city, for some days."""

    city: str = Field(max_length=12)
    days: int = Field(ge=1, le=7)


def _without_closed(node: Any) -> Any:
    """What LiteLLM's ``hosted_vllm/`` provider sends: every ``additionalProperties:
    false`` and ``strict`` deleted."""
    if isinstance(node, dict):
        return {k: _without_closed(v) for k, v in node.items()
                if k != "strict" and not (k == "additionalProperties" and v is False)}
    return [_without_closed(v) for v in node] if isinstance(node, list) else node


def _open_tools() -> dict[str, Any]:
    from langchain_core.utils.function_calling import convert_to_openai_tool

    return {
        "langchain bind_tools": convert_to_openai_tool(City),
        "litellm hosted_vllm": _without_closed(openai.pydantic_function_tool(City)),
        "pydantic model_json_schema": {"type": "function", "function": {
            "name": "City", "description": "The weather.",
            "parameters": City.model_json_schema()}},
    }


def test_open_schemas_give_exactly_the_declared_keys(openai_stack: Any) -> None:
    """Tools sent with open object schemas are closed as vLLM's default backend closes
    them: 20 seeds per client shape, every call has exactly the declared keys."""
    from concurrent.futures import ThreadPoolExecutor

    tools = _open_tools()
    assert all("additionalProperties" not in t["function"]["parameters"]
               for t in tools.values())

    def keys(job: tuple[str, int]) -> tuple[str, int, Any]:
        shape, seed = job
        out = openai_stack.client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[tools[shape]], tool_choice="required", parallel_tool_calls=False,
            temperature=1.0, seed=seed, max_tokens=80)
        choice = out.choices[0]
        got = [sorted(json.loads(c.function.arguments)) for c in choice.message.tool_calls
               or []] if choice.finish_reason == "tool_calls" else choice
        return shape, seed, got

    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(keys, [(s, seed) for s in tools for seed in range(20)]))
    bad = [r for r in results if r[2] != [["city", "days"]]]
    assert not bad, bad


def test_a_cut_call_is_a_call(openai_stack: Any) -> None:
    """max_tokens cuts the first call under tool_choice required: a call, not text."""
    out = openai_stack.client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[openai.pydantic_function_tool(City)], tool_choice="required", max_tokens=12)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.function.name == "City" and call.id.startswith("call_")
    reply = openai_stack.client.responses.create(
        model="default", input="Weather in Paris?", max_output_tokens=12,
        tools=[{"type": "function", "name": "City", "parameters": City.model_json_schema()}],
        tool_choice="required")
    assert reply.status == "incomplete" and [i.type for i in reply.output] == [
        "function_call"]
    assert reply.output[0].status == "incomplete"  # type: ignore[union-attr]
