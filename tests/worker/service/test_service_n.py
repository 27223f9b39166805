"""n > 1 and best_of end to end: the official openai client -> gateway -> Redis -> a real
``ferry worker``; choices by index, streamed and not, and the prompt prefilled once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import openai
import pytest

from gateway.settings import GatewaySettings
from tests.gateway.server import GatewayServer
from tests.worker.service.procs import WorkerProcess

PROMPT = "def merge_sorted(left, right):\n    result = []\n    " * 3


@pytest.fixture(scope="module")
def stack(redis_server: Any, checkpoint: str, tmp_path_factory: Any) -> Iterator[Any]:
    log_dir = tmp_path_factory.mktemp("logs")
    with WorkerProcess(checkpoint, redis_server.url, "n-1", log_dir) as worker:
        worker.wait_live()
        with GatewayServer(GatewaySettings(redis_url=redis_server.url)) as gateway:
            yield SimpleNamespace(worker=worker, url=gateway.url,
                                  client=openai.OpenAI(base_url=gateway.url + "/v1",
                                                       api_key="unused", max_retries=0))


def _stats(worker: WorkerProcess) -> dict[str, Any]:
    beat = worker.heartbeat()
    return dict(beat.stats) if beat else {}


def _settled_stats(worker: WorkerProcess, timeout: float = 10.0) -> dict[str, Any]:
    """Stats from a heartbeat written after this call began, with nothing running: every
    request answered before the call is counted in it."""
    since, deadline = time.time(), time.monotonic() + timeout
    while True:
        beat = worker.heartbeat()
        if beat is not None and beat.updated_at > since and beat.stats.get("running") == 0:
            return dict(beat.stats)
        assert time.monotonic() < deadline, beat
        time.sleep(0.05)


def test_n4_not_streamed_distinct_when_sampling_identical_when_greedy(stack: Any) -> None:
    sampled = stack.client.completions.create(
        model="llama", prompt=PROMPT, n=4, max_tokens=12, temperature=1.0, seed=11)
    assert [c.index for c in sampled.choices] == [0, 1, 2, 3]
    assert len({c.text for c in sampled.choices}) > 1
    assert sampled.usage is not None and sampled.usage.completion_tokens <= 48
    greedy = stack.client.chat.completions.create(
        model="llama", messages=[{"role": "user", "content": "hi"}], n=4, max_tokens=8,
        temperature=0)
    assert len({c.message.content for c in greedy.choices}) == 1
    assert [c.finish_reason for c in greedy.choices] == [greedy.choices[0].finish_reason] * 4


def test_n4_streamed_by_index_and_prompt_prefilled_once(stack: Any) -> None:
    before = _settled_stats(stack.worker)
    chunks = stack.client.completions.create(
        model="llama", prompt=PROMPT, n=4, max_tokens=10, temperature=1.0, seed=5,
        stream=True)
    texts = ["", "", "", ""]
    finished = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert sorted(finished) == [0, 1, 2, 3] and len(set(texts)) > 1
    same = stack.client.completions.create(
        model="llama", prompt=PROMPT, n=4, max_tokens=10, temperature=1.0, seed=5)
    assert [c.text for c in same.choices] == texts  # seeded: streaming changes nothing
    after = _settled_stats(stack.worker)
    queries = int(after["prefix_cache_queries"]) - int(before["prefix_cache_queries"])
    hits = int(after["prefix_cache_hits"]) - int(before["prefix_cache_hits"])
    full = ((queries // 8) - 1) // 16 * 16  # the prompt's full blocks, in tokens
    # the first request: choices 1-3 took them from the cache; the repeat: all 4 choices
    assert queries % 8 == 0 and hits >= 7 * full > 0


def test_chat_streamed_choices(stack: Any) -> None:
    chunks = stack.client.chat.completions.create(
        model="llama", messages=[{"role": "user", "content": "hello"}], n=2, max_tokens=6,
        temperature=0, stream=True)
    roles, texts, reasons = set(), ["", ""], {}
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.delta.role:
                roles.add(choice.index)
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert roles == {0, 1} and texts[0] == texts[1] and sorted(reasons) == [0, 1]


def test_best_of(stack: Any) -> None:
    out = stack.client.completions.create(
        model="llama", prompt=PROMPT, n=2, best_of=4, max_tokens=8, temperature=1.0, seed=2)
    assert [c.index for c in out.choices] == [0, 1]
    with pytest.raises(openai.BadRequestError, match="best_of"):
        stack.client.completions.create(model="llama", prompt="x", best_of=3, stream=True)
    with pytest.raises(openai.BadRequestError, match="n"):
        stack.client.completions.create(model="llama", prompt="x", n=17)
