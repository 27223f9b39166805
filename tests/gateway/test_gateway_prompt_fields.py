"""The prompt controls and token bans vLLM users send (issue 27, item 11), chat roles and
``stop_reason`` (item 13), at the gateway against a scripted fake worker: each field
reaches the wire as vLLM means it, a bad value is a 400 naming it, a field honoured on one
route is refused on the other, and a choice's ``stop_reason`` comes back streamed or not.
(Their effect on a real model: ``tests/worker/service/test_service_prompt_fields.py``.)
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from gateway.openai_api.fields import ROUTE_ONLY
from tests.gateway import openai_helpers as h
from tests.gateway.server import GatewayServer
from tests.protocol.fake_worker import FakeWorker

gateway, worker = h.gateway, h.worker  # the module's fixtures
post, sdk = h.post, h.sdk
CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well,"}]


def _chat(gw: GatewayServer, **body: Any) -> Any:
    return post(gw, "/v1/chat/completions", {"messages": CHAT, **body})


def _refused(reply: Any, param: str) -> None:
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text


def test_chat_controls_reach_the_wire(gateway: GatewayServer, worker: FakeWorker) -> None:
    assert _chat(gateway).status_code == 200
    seen = worker.seen[-1]
    assert seen.add_generation_prompt and not seen.continue_final_message
    assert seen.chat_template_kwargs is None
    kwargs = {"enable_thinking": False, "persona": {"name": "x", "tags": [1, 2]}}
    assert _chat(gateway, continue_final_message=True, chat_template_kwargs=kwargs)\
        .status_code == 200
    seen = worker.seen[-1]  # continuing: no generation prompt unless asked (vLLM)
    assert seen.continue_final_message and not seen.add_generation_prompt
    assert seen.chat_template_kwargs == kwargs
    assert _chat(gateway, add_generation_prompt=False).status_code == 200
    assert not worker.seen[-1].add_generation_prompt


@pytest.mark.parametrize("body,param", [
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ({"continue_final_message": True, "messages": [{"role": "user", "content": "x"}]},
     "continue_final_message"),
    ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"bos_token": ""}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {f"k{i}": i for i in range(65)}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"big": "x" * 70_000}}, "chat_template_kwargs"),
    ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
])
def test_bad_chat_controls_are_400s(gateway: GatewayServer, body: dict[str, Any],
                                    param: str) -> None:
    _refused(_chat(gateway, **body), param)


@pytest.mark.parametrize("name", sorted(ROUTE_ONLY))
def test_route_only_fields_are_refused_on_the_other_route(gateway: GatewayServer,
                                                          name: str) -> None:
    value = {"suffix": "x", "add_generation_prompt": False, "continue_final_message": True,
             "chat_template_kwargs": {"enable_thinking": False}}[name]
    route, _harmless = ROUTE_ONLY[name]
    if route == "chat":
        reply = post(gateway, "/v1/completions", {"prompt": "x", name: value})
    else:
        reply = _chat(gateway, **{name: value})
    _refused(reply, name)
    assert "only for" in reply.json()["error"]["message"]


def test_token_fields_and_suffix_reach_the_wire(gateway: GatewayServer,
                                                worker: FakeWorker) -> None:
    body = {"prompt": "def f(", "suffix": "\n  return 1", "truncate_prompt_tokens": 5,
            "bad_words": ["hello", "big world"], "allowed_token_ids": [1, 2, 3]}
    assert post(gateway, "/v1/completions", body).status_code == 200
    seen = worker.seen[-1]
    assert seen.suffix == "\n  return 1" and seen.prompt == "def f("
    assert seen.params.truncate_prompt_tokens == 5
    assert seen.params.bad_words == ["hello", "big world"]
    assert seen.params.allowed_token_ids == [1, 2, 3]
    assert _chat(gateway, truncate_prompt_tokens=-1, bad_words=["x"]).status_code == 200
    assert worker.seen[-1].params.truncate_prompt_tokens == -1
    assert post(gateway, "/v1/completions", {"prompt": "x", "suffix": ""}).status_code == 200
    assert worker.seen[-1].suffix is None  # "" asks for nothing


@pytest.mark.parametrize("body,param", [
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": "5"}, "truncate_prompt_tokens"),
    ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": ["   "]}, "bad_words"),
    ({"bad_words": "word"}, "bad_words"),
    ({"bad_words": ["w"] * 1025}, "bad_words"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [3, -1]}, "allowed_token_ids"),
    ({"allowed_token_ids": [1.5]}, "allowed_token_ids.0"),
    ({"suffix": 3}, "suffix"),
    ({"prompt": [1, 2, 3], "suffix": "x"}, "suffix"),
])
def test_bad_token_fields_are_400s(gateway: GatewayServer, body: dict[str, Any],
                                   param: str) -> None:
    _refused(post(gateway, "/v1/completions", {"prompt": "x", **body}), param)


@pytest.mark.parametrize("role", ["system", "user", "assistant", "tool", "developer",
                                  "function"])
def test_openais_roles_are_accepted(gateway: GatewayServer, worker: FakeWorker,
                                    role: str) -> None:
    messages = [{"role": "user", "content": "a"}, {"role": role, "content": "b"}]
    assert post(gateway, "/v1/chat/completions", {"messages": messages}).status_code == 200
    assert worker.seen[-1].messages is not None
    assert worker.seen[-1].messages[-1].role == role


@pytest.mark.parametrize("role", ["bot", "", "User", "ipython"])
def test_an_unknown_role_is_a_400_naming_it(gateway: GatewayServer, role: str) -> None:
    messages = [{"role": "user", "content": "a"}, {"role": role, "content": "b"}]
    reply = post(gateway, "/v1/chat/completions", {"messages": messages})
    _refused(reply, "messages.1.role")
    assert "'developer'" in reply.json()["error"]["message"]


@pytest.mark.parametrize("stop_reason", ["lo", 7])
def test_stop_reason_in_every_choice(gateway: GatewayServer, worker: FakeWorker,
                                     stop_reason: str | int) -> None:
    worker.script.stop_reason = stop_reason
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": CHAT})):
        whole = post(gateway, path, body).json()
        assert whole["choices"][0]["finish_reason"] == "stop"
        assert whole["choices"][0]["stop_reason"] == stop_reason
        chunks = [c for c in h.raw_stream(gateway, path, {**body, "stream": True})
                  if c["choices"]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        assert chunks[-1]["choices"][0]["stop_reason"] == stop_reason
    worker.script.stop_reason = None
    worker.script.finish_reason = "length"
    whole = post(gateway, "/v1/completions", {"prompt": "x"}).json()
    assert whole["choices"][0]["finish_reason"] == "length"
    assert whole["choices"][0]["stop_reason"] is None


def test_jobs_api_takes_the_prompt_controls(gateway: GatewayServer, worker: FakeWorker) -> None:
    body = {"messages": CHAT, "add_generation_prompt": False, "continue_final_message": True,
            "chat_template_kwargs": {"enable_thinking": False},
            "params": {"bad_words": ["x"], "truncate_prompt_tokens": 3}}
    before = len(worker.seen)
    assert post(gateway, "/v1/jobs", body).status_code == 202
    deadline = time.monotonic() + 10
    while len(worker.seen) == before and time.monotonic() < deadline:  # submit and walk away
        time.sleep(0.01)
    seen = worker.seen[-1]
    assert seen.continue_final_message and seen.chat_template_kwargs == {"enable_thinking": False}
    assert seen.params.bad_words == ["x"] and seen.params.truncate_prompt_tokens == 3
    _refused(post(gateway, "/v1/jobs", {"prompt": "x", "chat_template_kwargs": {"a": 1}}),
             "chat_template_kwargs")
    _refused(post(gateway, "/v1/jobs", {"messages": CHAT, "continue_final_message": True}),
             "continue_final_message")
