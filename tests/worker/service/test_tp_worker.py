"""A tensor-parallel worker in the fleet: ``ferry worker --tensor-parallel-size 2`` (rank 0
and a spawned rank 1 on gloo) beside a worker of size 1 serves seeded streams identical to
one process's; ``kill -9`` of its rank 1 makes the whole worker exit within 30 s with a
log line naming the lost rank, and its requests resume on the other worker, identical."""

from __future__ import annotations

import json
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
    Streams,
    WorkerProcess,
    assert_contiguous,
    start_all,
    tokens_of,
)

KEYS = Keys()
FAST_TAKEOVER = ("--lease-s", "60", "--heartbeat-ttl-s", "1.5")


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


def _worker_of(r: redis.Redis, rid: str) -> tuple[str, str]:
    state, worker = r.hmget(KEYS.job(rid), "state", "worker_id")
    return (state or b"").decode(), (worker or b"").decode()


def _follower_pid(worker: WorkerProcess) -> int:
    """Rank 1's pid, from the worker's ``tensor_parallel_started`` log line."""
    for line in worker.log_path.read_text(errors="replace").splitlines():
        if "tensor_parallel_started" in line:
            return int(json.loads(line[line.index("{"):])["follower_pids"][0])
    raise AssertionError(f"no tensor_parallel_started line:\n{worker.log_tail()}")


def _held_mid_stream(r: redis.Redis, requests: list[GenerateRequest], worker: str
                     ) -> dict[str, int]:
    """request id -> events so far, for ``worker``'s running requests a few tokens in."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        held = {q.request_id: r.llen(KEYS.events(q.request_id)) for q in requests
                if _worker_of(r, q.request_id) == ("running", worker)}
        if held and min(held.values()) >= 3:
            return held
        time.sleep(0.02)
    raise AssertionError(f"{worker} got no request going")


def _lose_rank_1(server: RedisServer, checkpoint: str, log_dir: Path, reference: Any,
                 sig: int, timeout_s: float, idle_s: float = 0.0) -> tuple[int, float]:
    """Stream seeded requests to a size-2 worker (a size-1 one paused until they are
    taken), send ``sig`` to its rank 1 mid-stream; check every stream equals one
    process's and the requests it held finished on the other worker. Returns the size-2
    worker's exit code and seconds from the signal to its exit."""
    requests = [GenerateRequest(prompt=f"The quick brown fox {i}", params=SamplingParams(
        max_tokens=400, temperature=1.0, seed=11 + i, ignore_eos=True)) for i in range(4)]
    outs = reference.llm.generate([q.prompt for q in requests], [q.params for q in requests])
    expected = {q.request_id: o.token_ids for q, o in zip(requests, outs, strict=True)}
    tp2 = WorkerProcess(checkpoint, server.url, "tp2", log_dir, *FAST_TAKEOVER,
                        "--tensor-parallel-size", "2",
                        env={"FERRY_TORCH_THREADS": "2",
                             "FERRY_TENSOR_PARALLEL_TIMEOUT_S": str(timeout_s)})
    tp1 = WorkerProcess(checkpoint, server.url, "tp1", log_dir, *FAST_TAKEOVER)
    r = server.client()
    try:
        start_all(tp2, tp1)
        time.sleep(idle_s)  # an idle worker's follower waits longer than the timeout
        os.kill(tp1.pid, signal.SIGSTOP)  # the size-2 worker takes every request first
        try:
            streams = Streams(server.url, requests).start()
            held = _held_mid_stream(r, requests, "tp2")
        finally:
            os.kill(tp1.pid, signal.SIGCONT)
        os.kill(_follower_pid(tp2), sig)
        signalled_at = time.monotonic()
        code = tp2.wait(30)
        exited_after = time.monotonic() - signalled_at
        results = streams.join()
    finally:
        tp2.kill()
        tp1.kill()
    print(f"tp2 exited {code} {exited_after:.2f} s after signal {sig} to rank 1; "
          f"{len(held)} of its requests resumed on tp1")
    assert "tensor_parallel_rank_lost" in tp2.log_path.read_text(), tp2.log_tail()
    for q in requests:
        assert_contiguous(results[q.request_id])
        assert tokens_of(results[q.request_id]) == expected[q.request_id], q.request_id
    for rid in held:  # every request it held finished on the other worker
        assert _worker_of(r, rid)[1] == "tp1"
    return code, exited_after


def test_kill_9_of_rank_1_ends_the_worker_and_its_requests_resume_identical(
        server: RedisServer, checkpoint: str, log_dir: Path, reference: Any) -> None:
    code, exited_after = _lose_rank_1(server, checkpoint, log_dir, reference,
                                      signal.SIGKILL, 30.0)
    assert code == 70
    assert exited_after <= 30


def test_a_hung_rank_1_ends_the_worker_within_the_collective_timeout(
        server: RedisServer, checkpoint: str, log_dir: Path, reference: Any) -> None:
    """SIGSTOP of rank 1: the next step's collective times out (3 s here), the worker
    exits and the stopped rank is killed with it; idle longer than the timeout first."""
    code, exited_after = _lose_rank_1(server, checkpoint, log_dir, reference,
                                      signal.SIGSTOP, 3.0, idle_s=4.0)
    assert code == 70
    assert exited_after <= 30
