"""The prompt controls, token bans and ``stop_reason`` (issue 27, items 11 and 13) end to
end: HTTP -> gateway -> Redis -> a real ``ferry worker`` on the default model, and on a
checkpoint whose tokenizer has FIM tokens and a thinking switch.

What only the worker can know (the model has no FIM tokens, an id outside its vocabulary)
is a 400 naming the field before the stream's first event; bans hold on greedy output and
change nothing where they do not apply; ``stop_reason`` is the stop string or token id.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from gateway.settings import GatewaySettings
from tests.checkpoints import build_checkpoint
from tests.gateway.openai_helpers import raw_stream
from tests.gateway.server import GatewayServer
from tests.redis_server import RedisServer
from tests.worker.engine.inputs.test_prompt_controls import PROMPT, _contains, _word_in
from tests.worker.service.procs import WorkerProcess
from worker.engine.inputs.bad_words import word_token_ids
from worker.models import default_model_path


def _stack(model: str, redis_url: str, name: str, log_dir: Path) -> Iterator[Any]:
    with WorkerProcess(model, redis_url, name, log_dir) as worker:
        worker.wait_live()
        with GatewayServer(GatewaySettings(redis_url=redis_url)) as gateway:
            yield SimpleNamespace(url=gateway.url, tok=AutoTokenizer.from_pretrained(model))


@pytest.fixture(scope="module")
def stack(redis_server: Any, tmp_path_factory: Any) -> Iterator[Any]:
    yield from _stack(default_model_path(), redis_server.url, "fields-1",
                      tmp_path_factory.mktemp("logs"))


@pytest.fixture(scope="module")
def fim_stack(tmp_path_factory: Any) -> Iterator[Any]:
    model = build_checkpoint("llama", tmp_path_factory.mktemp("fim"), fim=True)
    with RedisServer() as server:
        yield from _stack(model, server.url, "fields-fim", tmp_path_factory.mktemp("logs"))


def _post(stack: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{stack.url}{path}", json=body, timeout=120)


def _ids(stack: Any, **body: Any) -> list[int]:
    """Greedy completion of PROMPT, as token ids (logprob tokens spelled ``token_id:N``)."""
    reply = _post(stack, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 32, "temperature": 0, "logprobs": 0,
        "return_tokens_as_token_ids": True, **body})
    assert reply.status_code == 200, reply.text
    tokens = reply.json()["choices"][0]["logprobs"]["tokens"]
    return [int(t.split(":")[1]) for t in tokens]


def _refused(reply: httpx.Response, param: str) -> str:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    return str(error["message"])


def test_suffix_without_fim_tokens_is_a_400(stack: Any) -> None:
    for stream in (False, True):
        reply = _post(stack, "/v1/completions", {"prompt": "def f(", "suffix": "\n  return 1",
                                                 "stream": stream})
        assert "fill-in-the-middle" in _refused(reply, "suffix")


def test_bad_words_hold_on_greedy_output(stack: Any) -> None:
    plain = _ids(stack)
    for length in (1, 2):
        word, _seq, first = _word_in(stack.tok, plain, length)
        out = _ids(stack, bad_words=[word])
        assert all(_contains(out, s) == -1 for s in word_token_ids(stack.tok, [word]))
        assert out[:first + length - 1] == plain[:first + length - 1]
    assert _ids(stack, bad_words=["zebra"]) == plain


def test_allowed_token_ids(stack: Any) -> None:
    allowed = sorted(set(_ids(stack)[:5]))
    out = _ids(stack, allowed_token_ids=allowed, temperature=1.0, seed=1)
    assert out and set(out) <= set(allowed)
    vocab = len(stack.tok)
    for stream in (False, True):
        reply = _post(stack, "/v1/completions", {"prompt": "x", "stream": stream,
                                                 "allowed_token_ids": [1, vocab]})
        assert str(vocab) in _refused(reply, "allowed_token_ids")


def test_truncate_prompt_tokens_keeps_the_last_tokens(stack: Any) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 4
    kept = stack.tok(text).input_ids[-6:]
    reply = _post(stack, "/v1/completions", {"prompt": text, "max_tokens": 1, "echo": True,
                                             "truncate_prompt_tokens": 6})
    body = reply.json()
    assert body["usage"]["prompt_tokens"] == 6, body
    assert body["choices"][0]["text"].startswith(stack.tok.decode(kept))
    chat = _post(stack, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": text}], "max_tokens": 1,
        "truncate_prompt_tokens": 4}).json()
    assert chat["usage"]["prompt_tokens"] == 4


def _stop_reasons(stack: Any, path: str, body: dict[str, Any]) -> list[Any]:
    """``(finish_reason, stop_reason)`` of the whole response and of the stream's end."""
    whole = _post(stack, path, body).json()["choices"][0]
    last = [c for c in raw_stream(stack, path,
                                  {**body, "stream": True}) if c["choices"]][-1]["choices"][0]
    return [(whole["finish_reason"], whole["stop_reason"]),
            (last["finish_reason"], last["stop_reason"])]


def test_stop_reason_streamed_or_not(stack: Any) -> None:
    plain = _ids(stack)
    text = stack.tok.decode(plain)
    stop = text[6:10]
    chat = {"messages": [{"role": "user", "content": "def"}], "max_tokens": 24,
            "temperature": 0}
    reply = _post(stack, "/v1/chat/completions", chat).json()["choices"][0]["message"]
    chat_stop = reply["content"][3:6]
    cases = [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 32, "temperature": 0,
                             "stop": [stop, "never here"]}, stop),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 32, "temperature": 0,
                             "stop_token_ids": [plain[4]]}, plain[4]),
        ("/v1/chat/completions", {**chat, "stop": [chat_stop]}, chat_stop),
    ]
    for path, body, expected in cases:
        assert _stop_reasons(stack, path, body) == [("stop", expected)] * 2, (path, body)
    short = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    assert _stop_reasons(stack, "/v1/completions", short) == [("length", None)] * 2
    # n > 1: each choice's own (on the terminal event's choices, or its closing event)
    both = {"prompt": PROMPT, "max_tokens": 32, "temperature": 0, "n": 2, "stop": [stop]}
    whole = _post(stack, "/v1/completions", both).json()["choices"]
    assert [(c["index"], c["stop_reason"]) for c in whole] == [(0, stop), (1, stop)]
    ends = [c["choices"][0] for c in raw_stream(stack, "/v1/completions",
                                                {**both, "stream": True})
            if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted((c["index"], c["stop_reason"]) for c in ends) == [(0, stop), (1, stop)]


def test_chat_template_controls(stack: Any) -> None:
    messages = [{"role": "user", "content": "def add"}, {"role": "assistant",
                                                          "content": "(a, b):"}]

    def prompt_tokens(**body: Any) -> int:
        reply = _post(stack, "/v1/chat/completions", {"messages": messages, "max_tokens": 1,
                                                       **body})
        assert reply.status_code == 200, reply.text
        return int(reply.json()["usage"]["prompt_tokens"])

    rendered = stack.tok.apply_chat_template(messages, add_generation_prompt=False,
                                             continue_final_message=True, return_dict=False)
    assert prompt_tokens(continue_final_message=True) == len(rendered)
    assert prompt_tokens() > prompt_tokens(add_generation_prompt=False) > len(rendered)
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) == prompt_tokens()
    _refused(_post(stack, "/v1/chat/completions", {
        "messages": messages, "chat_template_kwargs": {"tokenize": False}}),
        "chat_template_kwargs")


def test_fim_and_thinking_switch_on_a_model_that_has_them(fim_stack: Any) -> None:
    tok = fim_stack.tok
    reply = _post(fim_stack, "/v1/completions", {"prompt": "def add(a, b):\n", "max_tokens": 3,
                                                 "suffix": "\n    return c\n"})
    assert reply.status_code == 200, reply.text
    fim = tok("<|fim_prefix|>def add(a, b):\n<|fim_suffix|>\n    return c\n<|fim_middle|>")
    assert reply.json()["usage"]["prompt_tokens"] == len(fim.input_ids)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    on = _post(fim_stack, "/v1/chat/completions", chat).json()["usage"]["prompt_tokens"]
    off = _post(fim_stack, "/v1/chat/completions", {
        **chat, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert off["usage"]["prompt_tokens"] == on + 1  # the template closed the thought
