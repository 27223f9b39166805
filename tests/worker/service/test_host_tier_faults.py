"""The KV host tier under a crash: a worker whose small device pool preempts, with a
host tier small enough to fill, is killed with SIGKILL while blocks move between the two;
a new worker resumes every request from the replay logs.

A worker's tier is its own memory, so the kill loses it with the pool: whatever was on
the host is recomputed by whoever resumes. The bar is the fault tests' one
(test_service_faults.py): no request lost, contiguous ``seq`` with none published twice,
and every request's tokens (greedy and seeded) equal the in-process engine's with a roomy
pool and no tier. The kill comes from outside once the heartbeat shows the tier full and
restoring, or from inside ``HostTier.flush`` (``swap_kill_worker``) between its copies
out and its copies in: mid-swap by construction.
"""

from __future__ import annotations

import json
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
    tokens_of,
)
from tests.worker.service.test_service_faults import FAST_LEASE, _check_logs, _expected

KEYS = Keys()
BLOCK_SIZE = 16
POOL_BLOCKS = 24  # a request ends at ~13 blocks: two or three fit, the rest preempt
HOST_BLOCKS = 6  # fewer than one preempted request's full blocks: the tier fills
SWAP_KILL_WORKER = "tests.worker.service.swap_kill_worker"
PREFIXES = ("The quick brown fox jumps over the lazy dog. " * 4,  # ~80 tokens: 5 blocks
            "Ferry serves language models. " * 5)


def _block_bytes(checkpoint: str) -> int:
    """Bytes of one KV block of the test checkpoint (float32): what the tier holds per slot."""
    cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * BLOCK_SIZE * cfg["num_key_value_heads"] * head_dim * 4


def _tier_env(checkpoint: str) -> dict[str, str]:
    return {"FERRY_KV_CACHE_BLOCKS": str(POOL_BLOCKS), "FERRY_BLOCK_SIZE": str(BLOCK_SIZE),
            "FERRY_KV_HOST_BYTES": str(HOST_BLOCKS * _block_bytes(checkpoint))}


def _requests() -> list[GenerateRequest]:
    """Two families of shared prefixes; every third request greedy, the rest seeded."""
    out = []
    for i in range(10):
        seed = 300 + i if i % 3 else None
        out.append(GenerateRequest(
            prompt=f"{PREFIXES[i % 2]}request {i}",
            params=SamplingParams(max_tokens=110 + 5 * i, ignore_eos=True,
                                  temperature=0.0 if seed is None else 1.0, seed=seed)))
    return out


def _tier_busy(worker: WorkerProcess, timeout: float = 60.0) -> dict[str, Any]:
    """Heartbeat stats once the tier is full and has restored blocks under preemption."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        beat = worker.heartbeat()
        stats = beat.stats if beat is not None else {}
        if (int(stats.get("kv_host_blocks_cached", 0)) == HOST_BLOCKS
                and int(stats.get("prefix_cache_host_hits", 0)) > 0
                and int(stats.get("preemptions", 0)) > 0):
            return dict(stats)
        assert worker.proc is not None and worker.proc.poll() is None, worker.log_tail()
        time.sleep(0.05)
    raise AssertionError(f"the host tier never filled and restored: {worker.log_tail()}")


def _unfinished(r: redis.Redis, requests: list[GenerateRequest]) -> list[str]:
    """Requests whose replay log has no final event yet."""
    left = []
    for req in requests:
        last = r.lindex(KEYS.events(req.request_id), -1)
        if last is None or not decode_event(last).is_final:
            left.append(req.request_id)
    return left


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer(appendonly=True) as srv:
        yield srv


@pytest.mark.parametrize("kill", ["outside", "in_flush"])
def test_kill_mid_swap_with_a_full_host_tier(server: RedisServer, checkpoint: str,
                                             log_dir: Path, reference: Any, kill: str) -> None:
    requests = _requests()
    expected = _expected(reference, requests)
    env = _tier_env(checkpoint)
    in_flush = kill == "in_flush"
    victim = WorkerProcess(checkpoint, server.url, "swap-1", log_dir, *FAST_LEASE,
                           module=SWAP_KILL_WORKER if in_flush else "ferry.cli",
                           env={**env, "FERRY_TEST_SWAP_KILL": "1"} if in_flush else env)
    heir = WorkerProcess(checkpoint, server.url, "swap-2", log_dir, *FAST_LEASE, env=env)
    r = server.client()
    try:
        victim.start().wait_live()
        assert int(victim.heartbeat().stats["kv_host_blocks_total"]) == HOST_BLOCKS  # type: ignore[union-attr]
        monitor = Monitor(server.url)
        monitor.start()
        streams = Streams(server.url, requests).start()
        if in_flush:
            assert victim.wait(90) == -9, victim.log_tail()  # killed itself inside a flush
        else:
            _tier_busy(victim)
            victim.kill()
        cut = _unfinished(r, requests)
        assert cut, "every request ended before the kill: nothing was mid-flight"
        assert any(r.llen(KEYS.events(rid)) > 1 for rid in cut), "no request had streamed"
        heir.start().wait_live()
        results = streams.join()
        monitor.stop()
        heir_stats = heir.heartbeat_after(time.time()).stats
    finally:
        victim.kill()
        heir.kill()
    for req in requests:
        assert_contiguous(results[req.request_id])
        assert results[req.request_id][-1].finish_reason == "length"
        assert tokens_of(results[req.request_id]) == expected[req.request_id], req.request_id
    assert monitor.duplicates() == {}
    _check_logs(r, expected)
    assert {r.hget(KEYS.job(rid), "worker_id") for rid in cut} == {b"swap-2"}
    assert r.xpending(KEYS.requests, KEYS.group)["pending"] == 0
    # the heir runs with the same tier; whether it swaps depends on how much the kill left
    # it (a loaded machine lets the victim finish more first), so only its size is checked
    assert int(heir_stats["kv_host_blocks_total"]) == HOST_BLOCKS
