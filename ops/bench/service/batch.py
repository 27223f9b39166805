"""Batch API benchmark: interactive latency while a batch runs, and what batches cost Redis.

1. Latency: one CPU worker (the embedded model, one torch thread, ``max_num_seqs`` 64),
   ``ferry gateway`` and ``ferry batcher``. Interactive completions (32 tokens, greedy,
   ``ignore_eos``), one at a time, measured idle and while a 2,000-line batch of the same
   size runs on the low lane (four alternating blocks of three each): for several
   per-batch bounds (``FERRY_BATCH_MAX_IN_FLIGHT``) with no fleet bound, then with the
   defaults (32 per batch, ``FERRY_BATCH_FLEET_SHARE`` 0.25 of the worker's 64 slots); the
   batch's own throughput (lines/s) alongside. Each configuration gets a fresh stack.
2. Memory: a 50,000-line input file uploaded through ``POST /v1/files`` and 50,000 result
   lines recorded the way the batcher records them; ``MEMORY USAGE ... SAMPLES 0`` of each
   key against the raw bytes.

Writes ``ops/bench/results/batch.json``. Usage:

    .venv/bin/python ops/bench/service/batch.py              # bounds 4 to 64, then the defaults
    .venv/bin/python ops/bench/service/batch.py --quick      # the defaults only, fewer samples
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import openai  # noqa: E402
import redis  # noqa: E402
import redis.asyncio as aredis  # noqa: E402

from ferry.local_stack import Stack, free_port  # noqa: E402
from protocol.batch.progress import BatchProgress, LineResult  # noqa: E402
from protocol.batch.records import BatchRecord, new_batch_id  # noqa: E402
from protocol.batch.store import BatchStore  # noqa: E402
from protocol.keys import Keys  # noqa: E402

FERRY = [sys.executable, "-m", "ferry.cli"]
RESULTS = ROOT / "ops" / "bench" / "results" / "batch.json"
TOKENS = 32
BODY = {"max_tokens": TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}


def _line(i: int) -> str:
    body = {"prompt": f"def function_{i}(x):", "max_tokens": TOKENS, "temperature": 0.8,
            "seed": i, "ignore_eos": True}
    return json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                       "body": body})


def _start(stack: Stack, in_flight: int, share: float) -> tuple[str, str]:
    url = stack.start_redis()
    env = dict(os.environ, FERRY_DEVICE="cpu", FERRY_TORCH_THREADS="1",
               FERRY_MAX_NUM_SEQS="64", FERRY_BATCH_MAX_IN_FLIGHT=str(in_flight),
               FERRY_BATCH_FLEET_SHARE=str(share), FERRY_LOG_LEVEL="warning")
    port = free_port()
    stack.spawn("worker-0", [*FERRY, "worker", "--redis-url", url, "--worker-id", "bench-0"],
                env)
    stack.spawn("gateway", [*FERRY, "gateway", "--redis-url", url, "--port", str(port),
                            "--log-level", "warning"], env)
    stack.spawn("batcher", [*FERRY, "batcher", "--redis-url", url, "--log-level", "warning"],
                env)
    base = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(base + "/readyz", timeout=2).status_code == 200:
                return base, url
        except httpx.HTTPError:
            pass
        stack.check_alive()
        time.sleep(0.3)


def _latency(client: openai.OpenAI, samples: int) -> list[float]:
    out = []
    for i in range(samples):
        start = time.perf_counter()
        client.completions.create(model="default", prompt=f"class Stack{i}:", **BODY)
        out.append(time.perf_counter() - start)
    return out


def _stack(logs: Path) -> Stack:
    logs.mkdir(parents=True, exist_ok=True)
    return Stack(logs)


def _ended(client: openai.OpenAI, batch_id: str) -> None:
    while client.batches.retrieve(batch_id).status not in ("cancelled", "completed"):
        time.sleep(0.2)


def run_latency(in_flight: int, share: float, cycles: int, per: int, lines: int,
                tmp: Path) -> dict[str, Any]:
    """``in_flight``: the per-batch bound; ``share``: the fleet share (1: no fleet bound
    below the worker's 64 slots). Idle and busy samples alternate in ``cycles`` blocks of
    ``per`` (a batch started, then cancelled, for each busy block), so a change in the
    machine's other load falls on both alike."""
    stack = _stack(tmp / f"logs-{in_flight}-{share}")
    idle: list[float] = []
    busy: list[float] = []
    done, seconds = 0, 0.0
    try:
        base, _url = _start(stack, in_flight, share)
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=600)
        _latency(client, 2)  # warm-up
        data = "\n".join(_line(i) for i in range(lines)).encode()
        source = client.files.create(file=("b.jsonl", io.BytesIO(data)), purpose="batch")
        for _ in range(cycles):
            idle += _latency(client, per)
            batch = client.batches.create(input_file_id=source.id, endpoint="/v1/completions",
                                          completion_window="24h")
            while (before := client.batches.retrieve(batch.id)).request_counts.completed < 4:
                time.sleep(0.1)
            started = time.monotonic()
            busy += _latency(client, per)
            seconds += time.monotonic() - started
            after = client.batches.retrieve(batch.id)
            done += after.request_counts.completed - before.request_counts.completed
            client.batches.cancel(batch.id)
            _ended(client, batch.id)
        stack.check_alive()
    finally:
        stack.stop()
    return {"in_flight": in_flight, "fleet_share": share, "idle_s": idle, "busy_s": busy,
            "idle_p50_s": statistics.median(idle), "busy_p50_s": statistics.median(busy),
            "ratio_p50": statistics.median(busy) / statistics.median(idle),
            "ratio_max": max(busy) / statistics.median(idle),
            "batch_lines_per_s": done / seconds}


async def _memory(url: str, base: str, lines: int) -> dict[str, Any]:
    """Bytes Redis holds per input line (the upload's LIST) and per result line (HASH)."""
    data = "\n".join(_line(i) for i in range(lines)).encode() + b"\n"
    reply = httpx.post(base + "/v1/files", data={"purpose": "batch"},
                       files={"file": ("m.jsonl", data)}, timeout=600)
    file_id = reply.json()["id"]
    r, keys = aredis.Redis.from_url(url), Keys()
    try:
        input_bytes = await r.memory_usage(keys.file_lines(file_id), samples=0)
        result = ('{"id":"batch_req_01a20a4b9577ebe9061fc330e36e-0","custom_id":"line-0",'
                  '"response":{"status_code":200,"request_id":"batch_01a20a4b9577ebe9061fc330'
                  'e36e-0","body":{"id":"cmpl-batch_01a20a4b9577ebe9061fc330e36e-0","object":'
                  '"text_completion","created":1795469057,"model":"default","choices":[{"index"'
                  ':0,"text":"\\n        \\"\\"\\"Return a list of the current module names.\\"'
                  '\\"\\"\\n        return [name for name in self._modules]","logprobs":null,'
                  '"finish_reason":"length"}],"usage":{"prompt_tokens":6,"completion_tokens":32,'
                  '"total_tokens":38}}},"error":null}')
        record = BatchRecord(id=new_batch_id(), owner="bench", endpoint="/v1/completions",
                             input_file_id=file_id, completion_window="24h",
                             status="in_progress", created_at=0, expires_at=2**31,
                             total=lines, lines=lines)
        await BatchStore(r, keys).create_batch(record)
        progress = BatchProgress(r, keys, record.id, "bench", 60_000)
        await progress.acquire()
        for start in range(0, lines, 500):
            await progress.record([LineResult(i, True, result, 6, 32)
                                   for i in range(start, min(lines, start + 500))])
        output_bytes = await r.memory_usage(keys.batch_output(record.id), samples=0)
    finally:
        await r.aclose()
    return {"lines": lines, "input_file_bytes": len(data), "input_redis_bytes": input_bytes,
            "input_overhead_per_line": (input_bytes - len(data)) / lines,
            "result_line_bytes": len(result), "output_redis_bytes": output_bytes,
            "output_overhead_per_line": (output_bytes - lines * len(result)) / lines}


def run_memory(lines: int, tmp: Path) -> dict[str, Any]:
    stack = _stack(tmp / "logs-memory")
    try:
        url = stack.start_redis()
        port = free_port()
        stack.spawn("gateway", [*FERRY, "gateway", "--redis-url", url, "--port", str(port),
                                "--log-level", "warning"], dict(os.environ))
        base = f"http://127.0.0.1:{port}"
        while True:
            try:
                httpx.get(base + "/healthz", timeout=2)
                break
            except httpx.HTTPError:
                stack.check_alive()
                time.sleep(0.2)
        out = asyncio.run(_memory(url, base, lines))
        out["redis_version"] = redis.Redis.from_url(url).info()["redis_version"]
        return out
    finally:
        stack.stop()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="ferry-batch-bench-"))
    # (per-batch bound, fleet share): the bounds alone, then the defaults (32, 0.25)
    configs = [(32, 0.25)] if args.quick else [(4, 1.0), (8, 1.0), (16, 1.0), (32, 1.0),
                                               (64, 1.0), (32, 0.25)]
    cycles = 2 if args.quick else 4
    latency = [run_latency(bound, share, cycles, 3, 2000, tmp) for bound, share in configs]
    memory = run_memory(50_000, tmp)
    print(f"{'bound':>5} | {'share':>5} | {'idle p50':>9} | {'busy p50':>9} | "
          f"{'ratio p50':>9} | {'worst/p50':>9} | {'batch lines/s':>13}")
    for row in latency:
        print(f"{row['in_flight']:>5} | {row['fleet_share']:>5} | {row['idle_p50_s']:>8.3f}s | "
              f"{row['busy_p50_s']:>8.3f}s"
              f" | {row['ratio_p50']:>8.2f}x | {row['ratio_max']:>8.2f}x | "
              f"{row['batch_lines_per_s']:>13.1f}")
    print(f"50,000-line file: {memory['input_file_bytes']:,} bytes -> "
          f"{memory['input_redis_bytes']:,} in Redis "
          f"({memory['input_overhead_per_line']:.1f} bytes/line overhead); 50,000 results of "
          f"{memory['result_line_bytes']} bytes -> {memory['output_redis_bytes']:,} "
          f"({memory['output_overhead_per_line']:.1f} bytes/line overhead)")
    RESULTS.write_text(json.dumps({"latency": latency, "memory": memory,
                                   "machine": f"{os.cpu_count()} cores"}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
