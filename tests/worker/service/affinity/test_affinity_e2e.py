"""Prefix affinity end to end: two real ``ferry worker`` processes on one redis-server.

A conversation's next turn goes to the worker that served its previous turn (and is
served from its prefix cache), each worker's board and heartbeat say what it routed, a
request marked for a worker that was killed is taken by the other after the steal time
with the output of an undisturbed run, and with affinity off nothing is marked.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from protocol.affinity.router import AffinitySettings
from protocol.client import FerryClient
from protocol.keys import Keys
from protocol.models import ChatMessage, GenerateRequest, SamplingParams
from tests.worker.service.procs import WorkerProcess

KEYS = Keys()
SYSTEM = ("You answer questions about the queue: how requests are leased, how a worker "
          "that dies hands its entries back, and how the fair share is kept. ") * 2


def _turn(convo: int, turns: int, rid: str) -> GenerateRequest:
    messages = [ChatMessage(role="system", content=f"[{convo}] " + SYSTEM)]
    for t in range(turns):
        messages.append(ChatMessage(role="user", content=f"Question {t} of {convo}? " * 2))
        if t < turns - 1:
            messages.append(ChatMessage(role="assistant", content=f"Answer {t}. " * 3))
    return GenerateRequest(messages=messages, request_id=rid,
                           params=SamplingParams(max_tokens=4, temperature=0.0))


@pytest.fixture(scope="module")
def workers(redis_server: Any, checkpoint: str, tmp_path_factory: Any
            ) -> Iterator[dict[str, WorkerProcess]]:
    logs: Path = tmp_path_factory.mktemp("affinity-logs")
    procs = {w: WorkerProcess(checkpoint, redis_server.url, w, logs,
                              env={"FERRY_HEARTBEAT_TTL_S": "1.5",
                                   "FERRY_LOG_LEVEL": "debug"})  # request_timeline
             for w in ("aff-1", "aff-2")}
    for p in procs.values():
        p.start()
    try:
        for p in procs.values():
            p.wait_live()
        yield procs
    finally:
        for p in procs.values():
            p.kill()


def _client(url: str, steal_ms: int, enabled: bool = True) -> FerryClient:
    return FerryClient(redis.Redis.from_url(url), keys=KEYS,
                       affinity=AffinitySettings(enabled=enabled, steal_ms=steal_ms))


def test_next_turns_go_to_the_worker_holding_the_conversation(
        redis_server: Any, workers: dict[str, WorkerProcess]) -> None:
    client = _client(redis_server.url, steal_ms=30_000)
    holders = {}
    for convo in range(4):
        holders[convo] = client.generate(_turn(convo, 1, f"c{convo}-t1"), timeout=120).worker_id
    assert set(holders.values()) <= set(workers)
    since = time.time()
    for w in workers.values():  # each board written after the first turns
        w.heartbeat_after(since)
    for turns in (2, 3):
        for convo in range(4):
            status = client.generate(_turn(convo, turns, f"c{convo}-t{turns}"), timeout=120)
            assert status.worker_id == holders[convo], (convo, turns)
            assert status.usage is not None and status.usage.cached_tokens > 0
    assert client.router.marked == 8
    # each later turn's time to first token, in parts, in its holder's log
    timelines = {}
    for p in workers.values():
        for line in p.log_path.read_text(errors="replace").splitlines():
            if "request_timeline" in line:
                event = json.loads(line[line.index("{"):])
                timelines[event["request_id"].rsplit(":", 1)[-1]] = event
    for convo in range(4):
        for turns in (2, 3):
            event = timelines[f"c{convo}-t{turns}"]
            assert event["route"] == "affinity" and event["worker"] == holders[convo]
            assert event["cached"] > 0 and event["mark_wait_s"] is not None
            parts = [event[k] for k in ("queue_s", "prepare_s", "mailbox_s",
                                        "engine_wait_s", "prefill_s")]
            assert min(parts) >= 0 and sum(parts) == pytest.approx(event["ttft_s"], abs=2e-3)
    since = time.time()
    beats = {w: p.heartbeat_after(since).stats for w, p in workers.items()}
    assert sum(int(b["affinity_pulled"]) for b in beats.values()) == 8
    assert all(int(b["affinity_stolen"]) == 0 for b in beats.values())
    r = redis.Redis.from_url(redis_server.url)
    # every worker that served a conversation advertises it (all four may land on one)
    assert all(r.zcard(KEYS.affinity(w)) > 0 and 0 < r.pttl(KEYS.affinity(w)) <= 1500
               for w in set(holders.values()))
    # with affinity off the producer marks nothing; the request is served all the same
    off = _client(redis_server.url, 30_000, enabled=False)
    assert off.generate(_turn(0, 4, "c0-off"), timeout=120).finish_reason == "length"
    assert off.router.marked == 0


def test_a_request_marked_for_a_killed_worker_is_stolen_after_the_steal_time(
        redis_server: Any, workers: dict[str, WorkerProcess]) -> None:
    steal_ms = 800
    client = _client(redis_server.url, steal_ms=steal_ms)
    holder = client.generate(_turn(9, 1, "c9-t1"), timeout=120).worker_id
    assert holder is not None
    other = next(w for w in workers if w != holder)
    workers[holder].heartbeat_after(time.time())
    alone = client.generate(_turn(9, 2, "c9-t2-alone"), timeout=120)
    assert alone.worker_id == holder
    workers[holder].send(signal.SIGKILL)
    workers[holder].wait(10)
    start = time.monotonic()
    status = client.generate(_turn(9, 2, "c9-t2-after"), timeout=120)
    waited = time.monotonic() - start
    assert status.worker_id == other and status.text == alone.text
    assert client.router.marked >= 2  # its heartbeat had not expired yet: marked for it
    assert waited < steal_ms / 1000 + 30  # the steal bound plus its own run (a loaded CPU)
    beat = workers[other].heartbeat_after(time.time()).stats
    assert int(beat["affinity_stolen"]) >= 1
