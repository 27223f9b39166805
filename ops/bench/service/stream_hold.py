"""What holding a streamed response's status until the first event costs the client.

The gateway commits a stream's 200 only once the request's first event arrived (its first
token, or its refusal: docs/operations.md, *Streaming*), so a refusal known before the
first token is a 4xx. This bench measures the price side by side in one run: two gateways
on one Redis and one worker (the embedded default model), one holding
(``FERRY_STREAM_HOLD_S=30``, the default) and one not (``0``), the same streamed
completions sent alternately to each, one at a time and then 8 at once. Per request it
records when the status line arrived and when the first chunk with text arrived (the
TTFT a client such as guidellm measures). Writes ``ops/bench/results/stream_hold.json``.

    .venv/bin/python ops/bench/service/stream_hold.py [--requests 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from ferry.local_stack import Stack, free_port  # noqa: E402

FERRY = [sys.executable, "-m", "ferry.cli"]
PROMPTS = ["def fibonacci(n):", "import os\n", "class Queue:", "def add(a, b):"]


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _gateway(stack: Stack, name: str, url: str, hold_s: float) -> str:
    port = free_port()
    env = dict(os.environ, FERRY_STREAM_HOLD_S=str(hold_s))
    stack.spawn(name, [*FERRY, "gateway", "--redis-url", url, "--port", str(port),
                       "--log-level", "warning"], env)
    return f"http://127.0.0.1:{port}"


def _wait_ready(stack: Stack, bases: list[str]) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        stack.check_alive()
        try:
            if all(httpx.get(b + "/health").status_code == 200 for b in bases):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("stack not ready")


async def _one(client: httpx.AsyncClient, base: str, prompt: str) -> tuple[float, float]:
    """(seconds to the status line, seconds to the first chunk with text)."""
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True}
    start = time.perf_counter()
    async with client.stream("POST", base + "/v1/completions", json=body) as reply:
        headers = time.perf_counter() - start
        first = float("nan")
        async for line in reply.aiter_lines():
            if line.startswith("data: {") and '"text":""' not in line and first != first:
                first = time.perf_counter() - start
    return headers, first


async def _run(bases: dict[str, str], n: int, concurrency: int) -> dict[str, Any]:
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in bases}
    async with httpx.AsyncClient(timeout=120) as client:
        for i in range(0, n, concurrency):
            for name, base in (list(bases.items()) if i % 2 == 0 else
                               list(bases.items())[::-1]):  # alternate who goes first
                batch = [_one(client, base, PROMPTS[(i + k) % len(PROMPTS)])
                         for k in range(concurrency)]
                samples[name] += await asyncio.gather(*batch)
    out = {}
    for name, rows in samples.items():
        heads, ttft = [r[0] * 1000 for r in rows], [r[1] * 1000 for r in rows]
        out[name] = {"requests": len(rows),
                     "headers_ms": {"p50": round(_pct(heads, 0.5), 1),
                                    "p99": round(_pct(heads, 0.99), 1)},
                     "ttft_ms": {"p50": round(_pct(ttft, 0.5), 1),
                                 "p99": round(_pct(ttft, 0.99), 1)}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--out", default=str(ROOT / "ops/bench/results/stream_hold.json"))
    args = ap.parse_args()
    stack = Stack(None)
    try:
        url = stack.start_redis()
        stack.spawn("worker", [*FERRY, "worker", "--redis-url", url, "--log-level", "warning"],
                    dict(os.environ, FERRY_TORCH_THREADS="1"))
        bases = {"hold (30 s, default)": _gateway(stack, "gateway", url, 30.0),
                 "no hold (0)": _gateway(stack, "gateway-nohold", url, 0.0)}
        _wait_ready(stack, list(bases.values()))
        asyncio.run(_run(bases, 8, 1))  # warm-up
        result = {"sequential": asyncio.run(_run(bases, args.requests, 1)),
                  "8 concurrent": asyncio.run(_run(bases, args.requests, 8)),
                  "cpus": os.cpu_count()}
    finally:
        stack.stop()
    print(f"{'load':<14} {'gateway':<22} {'reqs':>5} {'headers p50':>12} {'headers p99':>12} "
          f"{'TTFT p50':>10} {'TTFT p99':>10}")
    for load in ("sequential", "8 concurrent"):
        for name, row in result[load].items():
            h, t = row["headers_ms"], row["ttft_ms"]
            print(f"{load:<14} {name:<22} {row['requests']:>5} {h['p50']:>10.1f}ms "
                  f"{h['p99']:>10.1f}ms {t['p50']:>8.1f}ms {t['p99']:>8.1f}ms")
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
