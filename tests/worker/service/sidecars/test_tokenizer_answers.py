"""The worker's answers to tokenizer requests, in process on the test checkpoint's real
tokenizer (no Redis: ``tokenizer_responder.py`` only carries them): what crosses the wire
always encodes, and refusals are 400s naming the field."""

from __future__ import annotations

import time
from typing import Any

import pytest
from transformers import AutoTokenizer

from protocol.tokenizer import (
    TokenizerRequest,
    decode_tokenizer_reply,
    encode_tokenizer_message,
)
from worker.engine.inputs.prompts import PromptBuilder, PromptLimits
from worker.service.sidecars.tokenizer_answers import answer

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
