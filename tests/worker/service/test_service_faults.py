"""Faults with real processes: kill -9 of a worker, SIGSTOP past the lease, Redis restart,
a CUDA fault (simulated: no GPU here) that ends a worker.

The bar (ARCHITECTURE.md, "Nothing lost"): every request finishes or fails with a clear
error event; clients see contiguous ``seq`` with no duplicate; seeded outputs equal a run
without the fault. ``Monitor`` checks the stronger property that no event was ever
*published* twice, and the replay logs are checked element by element.
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

from protocol.codec import decode_event
from protocol.keys import Keys
from protocol.models import GenerateRequest
from protocol.sampling import SamplingParams
from tests.redis_server import RedisServer
from tests.worker.service.procs import (
    Monitor,
    Streams,
    WorkerProcess,
    assert_contiguous,
    start_all,
    tokens_of,
)

KEYS = Keys()
FAST_LEASE = ("--lease-s", "2")
FAULTY_WORKER = "tests.worker.service.faulty_worker"  # ferry worker with a simulated CUDA fault


def _requests(n: int, max_tokens: int) -> list[GenerateRequest]:
    return [
        GenerateRequest(prompt=f"The quick brown fox {i}", params=SamplingParams(
            max_tokens=max_tokens, temperature=1.0, seed=100 + i, ignore_eos=True))
        for i in range(n)
    ]


def _expected(reference: Any, requests: list[GenerateRequest]) -> dict[str, list[int]]:
    """The same requests through the in-process engine with no fault (one batch)."""
    outs = reference.llm.generate([r.prompt for r in requests], [r.params for r in requests])
    return {r.request_id: o.token_ids for r, o in zip(requests, outs, strict=True)}


def _busy_worker(r: redis.Redis, requests: list[GenerateRequest], min_events: int = 3,
                 timeout: float = 60.0) -> str:
    """The worker id of a request that is mid-generation (>= min_events streamed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for req in requests:
            rid = req.request_id
            if r.llen(KEYS.events(rid)) >= min_events and r.hget(KEYS.job(rid), "state") == \
                    b"running":
                return str(r.hget(KEYS.job(rid), "worker_id"), "utf-8")
        time.sleep(0.02)
    raise AssertionError("no request got going")


def _check_logs(r: redis.Redis, expected: dict[str, list[int]]) -> None:
    """Each replay log: element i has seq i, tokens equal the fault-free run."""
    for rid, tokens in expected.items():
        events = [decode_event(x) for x in r.lrange(KEYS.events(rid), 0, -1)]
        assert_contiguous(events)
        assert tokens_of(events) == tokens, rid


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer(appendonly=True) as srv:
        yield srv


def test_kill9_one_of_two_workers(server: RedisServer, checkpoint: str, log_dir: Path,
                                  reference: Any) -> None:
    requests = _requests(16, 200)
    expected = _expected(reference, requests)
    workers = {w: WorkerProcess(checkpoint, server.url, w, log_dir, *FAST_LEASE)
               for w in ("k1", "k2")}
    r = server.client()
    try:
        start_all(*workers.values())
        monitor = Monitor(server.url)
        monitor.start()
        streams = Streams(server.url, requests).start()
        victim = _busy_worker(r, requests)
        workers[victim].kill()
        results = streams.join()
        monitor.stop()
    finally:
        for w in workers.values():
            w.kill()
    for req in requests:
        events = results[req.request_id]
        assert_contiguous(events)
        assert tokens_of(events) == expected[req.request_id]
    assert monitor.duplicates() == {}
    _check_logs(r, expected)
    survivor = next(w for w in workers if w != victim)
    finals = {str(r.hget(KEYS.job(q.request_id), "worker_id"), "utf-8") for q in requests}
    assert finals == {survivor} or victim in finals  # the victim may have finished some
    assert r.xpending(KEYS.requests, KEYS.group)["pending"] == 0


def test_sigstop_past_lease_then_sigcont(server: RedisServer, checkpoint: str, log_dir: Path,
                                         reference: Any) -> None:
    requests = _requests(12, 250)
    expected = _expected(reference, requests)
    workers = {w: WorkerProcess(checkpoint, server.url, w, log_dir, *FAST_LEASE)
               for w in ("s1", "s2")}
    r = server.client()
    try:
        start_all(*workers.values())
        monitor = Monitor(server.url)
        monitor.start()
        streams = Streams(server.url, requests).start()
        victim = _busy_worker(r, requests)
        survivor = next(w for w in workers if w != victim)
        workers[victim].send(signal.SIGSTOP)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the survivor reclaims past the 2 s lease
            beat = workers[survivor].heartbeat()
            if beat is not None and int(beat.stats["reclaimed"]) > 0:
                break
            time.sleep(0.1)
        time.sleep(0.5)
        workers[victim].send(signal.SIGCONT)  # wakes up mid-step, holding stale leases
        results = streams.join()
        time.sleep(1.0)  # give the woken worker time to (wrongly) publish, if it would
        monitor.stop()
        assert workers[victim].proc is not None and workers[victim].proc.poll() is None
    finally:
        for w in workers.values():
            w.kill()
    for req in requests:
        assert_contiguous(results[req.request_id])
        assert tokens_of(results[req.request_id]) == expected[req.request_id]
    assert monitor.duplicates() == {}
    _check_logs(r, expected)


def test_redis_restart_under_load(server: RedisServer, checkpoint: str, log_dir: Path,
                                  reference: Any) -> None:
    requests = _requests(16, 200)
    expected = _expected(reference, requests)
    with WorkerProcess(checkpoint, server.url, "r1", log_dir, "--lease-s", "3") as worker:
        worker.wait_live()
        streams = Streams(server.url, requests).start()
        _busy_worker(server.client(), requests)
        server.restart(hard=True)  # kill -9 + start on the same port and AOF
        results = streams.join()
        assert worker.proc is not None and worker.proc.poll() is None
    r = server.client()
    for req in requests:
        events = results[req.request_id]
        assert_contiguous(events)
        final = events[-1]
        if final.finish_reason == "error":  # allowed, if it says why
            assert final.error
            continue
        assert tokens_of(events) == expected[req.request_id]
        assert r.hget(KEYS.job(req.request_id), "state") == b"done"
    done = [q.request_id for q in requests if results[q.request_id][-1].finish_reason == "length"]
    _check_logs(r, {rid: expected[rid] for rid in done})
    assert len(done) == len(requests), "a restart with AOF should lose no request"


def test_a_cuda_fault_ends_the_worker_and_its_requests_resume_elsewhere(
        server: RedisServer, checkpoint: str, log_dir: Path, reference: Any) -> None:
    """After an illegal address the CUDA context is broken: the worker must not go on
    failing batches. It exits non-zero, hands its requests back, and another worker
    resumes them from the tokens already streamed: the same seeded tokens, no gap."""
    requests = _requests(6, 120)
    expected = _expected(reference, requests)
    faulty = WorkerProcess(checkpoint, server.url, "cuda-fault", log_dir, *FAST_LEASE,
                           module=FAULTY_WORKER, env={"FERRY_TEST_FAULT_AFTER_STEPS": "30"})
    healthy = WorkerProcess(checkpoint, server.url, "healthy", log_dir, *FAST_LEASE)
    r = server.client()
    try:
        faulty.start().wait_live()
        streams = Streams(server.url, requests).start()
        assert _busy_worker(r, requests) == "cuda-fault"  # it holds them all
        healthy.start().wait_live()
        results = streams.join()
        code = faulty.wait(60)
    finally:
        faulty.kill()
        healthy.kill()
    assert code == 70, faulty.log_tail()
    lines = [json.loads(line) for line in faulty.log_path.read_text().splitlines()
             if line.startswith("{")]
    assert [e["level"] for e in lines if e.get("event") == "device_fault"] == ["error"]
    for req in requests:
        assert_contiguous(results[req.request_id])
        assert tokens_of(results[req.request_id]) == expected[req.request_id]
        assert r.hget(KEYS.job(req.request_id), "worker_id") == b"healthy"
    _check_logs(r, expected)
    assert r.xpending(KEYS.requests, KEYS.group)["pending"] == 0
