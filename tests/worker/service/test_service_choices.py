"""n > 1 and best_of through the worker service and the Redis protocol (in-process worker,
real redis-server): per-choice events, the terminal event's choices, the job hash, a
resume that continues every choice from the replay log."""

from __future__ import annotations

from typing import Any

import pytest

from protocol.client import FerryClient
from protocol.codec import encode_event
from protocol.keys import Keys
from protocol.models import GenerateRequest, TokenEvent
from protocol.sampling import SamplingParams
from tests.worker.service.procs import assert_contiguous
from tests.worker.service.test_service_inprocess import Running

KEYS = Keys()


def _stream(client: FerryClient, request: GenerateRequest) -> list[TokenEvent]:
    with client.subscribe(request.request_id) as sub:
        client.enqueue(request)
        return list(sub.events(timeout=60))


def _texts(events: list[TokenEvent], n: int) -> list[str]:
    return ["".join(e.text for e in events if e.index == i) for i in range(n)]


def test_streamed_choices(engine: Any, client: FerryClient, redis_server: Any,
                          reference: Any) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
    request = GenerateRequest(prompt="import os", params=params)
    with Running(engine, redis_server.url):
        events = _stream(client, request)
    assert_contiguous(events)
    final = events[-1]
    assert final.finish_reason == "length" and final.choices is not None
    assert [(c.index, c.finish_reason, c.completion_tokens) for c in final.choices] == \
        [(0, "length", 10), (1, "length", 10), (2, "length", 10)]
    assert all(c.text is None for c in final.choices)  # streamed already
    ends = [e for e in events if e.choice_finish_reason is not None]
    assert sorted(e.index for e in ends) == [0, 1, 2]
    texts = _texts(events, 3)
    assert texts[0] == reference.run("import os", params.model_copy(update={"n": 1}))[1]
    assert final.usage is not None and final.usage.completion_tokens == 30
    status = client.result(request.request_id)
    assert status is not None and status.choices is not None
    assert [c.text for c in status.choices] == texts and status.text == texts[0]


def test_unstreamed_choices_and_best_of(engine: Any, client: FerryClient,
                                        redis_server: Any) -> None:
    plain = GenerateRequest(prompt="class A:", stream=False,
                            params=SamplingParams(n=2, temperature=0, max_tokens=6))
    best = GenerateRequest(prompt="class A:", stream=False, params=SamplingParams(
        n=2, best_of=4, temperature=1.0, seed=3, max_tokens=6))
    with Running(engine, redis_server.url):
        plain_events = _stream(client, plain)
        best_events = _stream(client, best)
    [only] = plain_events  # nothing but the terminal event
    assert only.choices is not None and [c.index for c in only.choices] == [0, 1]
    assert only.choices[0].text == only.choices[1].text and only.choices[0].token_ids
    [final] = best_events
    assert final.choices is not None and len(final.choices) == 2
    scores = [c.cumulative_logprob for c in final.choices]
    assert scores[0] is not None and scores[1] is not None and scores[0] >= scores[1]
    assert final.usage is not None and final.usage.completion_tokens == 4 * 6  # all candidates


def test_best_of_cannot_stream() -> None:
    with pytest.raises(ValueError, match="stream"):
        GenerateRequest(prompt="x", params=SamplingParams(n=1, best_of=3))


def test_resume_continues_each_choice(engine: Any, client: FerryClient,
                                      redis_server: Any) -> None:
    """A crashed worker streamed choice 0's first 2 tokens and all of choice 1: the next
    worker continues choice 0 and runs choice 2, and skips choice 1."""
    params = SamplingParams(n=3, temperature=1.0, seed=21, max_tokens=8, ignore_eos=True)
    full = GenerateRequest(prompt="def f(x):", params=params)
    with Running(engine, redis_server.url):
        whole = _stream(client, full)
    texts, ids = _texts(whole, 3), [[t for e in whole if e.index == i for t in e.token_ids]
                                    for i in range(3)]
    again = GenerateRequest(prompt="def f(x):", params=params)
    rid = again.request_id
    client.enqueue(again)
    fake = [TokenEvent(request_id=rid, seq=0, token_ids=ids[0][:2], index=0),
            TokenEvent(request_id=rid, seq=1, token_ids=ids[1], index=1,
                       choice_finish_reason="length")]
    for event in fake:
        client.redis.rpush(KEYS.events(rid), encode_event(event))
    with Running(engine, redis_server.url):
        resumed = list(client.stream(rid, timeout=60))
    events = fake + [e for e in resumed if e.seq >= 2]
    assert_contiguous(events)
    got = [[t for e in events if e.index == i for t in e.token_ids] for i in range(3)]
    assert got == ids
    assert not any(e.index == 1 for e in resumed if e.seq >= 2 and e.token_ids)
    assert _texts(events, 3)[2] == texts[2]
