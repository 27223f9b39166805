"""A worker's board follows its prefix cache's evictions: a real ``ferry worker`` with a
tiny KV cache on a real redis-server serves a conversation (its chunks appear on the
board), then other traffic that evicts every block of it; within a heartbeat or two the
conversation's chunks are gone from the board. Without a host tier, and with a small one
(the conversation's blocks move there first, and leave when its slots are reused).

The other traffic's prompts are shorter than one chunk, so the book never weighs them:
its backstop (a bound on the booked chunks' tokens) cannot be what drops the
conversation's chunks; only the engine's evictions can.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from protocol.affinity.chunks import CHUNK_CHARS, prefix_chunks
from protocol.affinity.router import AffinitySettings
from protocol.client import FerryClient
from protocol.keys import Keys
from protocol.models import GenerateRequest, SamplingParams
from tests.worker.service.procs import WorkerProcess

KEYS = Keys()
BLOCKS = 40  # of 16 tokens: the conversation (~28 blocks) and little more
HOST_BYTES = 1 << 17  # 16 blocks of the test model's float32 KV (more at a smaller dtype)
CONVERSATION = ("You answer questions about the queue: how requests are leased, how a worker "
                "that dies hands its entries back, and how the fair share is kept. ") * 4


@pytest.fixture(scope="module", params=[0, HOST_BYTES], ids=["device", "host-tier"])
def worker(request: Any, redis_server: Any, checkpoint: str, tmp_path_factory: Any
           ) -> Iterator[WorkerProcess]:
    logs: Path = tmp_path_factory.mktemp("evict-logs")
    proc = WorkerProcess(checkpoint, redis_server.url, f"evict-{request.param}", logs,
                         env={"FERRY_KV_CACHE_BLOCKS": str(BLOCKS),
                              "FERRY_KV_HOST_BYTES": str(request.param),
                              "FERRY_HEARTBEAT_TTL_S": "3"})
    proc.start()
    try:
        proc.wait_live()
        yield proc
    finally:
        proc.kill()


def _held(r: redis.Redis, worker: WorkerProcess, chunks: list[str]) -> int:
    scores = r.zmscore(KEYS.affinity(worker.worker_id), chunks)
    return sum(score is not None for score in scores)


def test_a_conversation_evicted_by_other_traffic_leaves_the_board(
        redis_server: Any, worker: WorkerProcess) -> None:
    client = FerryClient(redis.Redis.from_url(redis_server.url), keys=KEYS,
                         affinity=AffinitySettings(enabled=False))
    r = redis.Redis.from_url(redis_server.url)
    convo = GenerateRequest(prompt=CONVERSATION, request_id=f"{worker.worker_id}-convo",
                            params=SamplingParams(max_tokens=4, temperature=0.0))
    chunks = prefix_chunks(convo)
    assert len(chunks) == 2
    assert client.generate(convo, timeout=120).worker_id == worker.worker_id
    host_blocks = int(worker.heartbeat_after(time.time()).stats["kv_host_blocks_total"])
    assert (host_blocks > 0) == (worker.worker_id != "evict-0")
    worker.heartbeat_after(time.time())  # the beat after: the board is written after it
    assert _held(r, worker, chunks) == len(chunks)
    # other traffic, each prompt shorter than a chunk (never booked), each ~17 blocks
    # with its output: enough of them reuse every block and host slot the conversation
    # left cached
    for i in range(-(-(BLOCKS + host_blocks) // 16) + 1):
        other = GenerateRequest(prompt=f"[{i}] def fibonacci(n): a, b = 0, 1 " * 4,
                                request_id=f"{worker.worker_id}-other-{i}",
                                params=SamplingParams(max_tokens=150, ignore_eos=True))
        assert len(other.prompt or "") < CHUNK_CHARS
        assert client.generate(other, timeout=120).finish_reason == "length"
    since = time.time()
    deadline = time.monotonic() + 10
    while _held(r, worker, chunks) and time.monotonic() < deadline:
        time.sleep(0.05)
    gone_after = time.time() - since
    assert _held(r, worker, chunks) == 0
    assert gone_after < 2.0  # within a heartbeat or two (0.3 s each) on a loaded machine
    beat = worker.heartbeat_after(time.time()).stats
    assert int(beat["affinity_advertised"]) == 0
