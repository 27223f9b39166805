"""Entries handed back by someone else (``ferry up`` reaping a dead process, or another
worker's reaper) are claimed at this reaper's next liveness scan, not at its next
scheduled pass: the fleet's ``handbacks`` counter says a pass is due."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from protocol.client import FerryClient
from protocol.models import GenerateRequest, SamplingParams
from protocol.store import ensure_group
from protocol.tenants import fair
from tests.redis_server import RedisServer
from worker.service.intake.reaper import Reaper
from worker.service.redis.connection import WorkerSettings
from worker.service.redis.leases import hand_back_consumer
from worker.service.redis.shard_gate import ShardGate


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


def test_a_hand_back_elsewhere_makes_the_next_pass_due(server: RedisServer) -> None:
    settings = WorkerSettings(redis_url=server.url, worker_id="survivor", lease_s=60.0,
                              heartbeat_interval_s=0.0)  # a liveness scan on every run
    r = server.client()
    keys = settings.keys
    ensure_group(r, keys)
    FerryClient(r).enqueue(GenerateRequest(prompt="hello", params=SamplingParams(max_tokens=2)))
    [(entry_id, _)], _ = fair.pull(r, keys.requests, keys.group, "dead", 1)
    claimed: list[Any] = []
    reaper = Reaper(settings, r, ShardGate(settings),
                    lambda stream, entries, deliveries: claimed.extend(entries))
    assert reaper.run(8) == 0  # the first pass: nothing idle past the 60 s lease
    assert reaper.run(8) == 0  # the next pass is a reap interval (5 s) away
    assert hand_back_consumer(r, keys, "dead") == 1  # as ``ferry up`` does for a dead pid
    assert reaper.run(8) == 1
    assert [e[0] for e in claimed] == [entry_id]
    assert reaper.run(8) == 0  # one due pass per hand-back, not a pass on every run
