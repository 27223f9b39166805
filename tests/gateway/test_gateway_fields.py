"""Every OpenAI / vLLM field honoured or refused (issue 19, items 4, 9, 10), against a
scripted fake worker: vLLM's ``structured_outputs`` reach the wire, each refused field
is a 400 naming it, ``continuous_usage_stats`` puts usage on every chunk, lone surrogates
in keys and ``$ref`` cycles are 400s, chat echo and token ids as text, and both docs name
every field.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from gateway.openai_api.fields import IGNORED, REFUSED_UNLESS, ROUTE_ONLY
from gateway.openai_api.schemas import ChatCompletionRequest
from tests.gateway import openai_helpers as h
from tests.gateway.server import GatewayServer
from tests.protocol.fake_worker import FakeWorker

# -- 4: structured_outputs honoured, nothing output-changing silently ignored ---------------

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.mark.parametrize("structured,kind", [
    ({"json": SCHEMA}, "json_schema"),
    ({"json": json.dumps(SCHEMA)}, "json_schema"),
    ({"regex": "[a-z]+"}, "regex"),
    ({"choice": ["yes", "no"]}, "choice"),
    ({"grammar": 'root ::= "a" | "b"'}, "grammar"),
    ({"json_object": True}, "json_object"),
    ({"json_object": True, "whitespace_pattern": " ?"}, "json_schema"),
    ({"json": SCHEMA, "disable_additional_properties": True, "disable_fallback": True,
      "disable_any_whitespace": True}, "json_schema"),
])
def test_structured_outputs_reach_the_wire(gateway: GatewayServer, worker: FakeWorker,
                                           structured: dict[str, Any], kind: str) -> None:
    sdk(gateway).chat.completions.create(model="fake-model", messages=MESSAGES,  # type: ignore[arg-type]
                                          extra_body={"structured_outputs": structured})
    spec = worker.seen[-1].params.structured_output
    assert spec is not None and spec.kind == kind
    if "whitespace_pattern" in structured:
        assert spec.json_schema == {"type": "object", "x-guidance": {"whitespace_pattern": " ?"}}
    if structured.get("disable_additional_properties"):
        assert spec.json_schema == {**SCHEMA, "additionalProperties": False}


@pytest.mark.parametrize("structured,param", [
    ({"structural_tag": "{}"}, "structured_outputs.structural_tag"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs.choice"),
    ({"bogus": 1}, "structured_outputs.bogus"),
    ({"regex": "a(b"}, "structured_outputs.regex"),
])
def test_bad_structured_outputs_are_400s(gateway: GatewayServer, structured: dict[str, Any],
                                         param: str) -> None:
    reply = post(gateway, "/v1/completions", {"prompt": "x", "structured_outputs": structured})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


_NOT_DEFAULT: dict[str, Any] = {
    "tools": [{"type": "function", "function": {"name": "f"}}], "function_call": "auto",
    "tool_choice": "required", "modalities": ["audio"], "length_penalty": 2.0,
    "use_beam_search": True, "spaces_between_special_tokens": False,
    "return_token_ids": True,
}


@pytest.mark.parametrize("name", sorted(REFUSED_UNLESS))
def test_every_refused_field_is_a_400_naming_it(gateway: GatewayServer, name: str) -> None:
    value = _NOT_DEFAULT.get(name, {"something": 1})
    if name in ChatCompletionRequest.model_fields:  # honoured by chat (tools): completions
        reply = post(gateway, "/v1/completions", {"prompt": "x", name: value})
    else:
        reply = post(gateway, "/v1/chat/completions", {"messages": MESSAGES, name: value})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == name


def test_harmless_values_and_ignored_fields_pass(gateway: GatewayServer,
                                                 worker: FakeWorker) -> None:
    harmless = {name: values[0] if values[0] is not None or len(values) == 1 else values[1]
                for name, values in REFUSED_UNLESS.items()}
    ignored = {name: "x" for name in IGNORED if name not in ChatCompletionRequest.model_fields}
    reply = post(gateway, "/v1/chat/completions", {"messages": MESSAGES, **harmless, **ignored,
                                                    "add_special_tokens": False})
    assert reply.status_code == 200, reply.text
    reply = post(gateway, "/v1/completions", {"prompt": "x", "add_special_tokens": False})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "add_special_tokens"


def test_continuous_usage_stats_on_every_chunk(gateway: GatewayServer, worker: FakeWorker) -> None:
    chunks = list(sdk(gateway).completions.create(
        model="fake-model", prompt="x", max_tokens=3, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))  # type: ignore[typeddict-unknown-key]
    assert chunks and all(c.usage is not None for c in chunks)
    with_text = [c for c in chunks if c.choices and c.choices[0].text]
    assert [c.usage.completion_tokens for c in with_text] == [1, 2, 3]  # type: ignore[union-attr]
    assert all(c.usage.prompt_tokens == 3 for c in chunks)  # type: ignore[union-attr]

gateway, worker = h.gateway, h.worker  # the module's fixtures
MESSAGES = h.MESSAGES
sdk, post, raw = h.sdk, h.post, h.raw


# -- 9 and 10: surrogate keys, $ref cycles ----------------------------------------------------

_SURROGATE_KEY = '{"type": "object", "properties": {"\\ud800": {"type": "string"}}}'


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"prompt": "x", "guided_json": %s}', "guided_json"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], '
     '"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": %s}}}',
     "response_format.json_schema.schema"),
    ("/v1/completions", '{"prompt": "x", "structured_outputs": {"json": %s}}',
     "structured_outputs.json"),
    ("/v1/jobs", '{"prompt": "x", "params": {"structured_output": {"json_schema": %s}}}',
     "params.structured_output"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], '
     '"logit_bias": {"\\ud800": 1}}', "logit_bias"),
    ("/v1/jobs", '{"messages": [{"role": "user", "content": "x", "\\udfff": 1}]}',
     "messages.0"),
])
def test_lone_surrogate_keys_are_400s(gateway: GatewayServer, path: str, body: str,
                                      param: str) -> None:
    reply = raw(gateway, path, body.replace("%s", _SURROGATE_KEY))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"].startswith(param), error


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
])
def test_ref_cycles_are_400s(gateway: GatewayServer, schema: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(gateway).chat.completions.create(
            model="fake-model", messages=MESSAGES,  # type: ignore[arg-type]
            response_format={"type": "json_schema",
                             "json_schema": {"name": "loop", "schema": schema}})
    assert "unsatisfiable" in caught.value.message
    assert caught.value.param == "response_format.json_schema.schema"


# -- the docs list every field ----------------------------------------------------------------

def test_docs_list_every_openai_and_vllm_field() -> None:
    from pathlib import Path

    from gateway.openai_api.schemas import ChatCompletionRequest, CompletionRequest, StreamOptions
    from gateway.openai_api.structured import StructuredOutputsIn

    root = Path(__file__).resolve().parents[2]
    honoured = (set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
                | set(StreamOptions.model_fields)) - {"structured_outputs"}
    nested = {f.alias or name for name, f in StructuredOutputsIn.model_fields.items()}
    fields = honoured | set(REFUSED_UNLESS) | set(ROUTE_ONLY) | set(IGNORED) \
        | {"add_special_tokens"}
    for doc in ("docs/protocol.md", "docs/operations.md"):
        text = (root / doc).read_text()
        missing = sorted(f for f in fields | {"structured_outputs"} if f"`{f}`" not in text)
        assert not missing, f"{doc} does not name {missing}"
    protocol = (root / "docs/protocol.md").read_text()
    assert not [f for f in nested if f"`{f}`" not in protocol]


def test_chat_echo_and_token_ids_as_text(gateway: GatewayServer, worker: FakeWorker) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well, "}]
    client = sdk(gateway)
    chat = client.chat.completions.create(model="fake-model", messages=messages,  # type: ignore[arg-type]
                                       extra_body={"echo": True})
    assert chat.choices[0].message.content == "Well, Hello!"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="fake-model", messages=messages, stream=True, extra_body={"echo": True})  # type: ignore[arg-type]
        if c.choices)
    assert streamed == "Well, Hello!"
    out = client.completions.create(model="fake-model", prompt="x", logprobs=1,
                                    extra_body={"return_tokens_as_token_ids": True})
    assert out.choices[0].logprobs is not None
    assert out.choices[0].logprobs.tokens == ["token_id:1", "token_id:2", "token_id:3"]
