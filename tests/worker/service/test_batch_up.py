"""The Batch API on a real ``ferry up`` (2 workers, 2 batchers, the gateway; Redis with an
append-only file, started by the test so it can be restarted) through the official openai
SDK: a 21-line batch with a malformed line; interactive latency during a batch (measured
and printed, not asserted: ops/bench/service/batch.py is the measurement); cancel of a 300-line
batch; SIGKILL of a worker, the leasing batcher and the gateway mid-batch, and a Redis
restart mid-batch, each with exactly one result per line, equal to the line run alone;
expiry (through a second gateway with a 2 s window).
"""

from __future__ import annotations

import io
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis

from protocol.keys import Keys
from protocol.sampling import SamplingParams
from tests.redis_server import RedisServer, free_port
from tests.worker.service.procs import ROOT, ferry_env
from tests.worker.service.test_up_supervision import UpProcess

KEYS = Keys()
BATCH_ENV = {"FERRY_BATCH_LEASE_S": "1.5", "FERRY_BATCH_POLL_INTERVAL_S": "0.1",
             "FERRY_BATCH_MAX_IN_FLIGHT": "8", "FERRY_MAX_NUM_SEQS": "16",
             # entries delivered in the instant Redis dies wait out the workers' lease
             # (docs/service.md, Redis outages): 5 s instead of 30 here
             "FERRY_LEASE_S": "5"}
ENDED = ("completed", "failed", "expired", "cancelled")


class Stack:
    def __init__(self, up: UpProcess, redis_server: RedisServer, port: int) -> None:
        self.up = up
        self.redis_server = redis_server
        self.port = port
        self.redis = redis.Redis.from_url(redis_server.url)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                                    max_retries=0, timeout=60)

    def pid(self, name: str) -> int:
        return int(self.up.wait_for(rf"  {name} +pid (\d+)", 5)[1])


@pytest.fixture(scope="module")
def stack(checkpoint: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("batch-up")
    port = free_port()
    with RedisServer(appendonly=True) as redis_server:
        os.environ.update(BATCH_ENV)  # ferry up passes its environment to every child
        try:
            up = UpProcess("--redis-url", redis_server.url, "--workers", "2", "--batchers", "2",
                           "--model", checkpoint, "--port", str(port), "--metrics-port", "0",
                           log=logs / "up.log")
        finally:
            for name in BATCH_ENV:
                os.environ.pop(name)
        try:
            up.wait_for(r"Ferry is up: ", timeout=240)
            yield Stack(up, redis_server, port)
        finally:
            code = up.stop()
        assert code == 0, up.tail()


def _line(i: int, max_tokens: int = 8, prompt: str = "def f") -> str:
    body = {"prompt": f"{prompt}{i}(x):", "max_tokens": max_tokens, "temperature": 0.8,
            "seed": 1000 + i, "ignore_eos": True}
    return json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                       "body": body})


def _submit(client: openai.OpenAI, lines: list[str]) -> Any:
    source = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())),
                                 purpose="batch")
    return client.batches.create(input_file_id=source.id, endpoint="/v1/completions",
                                 completion_window="24h")


def _retrying(call: Callable[[], Any], timeout: float = 60) -> Any:
    """``call()``, retried while the gateway restarts (connection refused, 5xx)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except (openai.APIConnectionError, openai.InternalServerError):
            assert time.monotonic() < deadline, "the gateway did not come back"
            time.sleep(0.2)


def _wait(client: openai.OpenAI, batch_id: str, until: Callable[[Any], bool] | None = None,
          timeout: float = 240) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = _retrying(lambda: client.batches.retrieve(batch_id))
        if until(batch) if until else batch.status in ENDED:
            return batch
        assert time.monotonic() < deadline, f"batch stuck: {batch}"
        time.sleep(0.1)


def _rows(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    text = _retrying(lambda: client.files.content(file_id).text)
    return [json.loads(x) for x in text.splitlines()]


def _texts(rows: list[dict[str, Any]]) -> dict[str, str]:
    return {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in rows}


def test_21_lines_with_a_malformed_one(stack: Stack) -> None:
    lines = [_line(i) for i in range(20)]
    lines.insert(7, '{"custom_id": "bad", "method": "POST", "url": ')
    done = _wait(stack.client, _submit(stack.client, lines).id)
    assert done.status == "completed"
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (21, 20, 1)
    out, err = _rows(stack.client, done.output_file_id), _rows(stack.client, done.error_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(f"c{i}" for i in range(20))
    assert all(r["response"]["status_code"] == 200 for r in out)
    assert [(r["error"]["code"], r["id"].rsplit("-", 1)[1]) for r in err] == [
        ("invalid_json_line", "7")]


def test_interactive_latency_during_a_batch(stack: Stack) -> None:
    """Measured and printed: ``ops/bench/service/batch.py`` is the measurement of record."""
    model = stack.client.models.list().data[0].id

    def latency() -> float:
        start = time.perf_counter()
        stack.client.completions.create(model=model, prompt="def g(x):", max_tokens=32,
                                        temperature=0, extra_body={"ignore_eos": True})
        return time.perf_counter() - start

    idle = [latency() for _ in range(5)]
    batch = _submit(stack.client, [_line(i, 32) for i in range(200)])
    _wait(stack.client, batch.id, lambda b: b.request_counts.completed >= 8)
    busy = [latency() for _ in range(5)]
    stack.client.batches.cancel(batch.id)
    _wait(stack.client, batch.id)
    ratio = statistics.median(busy) / statistics.median(idle)
    print(f"interactive latency idle {statistics.median(idle):.3f} s, during a batch "
          f"{statistics.median(busy):.3f} s: {ratio:.2f}x")


def test_a_300_line_batch_cancels_with_its_completed_part(stack: Stack) -> None:
    batch = _submit(stack.client, [_line(i, 16) for i in range(300)])
    _wait(stack.client, batch.id, lambda b: b.request_counts.completed >= 10)
    assert stack.client.batches.cancel(batch.id).status == "cancelling"
    done = _wait(stack.client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at >= done.cancelling_at
    out, err = _rows(stack.client, done.output_file_id), _rows(stack.client, done.error_file_id)
    counts = done.request_counts
    assert (counts.completed, counts.failed) == (len(out), len(err)) and len(out) >= 10
    assert sorted(r["custom_id"] for r in out + err) == sorted(f"c{i}" for i in range(300))
    assert {r["error"]["code"] for r in err} == {"batch_cancelled"}
    deadline = time.monotonic() + 30  # nothing of it stays queued
    while any(g["lag"] or g["pending"] for g in stack.redis.xinfo_groups(
            KEYS.requests_band("low"))):
        assert time.monotonic() < deadline
        time.sleep(0.2)


def _alone(reference: Any, n: int, max_tokens: int) -> dict[str, str]:
    outs = reference.llm.generate(
        [f"def f{i}(x):" for i in range(n)],
        [SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=1000 + i,
                        ignore_eos=True) for i in range(n)])
    return {f"c{i}": outs[i].text for i in range(n)}


def test_kill_9_of_a_worker_the_batcher_and_the_gateway_mid_batch(
        stack: Stack, reference: Any) -> None:
    n, tokens = 48, 24
    batch = _submit(stack.client, [_line(i, tokens) for i in range(n)])
    _wait(stack.client, batch.id, lambda b: b.request_counts.completed >= 4)
    holder = stack.redis.get(KEYS.batch_lease(batch.id)).decode()  # up-<pid>-batcher-<i>
    victims = [stack.pid("worker-0"), stack.pid(holder.split("-", 2)[2]), stack.pid("gateway")]
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    done = _wait(stack.client, batch.id)
    assert _retrying(lambda: stack.client.batches.retrieve(batch.id)).id == batch.id
    rows = _rows(stack.client, done.output_file_id)
    assert done.status == "completed" and done.request_counts.completed == n
    assert sorted(r["custom_id"] for r in rows) == sorted(f"c{i}" for i in range(n))
    assert _texts(rows) == _alone(reference, n, tokens)  # nothing lost, nothing repeated
    assert len(list(stack.redis.scan_iter(KEYS.job(f"{batch.id}-*")))) == n  # ran once each
    for name in ("worker-0", "gateway"):
        stack.up.wait_for(rf"{name} restarted", 30)


def test_a_redis_restart_mid_batch(stack: Stack, reference: Any) -> None:
    n, tokens = 32, 24
    batch = _submit(stack.client, [_line(i, tokens) for i in range(n)])
    _wait(stack.client, batch.id, lambda b: b.request_counts.completed >= 4)
    stack.redis_server.restart(hard=True)  # kill -9; the AOF (fsync always) has it all
    done = _wait(stack.client, batch.id)
    rows = _rows(stack.client, done.output_file_id)
    assert done.status == "completed" and done.request_counts.completed == n
    assert _texts(rows) == _alone(reference, n, tokens)


def test_expiry_reports_the_lines_that_never_ran(stack: Stack, tmp_path: Path) -> None:
    port = free_port()
    env = ferry_env(FERRY_BATCH_COMPLETION_WINDOW_S="2")
    with open(tmp_path / "gateway.log", "wb") as log:
        gateway = subprocess.Popen(
            [sys.executable, "-m", "ferry.cli", "gateway", "--redis-url",
             stack.redis_server.url, "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                                   max_retries=0, timeout=60)
            batch = _retrying(lambda: _submit(client, [_line(i, 32) for i in range(200)]))
            done = _wait(client, batch.id)
            out, err = _rows(client, done.output_file_id), _rows(client, done.error_file_id)
        finally:
            gateway.terminate()
            gateway.wait(30)
    assert done.status == "expired" and done.expired_at >= done.expires_at
    assert len(out) + len(err) == 200 and len(err) == done.request_counts.failed > 0
    assert {r["error"]["code"] for r in err} == {"batch_expired"}
