"""Which workers advertise on the affinity board: only those whose engine keeps a prefix
cache, and only with ``FERRY_PREFIX_AFFINITY`` on. A worker without a prefix cache holds no
prefix, so a producer steering a conversation to it would only delay the request."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from worker.service.affinity.board_writer import BoardWriter
from worker.service.affinity.setup import affinity_board
from worker.service.metrics.prometheus import WorkerMetrics
from worker.service.redis.connection import WorkerSettings


class _Engine:
    """What ``affinity_board`` reads of an engine: its cache config, its stats and the
    switch that starts the eviction list."""

    def __init__(self, prefix_caching: bool) -> None:
        self.config = SimpleNamespace(cache=SimpleNamespace(
            enable_prefix_caching=prefix_caching, block_size=16))
        self.tracking = False

    def stats(self) -> Any:
        return SimpleNamespace(kv_blocks_total=64, kv_host_blocks_total=0)

    def track_evictions(self) -> None:
        self.tracking = True


@pytest.mark.parametrize("switch", ["1", "0"])
def test_a_worker_with_a_prefix_cache_advertises_when_affinity_is_on(
        monkeypatch: pytest.MonkeyPatch, switch: str) -> None:
    monkeypatch.setenv("FERRY_PREFIX_AFFINITY", switch)
    engine = _Engine(prefix_caching=True)
    board = affinity_board(engine, WorkerSettings(), WorkerMetrics())
    assert isinstance(board, BoardWriter) == (switch == "1")
    assert engine.tracking == (switch == "1")


def test_a_worker_without_a_prefix_cache_advertises_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_PREFIX_AFFINITY", "1")
    engine = _Engine(prefix_caching=False)
    assert affinity_board(engine, WorkerSettings(), WorkerMetrics()) is None
    assert not engine.tracking
