"""Workers sharing a host network never collide on the metrics port, and say which they got.

Compose scales workers from one service definition, so under ``network_mode: host`` every
replica asks for the same ``--metrics-port``; a worker whose port was taken used to stop
at start, and under ``restart: unless-stopped`` it crash-looped. Now it takes the next free
port, logs it and puts it in its heartbeat; its health file (``FERRY_HEALTH_FILE``) is the
port-free liveness check the container runs instead.
"""

from __future__ import annotations

import os
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.redis_server import RedisServer, free_port
from tests.worker.service.procs import WorkerProcess, start_all
from worker.service.metrics.prometheus import WorkerMetrics


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def test_a_taken_port_moves_to_the_next_free_one() -> None:
    port = free_port()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        bound = WorkerMetrics().serve(port)
    # the next free one: port + 1 unless something took it meanwhile (seen once in CI)
    assert port < bound <= port + 8, (port, bound)
    assert "ferry_worker_" in _scrape(bound)
    assert WorkerMetrics().serve(0) == 0


def test_every_port_taken_is_a_clear_error() -> None:
    port = free_port()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        with pytest.raises(OSError, match=f"metrics: ports {port}-{port} are taken"):
            WorkerMetrics().serve(port, tries=1)


def test_two_workers_asking_for_one_port_both_serve_and_beat(
        server: RedisServer, checkpoint: str, log_dir: Path) -> None:
    port = free_port()
    health = {w: log_dir / f"{w}.health" for w in ("p1", "p2")}
    workers = [WorkerProcess(checkpoint, server.url, w, log_dir, "--metrics-port", str(port),
                             env={"FERRY_HEALTH_FILE": str(health[w])}) for w in health]
    try:
        start_all(*workers)
        beats = [w.heartbeat() for w in workers]
        ports = sorted(int(b.stats["metrics_port"]) for b in beats if b is not None)
        assert len(ports) == 2 and ports[0] == port and ports[1] > port
        for bound in ports:
            assert "ferry_worker_" in _scrape(bound)
        before = {w: os.path.getmtime(path) for w, path in health.items()}
        time.sleep(1.0)  # the workers beat every 0.3 s
        assert all(os.path.getmtime(path) > before[w] for w, path in health.items())
        assert all(w.proc is not None and w.proc.poll() is None for w in workers)
    finally:
        for w in workers:
            w.kill()
