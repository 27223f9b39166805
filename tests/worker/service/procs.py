"""Test helpers: real ``ferry worker`` subprocesses, streaming clients, a pub/sub monitor.

``WorkerProcess`` runs the exact command an operator runs (``python -m ferry.cli worker
...``), logs to a file (shown when a test fails), and is always killed at teardown.
``Monitor`` PSUBSCRIBEs to every token channel and records each published event, so a
test can assert that no ``(request, seq)`` was ever published twice — a stronger check
than what a deduplicating client sees. On a Redis Cluster (``cluster=True``) token
channels are sharded, which have no pattern subscribe: ``ShardMonitor`` SSUBSCRIBEs the
channels of the requests a test is about to send.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from protocol.client import FerryClient
from protocol.cluster.keys import keys_for
from protocol.cluster.nodes import cluster_client
from protocol.codec import decode_event, decode_heartbeat
from protocol.keys import Keys
from protocol.models import GenerateRequest, TokenEvent, WorkerHeartbeat

ROOT = Path(__file__).resolve().parents[3]
WORKER_ENV = {
    "FERRY_DEVICE": "cpu",
    "FERRY_TORCH_THREADS": "1",
    "FERRY_KV_CACHE_BLOCKS": "256",
    "FERRY_LOG_JSON": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}
_LIVE: set[subprocess.Popen[bytes]] = set()


@atexit.register
def _kill_leftovers() -> None:
    for proc in list(_LIVE):
        with contextlib.suppress(OSError):
            proc.kill()


def ferry_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, **WORKER_ENV, **extra}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


class WorkerProcess:
    """``with WorkerProcess(model, url, "w1", log_dir) as w: w.wait_live()``."""

    def __init__(
        self, model: str, redis_url: str, worker_id: str, log_dir: Path, *args: str,
        env: dict[str, str] | None = None, module: str = "ferry.cli", cluster: bool = False,
    ) -> None:
        self.worker_id = worker_id
        self.redis_url = redis_url
        self.cluster = cluster
        self.log_path = log_dir / f"{worker_id}.log"
        self.cmd = [sys.executable, "-m", module, "worker", "--model", model,
                    "--redis-url", redis_url, "--worker-id", worker_id,
                    "--heartbeat-interval-s", "0.3", *(["--redis-cluster"] if cluster else []),
                    *args]
        self.env = ferry_env(**(env or {}))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, cwd=ROOT)
        _LIVE.add(self.proc)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def heartbeat(self) -> WorkerHeartbeat | None:
        r = client_for(self.redis_url, self.cluster)
        try:
            raw = r.get(keys_for(cluster=self.cluster).worker(self.worker_id))
        finally:
            r.close()
        return decode_heartbeat(raw) if raw else None

    def heartbeat_after(self, since: float, timeout: float = 30.0) -> WorkerHeartbeat:
        """The first heartbeat written after ``since`` (wall clock): its stats count what
        happened before then (a heartbeat read at once may predate it)."""
        deadline = time.monotonic() + timeout
        while (beat := self.heartbeat()) is None or beat.updated_at <= since:
            assert time.monotonic() < deadline, f"{self.worker_id}: no heartbeat after {since}"
            time.sleep(0.05)
        return beat

    def wait_live(self, timeout: float = 90.0) -> WorkerProcess:
        """Wait for the first heartbeat (model loaded, threads running)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.worker_id} exited {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            with contextlib.suppress(redis.RedisError):
                if self.heartbeat() is not None:
                    return self
            time.sleep(0.1)
        raise TimeoutError(f"{self.worker_id} not live after {timeout}s:\n{self.log_tail()}")

    def send(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        code = self.proc.wait(timeout)
        _LIVE.discard(self.proc)
        return code

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a stopped process must not linger
            self.proc.kill()
            self.proc.wait(10)
        if self.proc is not None:
            _LIVE.discard(self.proc)

    def __enter__(self) -> WorkerProcess:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.kill()


def client_for(url: str, cluster: bool = False) -> Any:
    """A plain client, or a cluster client discovering the cluster from ``url``."""
    return cluster_client(url) if cluster else redis.Redis.from_url(url)


def kill_and_time_resume(r: Any, worker: WorkerProcess, lengths: dict[str, int],
                         events_key: Callable[[str], str], timeout: float = 60) -> float:
    """``kill -9`` of ``worker``; seconds until any of its requests' replay logs grows past
    its length at the kill (``lengths``: request id -> events written): its takeover."""
    worker.kill()
    killed_at = time.monotonic()
    while time.monotonic() < killed_at + timeout:
        if any(r.llen(events_key(rid)) > n for rid, n in lengths.items()):
            return time.monotonic() - killed_at
        time.sleep(0.02)
    raise AssertionError("the killed worker's requests never resumed")


def start_all(*workers: WorkerProcess) -> None:
    """Start several workers and wait for all (they load in parallel)."""
    for w in workers:
        w.start()
    for w in workers:
        w.wait_live()


class Monitor(threading.Thread):
    """Records every event published on any ``ferry:tokens:*`` channel."""

    def __init__(self, redis_url: str) -> None:
        super().__init__(daemon=True)
        self.pubsub = redis.Redis.from_url(redis_url).pubsub()
        self.pubsub.psubscribe(Keys().tokens("*"))
        while (msg := self.pubsub.get_message(timeout=5)) is None or msg["type"] != "psubscribe":
            pass
        self.seen: dict[str, list[int]] = defaultdict(list)
        self._stop_flag = threading.Event()

    def run(self) -> None:
        while not self._stop_flag.is_set():
            msg = self.pubsub.get_message(timeout=0.1)
            if msg is not None and msg["type"] == "pmessage":
                event = decode_event(msg["data"])
                self.seen[event.request_id].append(event.seq)

    def stop(self) -> None:
        self._stop_flag.set()
        self.join(5)
        self.pubsub.close()

    def duplicates(self) -> dict[str, list[int]]:
        return {rid: seqs for rid, seqs in self.seen.items() if len(seqs) != len(set(seqs))}


class ShardMonitor(Monitor):
    """``Monitor`` on a Redis Cluster: SSUBSCRIBEs the token channels of ``request_ids``."""

    def __init__(self, redis_url: str, request_ids: list[str]) -> None:
        threading.Thread.__init__(self, daemon=True)
        self.client = cluster_client(redis_url)
        self.pubsub = self.client.pubsub()
        keys = keys_for(cluster=True)
        for rid in request_ids:
            self.pubsub.ssubscribe(keys.tokens(rid))
        confirmed = 0
        deadline = time.monotonic() + 10
        while confirmed < len(request_ids) and time.monotonic() < deadline:
            msg = self.pubsub.get_sharded_message(timeout=0.5)
            confirmed += msg is not None and msg["type"] == "ssubscribe"
        assert confirmed == len(request_ids), "not every token channel was subscribed"
        self.seen = defaultdict(list)
        self._stop_flag = threading.Event()

    def run(self) -> None:
        while not self._stop_flag.is_set():
            try:
                msg = self.pubsub.get_sharded_message(timeout=0.1)
            except redis.RedisError:  # a master failing over: its channels move
                time.sleep(0.05)
                continue
            if msg is not None and msg["type"] == "smessage":
                event = decode_event(msg["data"])
                self.seen[event.request_id].append(event.seq)

    def stop(self) -> None:
        super().stop()
        self.client.close()


class Streams:
    """Clients streaming requests on threads; ``start()`` returns once all are enqueued."""

    def __init__(self, redis_url: str, requests: list[GenerateRequest], timeout: float = 120.0,
                 cluster: bool = False):
        self.redis_url = redis_url
        self.cluster = cluster
        self.requests = requests
        self.timeout = timeout
        self.results: dict[str, list[TokenEvent]] = {}
        self.errors: list[BaseException] = []
        self._enqueued = threading.Semaphore(0)
        self._threads = [threading.Thread(target=self._one, args=(r,), daemon=True)
                         for r in requests]

    def _one(self, request: GenerateRequest) -> None:
        client = FerryClient.from_url(self.redis_url, cluster=self.cluster,
                                      reconnect_timeout_s=30.0)
        try:
            with client.subscribe(request.request_id) as sub:
                client.enqueue(request)
                self._enqueued.release()
                self.results[request.request_id] = list(sub.events(self.timeout))
        except BaseException as exc:  # re-raised by join()
            self.errors.append(exc)
            self._enqueued.release()
        finally:
            client.close()

    def start(self) -> Streams:
        for t in self._threads:
            t.start()
        for _ in self._threads:
            assert self._enqueued.acquire(timeout=60), "enqueue did not happen"
        return self

    def join(self) -> dict[str, list[TokenEvent]]:
        deadline = time.monotonic() + self.timeout + 30
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if self.errors:
            raise self.errors[0]
        hung = sum(t.is_alive() for t in self._threads)
        assert not hung, f"{hung} streams never ended"
        return self.results


def stream_all(
    redis_url: str, requests: list[GenerateRequest], timeout: float = 120.0,
    cluster: bool = False,
) -> dict[str, list[TokenEvent]]:
    return Streams(redis_url, requests, timeout, cluster).start().join()


def tokens_of(events: list[TokenEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def assert_contiguous(events: list[TokenEvent]) -> None:
    assert [e.seq for e in events] == list(range(len(events)))
    assert events[-1].is_final and not any(e.is_final for e in events[:-1])
