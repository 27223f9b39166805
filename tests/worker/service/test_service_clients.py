"""What real clients expect, end to end (issue 19): the official ``openai`` SDK -> a real
gateway -> Redis -> a real ``ferry worker`` on a random 2-layer Llama (context 512, fp32,
a token budget of 32 so prompts are prefilled in several chunks). Raw Redis producers
where no client is involved.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack
import openai
import pytest
import redis
import torch

from gateway.settings import GatewaySettings
from protocol.sampling import SamplingParams
from tests.gateway.server import GatewayServer
from tests.redis_server import free_port
from tests.worker.service.procs import WorkerProcess

CONTEXT = 512
PROMPT = ("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
          "    return a\n\nclass Queue:\n    '''A FIFO queue.'''\n    def push(self, item):\n"
          "        self.items.append(item)\n")
LITELLM_CONTEXT_MATCH = "This model's maximum context length is"


@pytest.fixture(scope="module")
def stack(redis_server: Any, checkpoint: str, tmp_path_factory: Any) -> Iterator[Any]:
    log_dir = tmp_path_factory.mktemp("logs")
    metrics_port = free_port()
    with WorkerProcess(checkpoint, redis_server.url, "clients-1", log_dir,
                       "--metrics-port", str(metrics_port),
                       env={"FERRY_MAX_NUM_BATCHED_TOKENS": "32"}) as worker:
        worker.wait_live()
        with GatewayServer(GatewaySettings(redis_url=redis_server.url)) as gateway:
            sdk = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
            model = sdk.models.list().data[0].id
            yield SimpleNamespace(worker=worker, sdk=sdk, model=model, url=gateway.url,
                                  redis_url=redis_server.url, metrics_port=metrics_port)


@pytest.fixture(scope="module")
def tokenizer(checkpoint: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def hf_model(checkpoint: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


# -- 2: a list of prompts ------------------------------------------------------------------

def test_prompt_lists_streamed_or_not(stack: Any, reference: Any, tokenizer: Any) -> None:
    prompts = ["class Queue:", "def fibonacci(n):"]
    runs = [reference.run(p, SamplingParams(temperature=0, max_tokens=6)) for p in prompts]
    want = [text for _, text in runs]
    lengths = [len(ids) for ids, _ in runs]
    out = stack.sdk.completions.create(model=stack.model, prompt=prompts, n=2, max_tokens=6,
                                       temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [want[0], want[0], want[1], want[1]]
    prompt_tokens = sum(len(_ids(tokenizer, p)) for p in prompts)
    assert out.usage.prompt_tokens == prompt_tokens
    assert out.usage.completion_tokens == 2 * sum(lengths)  # n=2: each choice counts
    texts: dict[int, str] = {}
    usage = None
    for chunk in stack.sdk.completions.create(
            model=stack.model, prompt=[_ids(tokenizer, p) for p in prompts], max_tokens=6,
            temperature=0, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
        usage = chunk.usage or usage
    assert texts == {0: want[0], 1: want[1]}
    assert usage is not None and usage.prompt_tokens == prompt_tokens
    assert usage.completion_tokens == sum(lengths)


# -- 3: echo and prompt logprobs (lm-evaluation-harness's loglikelihood requests) -----------

def _reference_logprobs(model: Any, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[i, ids[i + 1]]) for i in range(len(ids) - 1)]


def _check_echo(choice: Any, prompt: str, ids: list[int], want: list[float]) -> None:
    assert choice.text == prompt
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None
    for got, expected in zip(lp.token_logprobs[1:], want, strict=True):
        assert abs(got - expected) < 1e-4, (got, expected)
    for i, top in enumerate(lp.top_logprobs[1:], 1):  # logprobs=1: the likeliest token
        assert len(top) == 1 and max(top.values()) >= lp.token_logprobs[i] - 1e-6
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_echo_with_prompt_logprobs_matches_transformers(stack: Any, tokenizer: Any,
                                                        hf_model: Any) -> None:
    ids = _ids(tokenizer, PROMPT)
    assert len(ids) > 64, "the prompt must span several 32-token prefill chunks"
    want = _reference_logprobs(hf_model, ids)
    out = stack.sdk.completions.create(model=stack.model, prompt=PROMPT, echo=True,
                                       logprobs=1, max_tokens=0)
    _check_echo(out.choices[0], PROMPT, ids, want)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 0
    # max_tokens 1, as lm-eval's other mode: the prompt, then one token
    one = stack.sdk.completions.create(model=stack.model, prompt=PROMPT, echo=True,
                                       logprobs=1, max_tokens=1, temperature=0)
    assert one.choices[0].text.startswith(PROMPT)
    assert len(one.choices[0].logprobs.tokens) == len(ids) + 1
    # token ids as the prompt: the worker decodes them for the echo
    by_ids = stack.sdk.completions.create(model=stack.model, prompt=ids, echo=True,
                                          logprobs=1, max_tokens=0)
    assert by_ids.choices[0].text == tokenizer.decode(ids)
    assert by_ids.choices[0].logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)


def test_prompt_logprobs_with_a_prefix_cache_hit(stack: Any, tokenizer: Any,
                                                 hf_model: Any) -> None:
    warm = PROMPT + "    def size(self):\n"
    stack.sdk.completions.create(model=stack.model, prompt=warm, max_tokens=1)  # caches it
    prompt = PROMPT + "    def pop(self):\n"
    ids = _ids(tokenizer, prompt)
    out = stack.sdk.completions.create(model=stack.model, prompt=prompt, echo=True,
                                       logprobs=1, max_tokens=0)
    _check_echo(out.choices[0], prompt, ids, _reference_logprobs(hf_model, ids))
    # vLLM's prompt_logprobs field, streamed too
    extra = stack.sdk.completions.create(model=stack.model, prompt=prompt, max_tokens=1,
                                         extra_body={"prompt_logprobs": 2})
    entries = extra.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    want = _reference_logprobs(hf_model, ids)
    for i, entry in enumerate(entries[1:]):
        assert abs(entry[str(ids[i + 1])]["logprob"] - want[i]) < 1e-4
        assert len(entry) >= 2
    chunks = list(stack.sdk.completions.create(model=stack.model, prompt=prompt, echo=True,
                                               logprobs=1, max_tokens=2, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text.startswith(prompt)
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs
               for o in c.choices[0].logprobs.text_offset]
    assert offsets == sorted(offsets) and len(offsets) == len(ids) + 2


# -- 5, 6, 8: refusals known before the first token are 400s, in OpenAI's words ------------

def test_too_long_prompt_streamed_is_a_400_with_openais_wording(stack: Any,
                                                                tokenizer: Any) -> None:
    long_prompt = "x = 1\n" * 150
    n = len(_ids(tokenizer, long_prompt))
    with pytest.raises(openai.BadRequestError) as caught:
        list(stack.sdk.completions.create(model=stack.model, prompt=long_prompt, max_tokens=16,
                                          stream=True))
    error = caught.value
    assert error.status_code == 400 and error.code == "context_length_exceeded"
    assert error.param == "prompt" and error.type == "invalid_request_error"
    message = error.body["message"]  # type: ignore[index]
    assert message.startswith(f"{LITELLM_CONTEXT_MATCH} {CONTEXT} tokens. However, you "
                              f"requested {n + 16} tokens ({n} in the prompt, 16 in the "
                              "completion).")
    with pytest.raises(openai.BadRequestError) as chat:
        stack.sdk.chat.completions.create(model=stack.model, stream=True, max_tokens=16,
                                          messages=[{"role": "user", "content": long_prompt}])
    assert chat.value.code == "context_length_exceeded" and chat.value.param == "messages"
    assert LITELLM_CONTEXT_MATCH in chat.value.message


def test_out_of_vocabulary_ids_name_the_prompt(stack: Any) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        list(stack.sdk.completions.create(model=stack.model, prompt=[1, 10**6], stream=True))
    assert caught.value.param == "prompt" and "10000" in caught.value.message


# -- 12: no max_tokens: what the context leaves --------------------------------------------

def test_chat_without_max_tokens_generates_what_the_context_leaves(
    stack: Any, tokenizer: Any
) -> None:
    content = "x = 1\n" * 90  # about 360 tokens with the template: 360 + 256 > 512
    chat = stack.sdk.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": content}],
        extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.prompt_tokens + 256 > CONTEXT
    assert chat.usage.total_tokens == CONTEXT
    with pytest.raises(openai.BadRequestError) as caught:  # given and too large: refused
        stack.sdk.chat.completions.create(
            model=stack.model, messages=[{"role": "user", "content": content}], max_tokens=256)
    assert caught.value.code == "context_length_exceeded"


# -- 17: unbounded integers in a schema are bounded by default -----------------------------

def test_unbounded_integer_still_closes_the_json(stack: Any, tokenizer: Any) -> None:
    digits = {str(i): 20 for tok, i in tokenizer.get_vocab().items()
              if tok and set(tok) <= set("0123456789")}
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}

    def ask(schema: dict[str, Any]) -> Any:
        return stack.sdk.chat.completions.create(
            model=stack.model, messages=[{"role": "user", "content": "a number"}],
            max_tokens=60, temperature=0, logit_bias=digits,
            response_format={"type": "json_schema", "json_schema": {"name": "n",
                                                                    "schema": schema}})

    bounded = ask(schema)
    value = json.loads(bounded.choices[0].message.content)["n"]
    assert bounded.choices[0].finish_reason == "stop" and -(2**63) <= value < 2**63
    free = ask({**schema, "x-ferry": {"bounded_numbers": False}})  # the switch
    assert free.choices[0].finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)


# -- 10, 13: raw producers ----------------------------------------------------------------

def _xadd_and_listen(redis_url: str, entries: list[dict[str, Any]], rid: str,
                     wait_dead: int = 0) -> list[dict[str, Any]]:
    r = redis.Redis.from_url(redis_url)
    pubsub = r.pubsub()
    pubsub.subscribe(f"ferry:tokens:{rid}")
    assert pubsub.get_message(timeout=5)["type"] == "subscribe"  # type: ignore[index]
    dead_before = r.xlen("ferry:requests:dead")
    for entry in entries:
        r.xadd("ferry:requests", {"data": msgpack.packb(entry, use_bin_type=True)})
    deadline = time.monotonic() + 60
    while r.xlen("ferry:requests:dead") < dead_before + wait_dead and time.monotonic() < deadline:
        time.sleep(0.05)
    events: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        msg = pubsub.get_message(timeout=1)
        if msg is None and events and "finish_reason" in events[-1]:
            break
        if msg and msg["type"] == "message":
            events.append(msgpack.unpackb(msg["data"], raw=False))
    pubsub.close()
    r.close()
    return events


def test_raw_producer_ref_cycle_is_an_invalid_request(stack: Any) -> None:
    rid = "cycle-" + uuid.uuid4().hex
    entry = {"version": 3, "request_id": rid, "prompt": "x", "created_at": time.time(),
             "params": {"max_tokens": 8, "structured_output": {"json_schema": {"$ref": "#"}}}}
    events = _xadd_and_listen(stack.redis_url, [entry], rid)
    assert len(events) == 1 and events[0]["error_kind"] == "invalid_request"
    assert "unsatisfiable" in events[0]["error"]


def test_two_undecodable_entries_with_one_id_end_the_job_once(stack: Any) -> None:
    rid = "dl-" + uuid.uuid4().hex
    bad = {"version": 3, "request_id": rid, "prompt": "x", "params": {"max_tokens": "many"}}
    events = _xadd_and_listen(stack.redis_url, [bad, {**bad, "prompt": "y"}], rid, wait_dead=2)
    assert [e["finish_reason"] for e in events] == ["error"], events
    r = redis.Redis.from_url(stack.redis_url)
    job = r.hgetall(f"ferry:job:{rid}")
    log = r.lrange(f"ferry:events:{rid}", 0, -1)
    dead = r.xrevrange("ferry:requests:dead", count=2)
    r.close()
    assert len(log) == 1 and job[b"state"] == b"failed"
    # the older of the two dead letters; the job names the entry as the fair pull moved it
    first_entry = dead[1][1].get(b"pulled_as", dead[1][1][b"entry_id"])
    assert job[b"entry_id"] == first_entry, "the second entry rewrote the job"


# -- 15: worker metrics listen on loopback by default ---------------------------------------

def _listening(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) listening on ``port``."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, _remote, state = line.split()[1:4]
        address, hex_port = local.split(":")
        if int(hex_port, 16) == port and state == "0A":
            found.add(address)
    return found


def test_metrics_listen_on_loopback(stack: Any) -> None:
    assert _listening(stack.metrics_port) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0
