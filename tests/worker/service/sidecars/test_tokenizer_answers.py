"""The worker's answers to tokenizer requests, in process on the test checkpoint's real
tokenizer (no Redis: ``tokenizer_responder.py`` only carries them): what crosses the wire
always encodes, refusals are 400s naming the field, a reply is bounded; and (a worker in
process on a real Redis) tokenizing never runs on the engine loop's thread."""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from typing import Any

import pytest
import redis
from pydantic import ValidationError
from transformers import AutoTokenizer

from protocol.models import GenerateRequest
from protocol.sampling import SamplingParams
from protocol.tokenizer import (
    TokenizerRequest,
    decode_tokenizer_reply,
    encode_tokenizer_message,
)
from protocol.tokenizer_queue import PUSH_LUA, item, push_args
from tests.worker.service.test_service_inprocess import Running
from worker.engine.inputs.prompts import PromptBuilder, PromptLimits
from worker.service.redis.connection import WorkerSettings
from worker.service.sidecars import tokenizer_responder
from worker.service.sidecars.tokenizer_answers import answer
from worker.service.sidecars.tokenizer_responder import TokenizerResponder

VOCAB = 512


@pytest.fixture(scope="module")
def tokenizer(checkpoint: str) -> Any:
    return AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> PromptBuilder:
    return PromptBuilder(tokenizer, PromptLimits(vocab_size=VOCAB, max_model_len=256,
                                                 num_blocks=64, block_size=16))


def _ask(prompts: PromptBuilder, tokenizer: Any, **fields: Any) -> Any:
    request = TokenizerRequest(reply_id="r1", deadline=time.time() + 5, **fields)
    # through msgpack both ways, as on Redis
    return decode_tokenizer_reply(encode_tokenizer_message(answer(request, prompts,
                                                                  tokenizer)))


def test_info_always_encodes(prompts: PromptBuilder, tokenizer: Any) -> None:
    """This tokenizer sets no model_max_length: transformers says int(1e30), past what
    msgpack carries; the reply must still go out (it once killed the responder)."""
    reply = _ask(prompts, tokenizer, op="info")
    assert reply.status == 200 and reply.body is not None
    assert reply.body["model_max_length"] == pytest.approx(1e30)
    assert reply.body["chat_template"] == tokenizer.chat_template
    assert reply.body["eos_token"] == tokenizer.eos_token


def test_refusals_are_400s_naming_the_field(prompts: PromptBuilder, tokenizer: Any) -> None:
    reply = _ask(prompts, tokenizer, op="detokenize", tokens=[1, VOCAB + 3])
    assert (reply.status, reply.param) == (400, "tokens")
    assert f"tokens.1: token id {VOCAB + 3} outside [0, {VOCAB})" == reply.error
    ok = _ask(prompts, tokenizer, op="tokenize", prompt="hello world",
              add_special_tokens=False, return_token_strs=True)
    ids = tokenizer("hello world", add_special_tokens=False)["input_ids"]
    assert ok.body == {"count": len(ids), "max_model_len": 256, "tokens": ids,
                       "token_strs": tokenizer.convert_ids_to_tokens(ids)}


@pytest.mark.parametrize("fields, param", [
    ({"op": "tokenize", "prompt": "a\ud800b"}, "prompt"),
    ({"op": "tokenize", "messages": [{"role": "user", "content": "\udfff"}]},
     "messages.0.content"),
    ({"op": "detokenize", "tokens": [3, 2**64]}, "tokens.1"),
    ({"op": "detokenize", "tokens": [10**30]}, "tokens.0"),
    ({"op": "detokenize", "tokens": [-1]}, "tokens.0"),
    ({"op": "check_lora", "lora_name": "a", "lora_path": "/x\ud800"}, "lora_path"),
])
def test_a_request_refuses_what_the_wire_cannot_carry(fields: dict[str, Any], param: str
                                                      ) -> None:
    """msgpack carries neither lone surrogates nor integers past 64 bits: the request says
    which field, before anything is encoded (the gateway answers a 400 naming it)."""
    with pytest.raises(ValidationError, match=re.escape(param)):
        TokenizerRequest(reply_id="r1", deadline=time.time() + 5, **fields)


def test_a_reply_over_its_size_limit_is_a_400(prompts: PromptBuilder, tokenizer: Any,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """What one call may put in Redis is bounded both ways: a reply past
    ``MAX_REPLY_BYTES`` is never written, the caller gets a 400 naming its input."""
    settings = WorkerSettings(redis_url="redis://127.0.0.1:1/0", worker_id="big")
    responder = TokenizerResponder(settings, prompts, tokenizer, threads=1)
    request = TokenizerRequest(op="tokenize", reply_id="r1", deadline=time.time() + 5,
                               prompt="many words " * 200, return_token_strs=True)
    assert decode_tokenizer_reply(responder._answer(request)).status == 200
    monkeypatch.setattr(tokenizer_responder, "MAX_REPLY_BYTES", 1000)
    reply = decode_tokenizer_reply(responder._answer(request))
    assert reply.status == 400 and reply.param == "prompt", reply
    assert "more than a tokenizer reply may carry (1000)" in str(reply.error)


def test_tokenizing_never_runs_on_the_engine_loop_thread(
        engine: Any, redis_server: Any, client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker in process: a ``/tokenize`` call (as the gateway pushes it) and a
    generation's prompt are both tokenized, on threads other than the engine loop's."""
    seen: set[int] = set()
    tokenize = engine.prompts.tokenize

    def recorded(*args: Any, **kw: Any) -> Any:
        seen.add(threading.get_ident())
        return tokenize(*args, **kw)

    monkeypatch.setattr(engine.prompts, "tokenize", recorded)
    with Running(engine, redis_server.url) as running:
        settings = running.service.settings
        base = settings.keys.tokenizer_requests(settings.model_name)
        request = TokenizerRequest(op="tokenize", reply_id="pin", deadline=time.time() + 60,
                                   prompt="tokenized off the loop")
        keys, args = push_args(base, "default", item(encode_tokenizer_message(request)), 60)
        r = redis.Redis.from_url(redis_server.url)
        r.eval(PUSH_LUA, len(keys), *keys, *args)
        popped = r.blpop([settings.keys.tokenizer_reply(settings.model_name, "pin")], 60)
        assert popped is not None and decode_tokenizer_reply(popped[1]).status == 200
        generation = GenerateRequest(prompt="and a generation's prompt", params=SamplingParams(
            max_tokens=2, temperature=0))
        with client.subscribe(generation.request_id) as sub:
            client.enqueue(generation)
            assert list(sub.events(timeout=60))[-1].is_final
        r.close()
    assert len(seen) >= 1 and running.thread.ident not in seen


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread priorities are Linux's")
def test_the_responder_threads_yield_the_cpu_to_generation(prompts: PromptBuilder,
                                                           tokenizer: Any) -> None:
    """Generation comes first when the CPU is short: the responder's threads run at a
    lower priority (nice ``NICE``) than the engine's, the rest of the process unchanged."""
    settings = WorkerSettings(redis_url="redis://127.0.0.1:1/0", worker_id="nice")
    responder = TokenizerResponder(settings, prompts, tokenizer, threads=2)
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    responder.start()
    try:
        deadline = time.monotonic() + 30
        for thread in responder._threads:
            assert thread.native_id is not None
            while os.getpriority(os.PRIO_PROCESS, thread.native_id) != min(
                    19, own + tokenizer_responder.NICE):
                assert time.monotonic() < deadline, "the thread kept its priority"
                time.sleep(0.01)
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own
    finally:
        responder.stop()
