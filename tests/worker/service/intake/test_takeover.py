"""A dead worker's requests move within its heartbeat TTL; a live, slow one keeps its own.

Without ``ferry up``'s supervisor nobody knows that a container was killed, so the
requests it held used to wait out the lease (30 s by default). Now the heartbeat key's TTL
is the worker's liveness: the survivors hand back the entries of a consumer that has
neither a heartbeat nor touched the stream for that long, and resume them. The lease stays
60 s in both tests, so only the liveness check can explain a fast takeover.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from protocol.keys import Keys
from protocol.models import GenerateRequest
from protocol.sampling import SamplingParams
from tests.redis_server import RedisServer
from tests.worker.service.procs import (
    Monitor,
    Streams,
    WorkerProcess,
    assert_contiguous,
    kill_and_time_resume,
    start_all,
    tokens_of,
)
from worker.models import default_model_path

KEYS = Keys()
LONG_LEASE = ("--lease-s", "60")


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


def _job(r: redis.Redis, rid: str) -> tuple[str, str]:
    state, worker = r.hmget(KEYS.job(rid), "state", "worker_id")
    return (state or b"").decode(), (worker or b"").decode()


def test_killed_workers_requests_resume_within_its_heartbeat_ttl(
        server: RedisServer, checkpoint: str, log_dir: Path, reference: Any) -> None:
    requests = [GenerateRequest(prompt=f"The quick brown fox {i}", params=SamplingParams(
        max_tokens=160, temperature=1.0, seed=7 + i, ignore_eos=True)) for i in range(6)]
    outs = reference.llm.generate([q.prompt for q in requests], [q.params for q in requests])
    expected = {q.request_id: o.token_ids for q, o in zip(requests, outs, strict=True)}
    ttl = ("--heartbeat-ttl-s", "1.5")
    workers = {w: WorkerProcess(checkpoint, server.url, w, log_dir, *LONG_LEASE, *ttl)
               for w in ("t1", "t2")}
    r = server.client()
    try:
        start_all(*workers.values())
        monitor = Monitor(server.url)
        monitor.start()
        streams = Streams(server.url, requests).start()
        held = _held_mid_stream(r, requests)
        victim = _job(r, held[0])[1]
        lengths = {rid: r.llen(KEYS.events(rid)) for rid in held
                   if _job(r, rid)[1] == victim}
        resumed_after = kill_and_time_resume(r, workers[victim], lengths, KEYS.events)
        results = streams.join()
        monitor.stop()
    finally:
        for w in workers.values():
            w.kill()
    print(f"takeover: the killed worker's streams resumed {resumed_after:.2f} s after kill -9")
    assert resumed_after < 30, "waited for the 60 s lease, not the 1.5 s heartbeat TTL"
    for q in requests:
        assert_contiguous(results[q.request_id])
        assert tokens_of(results[q.request_id]) == expected[q.request_id]
    assert monitor.duplicates() == {}
    survivor = next(w for w in workers if w != victim)
    assert {_job(r, rid)[1] for rid in lengths} == {survivor}


def _held_mid_stream(r: redis.Redis, requests: list[GenerateRequest]) -> list[str]:
    """Ids of running requests with a few events streamed (each worker holds some)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        running = [q.request_id for q in requests if r.llen(KEYS.events(q.request_id)) >= 5
                   and _job(r, q.request_id)[0] == "running"]
        if running:
            return running
        time.sleep(0.02)
    raise AssertionError("no request got going")


def test_live_worker_in_long_steps_is_never_robbed(server: RedisServer, log_dir: Path) -> None:
    """A full worker (its intake stops reading, so the group sees it idle) with a ~0.7 s
    prefill step, against a 0.3 s heartbeat TTL: the control thread beats on its own, so
    an idle second worker must take nothing from the busy one."""
    prompt = "def f(x):\n    return x + 1\n" * 120  # ~1300 tokens: one long prefill step
    requests = [GenerateRequest(prompt=prompt + f"# {i}\n", params=SamplingParams(
        max_tokens=600, temperature=0.0, ignore_eos=True)) for i in range(4)]
    fast_beats = ("--heartbeat-interval-s", "0.1", "--heartbeat-ttl-s", "0.3")
    env = {"FERRY_MAX_NUM_BATCHED_TOKENS": "8192", "FERRY_KV_CACHE_BLOCKS": "600",
           "FERRY_TORCH_THREADS": "1"}
    model = default_model_path()  # 2048 tokens of context
    busy = WorkerProcess(model, server.url, "busy", log_dir, *LONG_LEASE, *fast_beats,
                         "--max-num-seqs", "4", env=env)
    idle = WorkerProcess(model, server.url, "idle", log_dir, *LONG_LEASE, *fast_beats)
    r = server.client()
    try:
        # Both load together; the idle one is paused while the busy one takes all four
        # (its intake only wakes on XREAD and pulls with a script, so a paused process
        # pulls nothing), then resumes at once: no race against a worker's start-up time.
        start_all(busy, idle)
        os.kill(idle.pid, signal.SIGSTOP)
        try:
            streams = Streams(server.url, requests).start()
            deadline = time.monotonic() + 60
            while not all(_job(r, q.request_id)[0] in ("running", "done") for q in requests):
                assert time.monotonic() < deadline, "the busy worker did not start all four"
                time.sleep(0.01)
        finally:
            resumed = time.time()
            os.kill(idle.pid, signal.SIGCONT)
        # idle, with room, scanning for dead consumers every 0.1 s; three scans later
        # the busy worker must still be decoding, or the test proved nothing
        idle.heartbeat_after(resumed + 0.3)
        assert any(_job(r, q.request_id)[0] == "running" for q in requests), "too late"
        results = streams.join()
        idle_beat = idle.heartbeat()
    finally:
        busy.kill()
        idle.kill()
    assert idle_beat is not None and int(idle_beat.stats["reclaimed"]) == 0
    for q in requests:
        assert _job(r, q.request_id)[1] == "busy"
        events = results[q.request_id]
        assert_contiguous(events)
        assert sum(len(e.token_ids) for e in events) == 600
    assert r.xlen(KEYS.dead_letter) == 0
