"""The compose smoke test's scenario, run by ``ops/compose-smoke.sh`` against the stack it
brought up from the real ``docker-compose.yml`` (redis, gateway, one CPU worker, batcher):

1. a seeded completion streams through the gateway with the official ``openai`` client,
   and a three-line batch (Batch API, driven by the ``batcher`` service) completes;
2. ``--scale worker-cpu=2``: both workers heartbeat;
3. a long seeded stream, undisturbed, gives the reference text;
4. the same stream again: the container generating it is ``docker kill``ed (SIGKILL)
   mid-stream; the other worker takes it over once the dead one's heartbeat expires, and
   the stream must finish with exactly the reference text; the longest pause after the
   kill is the takeover time (the issue asks for under 10 s);
5. ``docker compose stop`` (SIGTERM): every live worker drains and exits 0, the batcher
   exits 0, and the gateway exits gracefully too (uvicorn re-raises the signal after its
   shutdown, so 143).

The compose command line comes in ``SMOKE_COMPOSE``; results go to ``SMOKE_RESULTS``.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from openai import OpenAI

PROMPT = "def fibonacci(n):"
LONG_PROMPT = "class Queue:"
LONG_TOKENS = 600
KILL_AFTER_CHUNKS = 40
SAMPLING: dict[str, Any] = {"temperature": 0.8, "seed": 1234,
                            "extra_body": {"ignore_eos": True}}


@dataclass
class Streamed:
    text: str = ""
    finish_reason: str | None = None
    chunks: int = 0
    arrivals: list[float] = field(default_factory=list)


def compose(*args: str, capture: bool = False) -> str:
    cmd = [*shlex.split(os.environ["SMOKE_COMPOSE"]), *args]
    proc = subprocess.run(cmd, capture_output=capture, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} -> {proc.returncode}\n{proc.stderr or ''}")
    return proc.stdout or ""


def docker(*args: str) -> str:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=True,
                          timeout=120).stdout


def get_json(url: str) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return dict(json.load(resp))
    except urllib.error.HTTPError as exc:
        return dict(json.load(exc))


def wait_workers(url: str, workers: int, timeout: float = 300.0) -> None:
    deadline, state = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        try:
            state = get_json(url + "/readyz")
        except (OSError, ValueError):
            state = {}
        if state.get("ready") and int(state.get("workers", 0)) >= workers:
            return
        time.sleep(0.5)
    raise TimeoutError(f"not {workers} live worker(s) after {timeout:.0f} s: {state}")


def stream(client: OpenAI, model: str, prompt: str, max_tokens: int,
           on_chunk: Any = None) -> Streamed:
    out = Streamed()
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                           stream=True, **SAMPLING):
        out.arrivals.append(time.monotonic())
        out.chunks += 1
        choice = chunk.choices[0]
        out.text += choice.text or ""
        out.finish_reason = choice.finish_reason or out.finish_reason
        if on_chunk is not None:
            on_chunk(chunk, out)
    return out


def running_worker(request_id: str) -> str:
    """The worker that holds the request: read from its job hash in Redis (the jobs API no
    longer shows worker ids to clients), on the smoke's loopback Redis."""
    import redis

    from protocol.keys import Keys

    client = redis.Redis(host="127.0.0.1", port=int(os.environ["SMOKE_REDIS_PORT"]))
    try:
        worker_id = client.hget(Keys().job(request_id), "worker_id")
    finally:
        client.close()
    if worker_id is None:
        raise RuntimeError(f"job {request_id} has no worker_id in Redis")
    return bytes(worker_id).decode()


class Killer:
    """After ``KILL_AFTER_CHUNKS`` chunks, SIGKILL the container generating the stream."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.killed_at: float | None = None
        self.container = ""

    def __call__(self, chunk: Any, out: Streamed) -> None:
        if self.killed_at is not None or out.chunks < KILL_AFTER_CHUNKS:
            return
        worker_id = running_worker(chunk.id.split("-", 1)[1])
        for cid in compose("ps", "-q", "worker-cpu", capture=True).split():
            logs = subprocess.run(["docker", "logs", cid], capture_output=True, text=True)
            if worker_id in logs.stdout + logs.stderr:
                docker("kill", cid)
                self.killed_at, self.container = time.monotonic(), cid
                print(f"compose-smoke: killed {cid[:12]} (worker {worker_id}) after "
                      f"{out.chunks} chunks", flush=True)
                return
        raise RuntimeError(f"no worker-cpu container runs worker {worker_id}")


def run_batch(client: OpenAI, model: str, lines: int = 3, timeout: float = 300.0) -> float:
    """A small batch through the Batch API: every line gets its result. Returns seconds."""
    started = time.monotonic()
    body = "\n".join(json.dumps({"custom_id": f"line-{i}", "method": "POST",
                                 "url": "/v1/completions", "body": {
                                     "model": model, "prompt": f"def f{i}(x):",
                                     "max_tokens": 8, "temperature": 0}})
                     for i in range(lines)).encode()
    source = client.files.create(file=("smoke.jsonl", body), purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/completions",
                                  completion_window="24h")
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"batch {batch.id} still {batch.status} after {timeout:.0f} s")
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    counts = batch.request_counts
    assert batch.status == "completed" and counts is not None, batch
    assert (counts.total, counts.completed, counts.failed) == (lines, lines, 0), counts
    assert batch.output_file_id is not None
    rows = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in rows) == [f"line-{i}" for i in range(lines)]
    assert all(r["response"]["status_code"] == 200 for r in rows), rows
    took = time.monotonic() - started
    print(f"compose-smoke: a {lines}-line batch completed through the batcher in {took:.1f} s",
          flush=True)
    return round(took, 2)


def exit_codes(service: str, skip: str = "") -> dict[str, int]:
    """Container name -> exit code, for the service's containers other than ``skip``."""
    codes = {}
    for cid in compose("ps", "-a", "-q", service, capture=True).split():
        if cid != skip:
            name, code = docker("inspect", "-f", "{{.Name}} {{.State.ExitCode}}", cid).split()
            codes[name.lstrip("/")] = int(code)
    return codes


def main() -> None:
    url = f"http://127.0.0.1:{os.environ['SMOKE_GATEWAY_PORT']}"
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    results: dict[str, Any] = {}
    wait_workers(url, 1)
    model = client.models.list().data[0].id
    first = stream(client, model, PROMPT, 32)
    assert first.text and first.finish_reason == "length", first
    again = stream(client, model, PROMPT, 32)
    assert again.text == first.text, "a seeded completion changed between two runs"
    print(f"compose-smoke: streamed {first.chunks} chunks from {model!r}: {first.text!r}",
          flush=True)
    results["batch_s"] = run_batch(client, model)

    compose("up", "-d", "--no-recreate", "--scale", "worker-cpu=2", "worker-cpu")
    wait_workers(url, 2)
    print("compose-smoke: scaled to 2 CPU workers", flush=True)

    reference = stream(client, model, LONG_PROMPT, LONG_TOKENS)
    killer = Killer(url)
    disturbed = stream(client, model, LONG_PROMPT, LONG_TOKENS, on_chunk=killer)
    assert killer.killed_at is not None, "the stream ended before the kill"
    assert disturbed.text == reference.text, "the resumed stream differs from the reference"
    after = [t for t in disturbed.arrivals if t >= killer.killed_at]
    takeover = max(b - a for a, b in zip([killer.killed_at, *after], after, strict=False))
    results["takeover_s"] = round(takeover, 2)
    print(f"compose-smoke: after docker kill the stream resumed within {takeover:.2f} s and "
          f"finished with the reference text ({len(reference.text)} chars)", flush=True)
    assert takeover < 10, f"takeover took {takeover:.1f} s"

    compose("stop")
    workers = exit_codes("worker-cpu", skip=killer.container)  # that one died of SIGKILL
    gateway = exit_codes("gateway")
    batcher = exit_codes("batcher")
    results["exit_codes"] = {**workers, **gateway, **batcher}
    assert workers and all(code == 0 for code in workers.values()), workers
    assert batcher and all(code == 0 for code in batcher.values()), batcher
    # uvicorn re-raises SIGTERM after its graceful shutdown: 143 is its clean exit.
    assert all(code in (0, 143) for code in gateway.values()), gateway
    print(f"compose-smoke: SIGTERM stopped the stack: workers drained and exited {workers}, "
          f"batcher {batcher}, gateway {gateway}", flush=True)
    if os.environ.get("SMOKE_RESULTS"):
        with open(os.environ["SMOKE_RESULTS"], "w") as fh:
            json.dump(results, fh)


if __name__ == "__main__":
    main()
