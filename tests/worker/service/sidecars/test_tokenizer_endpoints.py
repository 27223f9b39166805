"""``/tokenize``, ``/detokenize``, ``/tokenizer_info`` end to end: a real gateway (no
tokenizer of its own), a real Redis and a real ``ferry worker`` on the default model,
called as lm-evaluation-harness's remote tokenizer calls them (plain httpx, its payloads).
The answers must be the model's own tokenizer's, and a chat must tokenize exactly as the
worker renders it for generation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jinja2
import pytest
from transformers import AutoTokenizer

from gateway.settings import GatewaySettings
from protocol.keys import Keys
from protocol.tokenizer_queue import BELL, ready_key
from tests.gateway.server import GatewayServer
from tests.redis_server import RedisServer
from tests.worker.service.procs import WorkerProcess
from worker.models import default_model_path

KEY = "k-lm-eval"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "default"  # the embedded model's directory name, as its worker advertises it
CHAT = [{"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name a queue that ferries requests."}]


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture(scope="module")
def stack(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[str]:
    """The gateway's URL, with one live worker of the default model behind it."""
    logs: Path = tmp_path_factory.mktemp("tokenizer-logs")
    settings = GatewaySettings(redis_url=redis_server.url, api_keys=(KEY,),
                               tokenizer_timeout_s=30.0)
    with WorkerProcess(str(default_model_path()), redis_server.url, "tok-1", logs) as worker, \
            GatewayServer(settings) as gateway:
        worker.wait_live()
        yield gateway.url


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=AUTH, timeout=60)


class RemoteTokenizer:
    """What lm-eval's ``RemoteTokenizer`` (tokenizer_backend="remote") sends and reads."""

    def __init__(self, base_url: str) -> None:
        self.base = base_url
        info = httpx.get(f"{base_url}/tokenizer_info", headers=AUTH, timeout=60)
        info.raise_for_status()
        self.info: dict[str, Any] = info.json()

    def encode(self, text: str) -> list[int]:
        reply = _post(self.base, "/tokenize", {"prompt": text, "add_special_tokens": False})
        reply.raise_for_status()
        tokens: list[int] = reply.json()["tokens"]
        return tokens

    def decode(self, tokens: list[int]) -> str:
        reply = _post(self.base, "/detokenize", {"tokens": tokens})
        reply.raise_for_status()
        text: str = reply.json()["prompt"]
        return text

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        template = jinja2.Environment().from_string(self.info["chat_template"])
        return template.render(messages=messages, add_generation_prompt=True,
                               bos_token=self.info["bos_token"])


def test_lm_eval_remote_tokenizer_flow(stack: str, hf_tokenizer: Any) -> None:
    remote = RemoteTokenizer(stack)
    assert remote.info["eos_token"] == hf_tokenizer.eos_token
    assert remote.info["chat_template"] == hf_tokenizer.chat_template
    assert remote.info["tokenizer_class"] == type(hf_tokenizer).__name__
    assert "name_or_path" not in remote.info  # no path of the worker's machine
    assert remote.encode(remote.info["eos_token"])[0] == hf_tokenizer.eos_token_id
    for text in ("Question: what is 2 + 2?\nAnswer:", " 4", "ünïcödé ✓ ferries", ""):
        ids = remote.encode(text)
        assert ids == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert remote.decode(ids) == hf_tokenizer.decode(ids) == text
    rendered = remote.apply_chat_template(CHAT)
    assert rendered == hf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True,
                                                        tokenize=False)


def test_tokenize_prompt_shape(stack: str, hf_tokenizer: Any) -> None:
    text = "The quick brown fox"
    body = _post(stack, "/tokenize", {"model": MODEL, "prompt": text,
                                      "return_token_strs": True}).json()
    ids = hf_tokenizer(text, add_special_tokens=True)["input_ids"]
    assert body == {"count": len(ids), "max_model_len": 2048, "tokens": ids,
                    "token_strs": hf_tokenizer.convert_ids_to_tokens(ids)}
    plain = _post(stack, "/tokenize", {"prompt": text}).json()  # the served model
    assert set(plain) == {"count", "max_model_len", "tokens"} and plain["tokens"] == ids


def test_chat_tokenizes_as_generation_renders(stack: str, hf_tokenizer: Any) -> None:
    body = _post(stack, "/tokenize", {"messages": CHAT}).json()
    ids = hf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    assert body["tokens"] == ids and body["count"] == len(ids)
    # the worker's generation sees the same prompt: its usage counts it, and the same ids
    # given as a completion's prompt continue exactly as the chat does (greedy)
    chat = _post(stack, "/v1/chat/completions", {
        "messages": CHAT, "max_tokens": 6, "temperature": 0}).json()
    assert chat["usage"]["prompt_tokens"] == body["count"]
    completion = _post(stack, "/v1/completions", {
        "prompt": body["tokens"], "max_tokens": 6, "temperature": 0}).json()
    assert completion["choices"][0]["text"] == chat["choices"][0]["message"]["content"]
    # vLLM's options: no generation prompt; continue the last message; special tokens
    bare = _post(stack, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert bare.json()["tokens"] == hf_tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=False, tokenize=True, return_dict=False)
    prefill = [*CHAT, {"role": "assistant", "content": "The"}]
    cont = _post(stack, "/tokenize", {"messages": prefill, "continue_final_message": True})
    text = hf_tokenizer.decode(cont.json()["tokens"])
    assert text.endswith("### assistant\nThe"), text
    special = _post(stack, "/tokenize", {"messages": CHAT, "add_special_tokens": True})
    rendered = hf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True,
                                                tokenize=False)
    assert special.json()["tokens"] == hf_tokenizer(rendered)["input_ids"]


def test_refusals_name_the_field(stack: str, redis_server: RedisServer) -> None:
    vocab = 8192
    bad = _post(stack, "/detokenize", {"tokens": [5, vocab]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert f"token id {vocab} outside [0, {vocab})" in bad.json()["error"]["message"]
    unknown = _post(stack, "/tokenize", {"model": "gpt-9", "prompt": "x"})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{stack}/tokenizer_info").status_code == 401  # the tenant's key
    assert httpx.post(f"{stack}/tokenize", json={"prompt": "x"}).status_code == 401
    import redis

    r = redis.Redis.from_url(redis_server.url)
    try:  # every answered request left no call behind, and nothing without a TTL
        names = [k.decode() for k in r.scan_iter("ferry:tokenizer:*")]
        assert not any(":q:" in n for n in names), names
        assert r.zcard(ready_key(Keys().tokenizer_requests(MODEL))) == 0
        for name in names:
            assert 0 < r.ttl(name) <= 60, name
            if r.type(name) == b"list":  # bells a pop did not need
                assert set(r.lrange(name, 0, -1)) <= {BELL}, name
    finally:
        r.close()


HUGE = "1" + "0" * 5000  # more digits than int() converts (4,300)
MANY = ",".join(["1"] * 40_000)  # more ids than max_prompt_tokens
BAD_INPUTS = [  # (path, raw JSON body, the param named)
    ("/tokenize", '{"prompt": "a\\ud800b"}', "prompt"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "a\\udfffb"}]}',
     "messages.0.content"),
    ("/tokenize", '{"messages": [{"role": "user", "content": [{"type": "text", '
     '"text": "\\ud83d"}]}]}', "messages.0.content"),
    ("/detokenize", '{"tokens": [5, 18446744073709551616]}', "tokens"),
    ("/detokenize", '{"tokens": [1000000000000000000000000000000]}', "tokens"),
    ("/detokenize", '{"tokens": [9223372036854775808]}', "tokens"),
    ("/detokenize", '{"tokens": [-1000000000000000000000000000000]}', "tokens"),
    ("/detokenize", '{"tokens": [-1]}', "tokens"),
    ("/detokenize", '{"tokens": [8192]}', "tokens"),  # the model's vocabulary: the worker's
    ("/detokenize", '{"tokens": [4294967296]}', "tokens"),
    ("/detokenize", '{"tokens": [1.5]}', "tokens.0"),
    ("/detokenize", '{"tokens": ["7"]}', "tokens.0"),
    ("/detokenize", '{"tokens": [null]}', "tokens.0"),
    ("/detokenize", '{"tokens": {"0": 1}}', "tokens"),
    ("/detokenize", f'{{"tokens": [{MANY}]}}', "tokens"),
    ("/detokenize", f'{{"tokens": [{HUGE}]}}', None),  # the body's: param null
    ("/tokenize", '{"prompt": "x", "add_special_tokens": 1000000000000000000000000000000}',
     "add_special_tokens"),
    ("/tokenize", '{"prompt": ["x"]}', "prompt"),
    ("/v1/completions", f'{{"prompt": "x", "max_tokens": {HUGE}}}', None),
]


def test_bad_inputs_are_400s_naming_the_field(stack: str) -> None:
    """Lone surrogates, token ids msgpack cannot carry, ids over the vocabulary, wrong
    types, too many ids, integers of thousands of digits: each a 400 naming the field, no
    traceback or server path in the body, and the connection stays usable (a 500 used to
    close it, so the next call on it was reset)."""
    with httpx.Client(base_url=stack, headers=AUTH, timeout=60) as client:
        for path, body, param in BAD_INPUTS:
            reply = client.post(path, content=body,
                                headers={"Content-Type": "application/json"})
            assert reply.status_code == 400, (path, body[:80], reply.text[:300])
            error = reply.json()["error"]
            assert error["param"] == param, (body[:80], error)
            assert "Traceback" not in reply.text and ".py" not in reply.text
            assert "/work" not in reply.text and "site-packages" not in reply.text
        assert client.post("/detokenize", json={"tokens": [5]}).status_code == 200
