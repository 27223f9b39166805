"""Process lifecycle: SIGTERM drain and hand-back, ``ferry gateway`` without torch,
``ferry up --demo`` end to end with no process left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from protocol.keys import Keys
from protocol.models import GenerateRequest
from protocol.sampling import SamplingParams
from tests.redis_server import free_port
from tests.worker.service.procs import (
    ROOT,
    Streams,
    WorkerProcess,
    assert_contiguous,
    ferry_env,
    tokens_of,
)

KEYS = Keys()


def _requests(n: int, max_tokens: int, tag: str) -> list[GenerateRequest]:
    return [GenerateRequest(prompt=f"{tag} {i}", params=SamplingParams(
        max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True)) for i in range(n)]


def test_sigterm_hands_back_then_drains(
    redis_server: Any, redis_client: Any, checkpoint: str, log_dir: Path, reference: Any
) -> None:
    """A short drain hands unfinished work back, claimable at once (the lease is 60 s, so
    only the hand-back explains a quick pick-up); a long drain finishes in-flight work."""
    lease = ("--lease-s", "60")
    quick = WorkerProcess(checkpoint, redis_server.url, "t1", log_dir, *lease,
                          "--drain-timeout-s", "0.2")
    patient = WorkerProcess(checkpoint, redis_server.url, "t2", log_dir, *lease,
                            "--drain-timeout-s", "60")
    try:
        quick.start().wait_live()
        first = _requests(6, 300, "handback")
        streams = Streams(redis_server.url, first, timeout=90).start()
        while redis_client.llen(KEYS.events(first[0].request_id)) < 2:
            time.sleep(0.02)
        quick.send(signal.SIGTERM)
        assert quick.wait(30) == 0
        pending = redis_client.xpending_range(KEYS.requests, KEYS.group, "-", "+", 100)
        assert pending and all(p["time_since_delivered"] >= 10**9 for p in pending)
        patient.start().wait_live()  # lease 60 s: only the hand-back lets it take them now
        results = streams.join()
        beat = patient.heartbeat_after(time.time())
        assert int(beat.stats["reclaimed"]) == len(pending)
        second = _requests(4, 200, "drain")
        streams = Streams(redis_server.url, second, timeout=60).start()
        while redis_client.llen(KEYS.events(second[-1].request_id)) < 2:
            time.sleep(0.02)
        patient.send(signal.SIGTERM)
        assert patient.wait(60) == 0
        results.update(streams.join())
    finally:
        quick.kill()
        patient.kill()
    everything = first + second
    outs = reference.llm.generate([q.prompt for q in everything], [q.params for q in everything])
    for request, out in zip(everything, outs, strict=True):
        events = results[request.request_id]
        assert_contiguous(events)
        assert events[-1].finish_reason == "length"
        assert tokens_of(events) == out.token_ids
    assert not redis_client.exists(KEYS.worker("t1"), KEYS.worker("t2"))
    assert redis_client.xpending(KEYS.requests, KEYS.group)["pending"] == 0


def test_gateway_command_never_imports_torch() -> None:
    code = (
        "import sys\n"
        "import gateway.main\n"
        "gateway.main.serve = lambda *a, **k: print('torch loaded:', 'torch' in sys.modules)\n"
        "from ferry.cli import app\n"
        "app(['gateway', '--redis-url', 'redis://127.0.0.1:1/0'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, env=ferry_env(), timeout=60)
    assert "torch loaded: False" in out.stdout, out.stdout + out.stderr


def _processes_mentioning(token: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if token in cmdline:
            found.append(f"{proc.name}: {cmdline}")
    return found


@pytest.mark.parametrize("redis_args", [
    ("--workers", "2"),
    ("--workers", "1", "--redis-shards", "3", "--redis-replicas", "1"),
], ids=["one-redis", "local-cluster"])
def test_ferry_up_demo(checkpoint: str, redis_args: tuple[str, ...]) -> None:
    """The demo through ``ferry up``, on one Redis or a local 3-master Redis Cluster; then
    nothing it started is left running."""
    port = free_port()
    env = ferry_env(FERRY_KV_CACHE_BLOCKS="64")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ferry.cli", "up", "--demo", *redis_args, "--model",
         checkpoint, "--port", str(port), "--demo-max-tokens", "8"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
    )
    try:
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, stdout + stderr
    assert f"Ferry is up: http://127.0.0.1:{port}" in stdout
    assert stdout.count(">>> ") == 3
    redis_port = re.search(r"redis redis://127\.0\.0\.1:(\d+)/0", stdout)
    assert redis_port is not None
    nodes = re.search(r"cluster of 6 nodes, pids ([\d ]+)", stdout)
    if "--redis-shards" in redis_args:
        assert nodes is not None and int(redis_port[1]) <= 55535  # its bus port: + 10000
    time.sleep(0.5)
    leftovers = _processes_mentioning(f"up-{proc.pid}-") + \
        _processes_mentioning(f"--port {redis_port[1]} ") + \
        _processes_mentioning(f"--port {port}")
    assert leftovers == []
    for pid in (nodes[1].split() if nodes else []):  # every cluster node is gone too
        cmdline = Path(f"/proc/{pid}/cmdline")
        assert not cmdline.exists() or b"redis-server" not in cmdline.read_bytes()
