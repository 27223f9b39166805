"""``ferry up`` supervises: ``kill -9`` of one of two workers while 16 seeded streams run
through the official openai client; all 16 finish identical to a crash-free run, the dead
worker's entries are handed back at once, a replacement comes up under a fresh consumer
name on the same metrics port, ``ferry top`` shows the restart, and the stack stops clean.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
import redis

from ferry.commands import top as top_cmd
from protocol.keys import Keys
from protocol.sampling import SamplingParams
from tests.ferry.gateway_proc import children_of, listening_pids
from tests.redis_server import free_port
from tests.worker.service.procs import ROOT, ferry_env
from tests.worker.service.test_service_lifecycle import _processes_mentioning

KEYS = Keys()
N, MAX_TOKENS = 16, 96
WORKER_LINE = re.compile(r"worker-(\d+)  pid (\d+), id (\S+), metrics (http://\S+/metrics)")


class UpProcess:
    """``ferry up`` as a user runs it; every output line kept (and mirrored to a file)."""

    def __init__(self, *args: str, log: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ferry.cli", "up", *args], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=ferry_env(),
        )
        self.lines: list[str] = []
        self._log = log
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with open(self._log, "a") as log:
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                log.write(line)
                log.flush()

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if (match := re.search(pattern, line)) is not None:
                    return match
            assert self.proc.poll() is None, "ferry up exited:\n" + self.tail()
            time.sleep(0.1)
        raise AssertionError(f"no {pattern!r} after {timeout}s:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.lines[-n:])

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._reader.join(10)
        return code


def _metrics_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status == 200 and b"ferry_worker_output_tokens_total" in resp.read()


def _stream(client: openai.OpenAI, model: str, i: int, out: dict[int, Any],
            chunks: list[int]) -> None:
    try:
        stream = client.completions.create(
            model=model, prompt=f"The quick brown fox {i}", max_tokens=MAX_TOKENS,
            temperature=1.0, seed=100 + i, stream=True, extra_body={"ignore_eos": True})
        text, finish = "", None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
                chunks[i] += 1
        out[i] = (text, finish)
    except Exception as exc:  # reported by the main thread
        out[i] = exc


def _wait_ready(port: int, workers: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as resp:
                if f'"workers":{workers}' in resp.read().decode().replace(" ", ""):
                    return
        except OSError:
            pass  # restarting, or 503 until enough workers beat
        assert time.monotonic() < deadline, f"not ready with {workers} workers"
        time.sleep(0.2)


def _pending_of(r: redis.Redis, consumer: str) -> int:
    for row in r.xinfo_consumers(KEYS.requests, KEYS.group):
        if row["name"].decode() == consumer:
            return int(row["pending"])
    return 0


def test_ferry_up_survives_kill_9_of_a_worker(checkpoint: str, reference: Any,
                                              tmp_path: Path) -> None:
    port = free_port()
    up = UpProcess("--workers", "2", "--model", checkpoint, "--port", str(port),
                   log=tmp_path / "up.log")
    try:
        up.wait_for(r"Ferry is up: ", timeout=240)
        redis_url = up.wait_for(r"redis (redis://127\.0\.0\.1:\d+/0)", 5)[1]
        slots: dict[int, Any] = {}
        for i in range(2):
            slots[i] = WORKER_LINE.search(up.wait_for(rf"worker-{i}  pid.*", 5)[0])
            assert slots[i] is not None, up.tail()
        assert all(_metrics_ok(m[4]) for m in slots.values())  # issue 14 item 14
        victim_pid, victim_id, victim_metrics = int(slots[0][2]), slots[0][3], slots[0][4]
        r = redis.Redis.from_url(redis_url)

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        results: dict[int, Any] = {}
        chunks = [0] * N
        threads = [threading.Thread(target=_stream, args=(client, model, i, results, chunks))
                   for i in range(N)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120  # kill while the victim has work in flight
        while not (_pending_of(r, victim_id) > 0 and sum(chunks) >= N):
            assert time.monotonic() < deadline, f"no work reached {victim_id}: {chunks}"
            time.sleep(0.02)
        os.kill(victim_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        for t in threads:
            t.join(300)
        ended_after = time.monotonic() - killed_at
        assert not any(t.is_alive() for t in threads), f"streams never ended: {chunks}"

        expected = reference.llm.generate(
            [f"The quick brown fox {i}" for i in range(N)],
            [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=100 + i,
                            ignore_eos=True) for i in range(N)])
        for i in range(N):
            assert not isinstance(results[i], Exception), results[i]
            assert results[i] == (expected[i].text, "length"), i

        died = up.wait_for(rf"worker-0 \(pid {victim_pid}\) exited with code -9 \(SIGKILL\)"
                           r"(.*handed back (\d+) entr)?", 30)
        # ferry up hands the dead worker's entries back at once, unless the survivor's
        # reaper (its heartbeat gone) already did: either way none waits out the lease
        assert died[2] is None or int(died[2]) > 0, up.tail()
        assert ended_after < 30.0, f"streams ended {ended_after:.1f} s after the kill"
        up.wait_for(r"worker-0 restarted \(pid \d+, restart 1\)", 30)
        replacement = f"{victim_id}-r1"  # a fresh consumer name per incarnation
        deadline = time.monotonic() + 120
        while not r.exists(KEYS.worker(replacement)):
            assert time.monotonic() < deadline, up.tail()
            time.sleep(0.2)
        assert _metrics_ok(victim_metrics)  # the replacement serves the same metrics port

        gateway_pid = int(up.wait_for(r"gateway   pid (\d+)", 5)[1])  # the gateway too
        os.kill(gateway_pid, signal.SIGKILL)
        up.wait_for(rf"gateway \(pid {gateway_pid}\) exited with code -9", 30)
        up.wait_for(r"gateway restarted \(pid \d+, restart 1\)", 30)
        _wait_ready(port, workers=2)
        snap = top_cmd.collect(r, KEYS)  # what `ferry top` shows
        assert sorted(w.worker_id for w in snap.workers) == sorted([replacement, slots[1][3]])
        assert [(x.process, x.restarts, x.last_exit, x.current) for x in snap.restarts] == \
            [("gateway", 1, -9, "gateway"), ("worker-0", 1, -9, replacement)]
        after = client.completions.create(model=model, prompt="def add(a, b):", max_tokens=8,
                                          temperature=0)
        assert after.choices[0].text == reference.run("def add(a, b):", SamplingParams(
            max_tokens=8, temperature=0))[1]
        assert r.xpending(KEYS.requests, KEYS.group)["pending"] == 0
        r.close()
    finally:
        code = up.stop()
    assert code == 0, up.tail()
    time.sleep(0.5)
    assert _processes_mentioning(f"up-{up.proc.pid}-") == []
    assert _processes_mentioning(f"--port {port}") == []


def test_redis_dying_is_the_one_fatal_exit(checkpoint: str, tmp_path: Path) -> None:
    """Also ``--gateways 2``: two gateway processes on the port, gone with the stack."""
    port = free_port()
    up = UpProcess("--workers", "1", "--gateways", "2", "--model", checkpoint,
                   "--port", str(port), log=tmp_path / "up.log")
    try:
        up.wait_for(r"Ferry is up: ", timeout=240)
        gateway_pid = int(up.wait_for(r"gateway   pid (\d+), 2 process\(es\)", 5)[1])
        deadline = time.monotonic() + 60
        while len(servers := children_of(gateway_pid) & listening_pids(port)) < 2:
            assert time.monotonic() < deadline, servers
            time.sleep(0.1)
        redis_pid, redis_port = map(int, up.wait_for(
            r"redis     pid (\d+), redis://127\.0\.0\.1:(\d+)/0", 5).groups())
        assert _processes_mentioning(f"127.0.0.1:{redis_port}")  # redis-server's title
        os.kill(redis_pid, signal.SIGKILL)
        code = up.proc.wait(120)
    finally:
        up.stop()
    assert code == 1, up.tail()
    error = up.wait_for(r"error: redis \(pid \d+\) exited with code -9 \(SIGKILL\).*", 5)[0]
    assert "ferry up does not restart it" in error and "the stack stops" in error
    assert not any("restarting in" in line for line in up.lines)  # nothing else restarted
    time.sleep(0.5)
    assert _processes_mentioning(f"up-{up.proc.pid}-") == []
    assert _processes_mentioning(f"--port {port}") == []
    assert _processes_mentioning(f"127.0.0.1:{redis_port}") == []
    assert not any(Path(f"/proc/{pid}").exists() for pid in servers | {gateway_pid})


def test_a_child_failing_before_ready_fails_fast(tmp_path: Path) -> None:
    """A bad flag or model path is not a crash loop to wait out: exit 1 with the reason."""
    port = free_port()
    up = UpProcess("--model", str(tmp_path / "no-such-model"), "--port", str(port),
                   log=tmp_path / "up.log")
    try:
        code = up.proc.wait(120)
    finally:
        up.stop()
    assert code == 1, up.tail()
    up.wait_for(r"error: worker-0 \(pid \d+\) exited with code [1-9]\d* after .* "
                r"\(before the stack was ready\)", 5)
    assert not any("restart" in line for line in up.lines)
