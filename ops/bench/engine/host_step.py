"""Host time of one engine step at 256 running requests, with the model stubbed.

    .venv/bin/python ops/bench/engine/host_step.py [--steps 200] [--workload NAME ...] [--quick]

The real ``Engine`` on the default model with ``host_stub.StubModel`` in place of its body,
so what is timed is exactly the host work a GPU step pays (see ``host_stub.py``). Requests
that end are replaced at once, so the batch stays full. One JSON line per workload:

* ``greedy`` — temperature 0; ``sampled`` — temperature 0.8, top-p 0.95, seeded;
  ``penalties`` — 10% of rows with a frequency penalty; ``grammar`` — 10% of rows with a
  JSON-schema grammar; ``logprobs`` — every row asks for 5 logprobs.

Fields: ``engine_ms_per_step`` (median wall time of ``Engine.step()``, which emits token
ids only), ``host_ms_per_step`` (the same less the device stand-ins,
``host_stub.DeviceClock``) and ``host_cpu_ms_per_step`` (that in the engine thread's CPU
time: steadier on a shared machine, where wall time also counts the time other processes
hold the cores), ``phases_ms`` (mean per step of each engine phase),
``sampling_bytes_per_step`` (device traffic of the sampling ops at 256 x 128k,
``sampling_traffic.py``). Each step's batch also goes to a real output process
(``service/standalone_output.py``: the worker's text path) publishing to a real
redis-server the bench starts: ``output_ms_per_step`` (its busy time per batch: text,
events, Redis), ``published_tok_s`` (tokens that reached Redis per second of the measured
run), ``output_capacity_tok_s`` (tokens per second of its busy time: wall, so on a shared
machine it also counts the time other processes and Redis hold the cores),
``output_cpu_tok_s`` (tokens per second of its pass loop's own CPU time) and
``texts_identical`` (every stream's text from the output process equals the in-process
path's, ``TextOutputs``' ``StreamTexts`` over the same batches). ``--no-output`` skips it.
Results go to ``ops/bench/results/host_step.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "ops" / "bench" / "results" / "host_step.json"
ROWS = 256
PROMPT_LEN = 48
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "count": {"type": "integer"}},
          "required": ["name", "count"]}
WORKLOADS = ("greedy", "sampled", "penalties", "grammar", "logprobs")


def params_for(workload: str, i: int) -> dict[str, Any]:
    """The sampling parameters of the ``i``-th request of a workload."""
    base: dict[str, Any] = {"temperature": 0.0, "max_tokens": 1500, "ignore_eos": True}
    if workload == "sampled":
        base.update(temperature=0.8, top_p=0.95, seed=i)
    elif workload == "penalties" and i % 10 == 0:
        base.update(frequency_penalty=0.5)
    elif workload == "grammar" and i % 10 == 0:
        base.update(structured_output={"json_schema": SCHEMA}, max_tokens=200,
                    ignore_eos=False)
    elif workload == "logprobs":
        base.update(logprobs=5)
    return base


def make_engine(rows: int) -> Any:
    from ops.bench.engine.host_stub import stub_engine
    from worker import Engine, EngineConfig

    config = EngineConfig.create(
        _default_model(), device="cpu", max_num_seqs=rows, kv_cache_blocks=rows * 128,
        max_num_batched_tokens=4096)
    return stub_engine(Engine(config))


def _default_model() -> str:
    from worker.models import default_model_path

    return str(default_model_path())


class Feeder:
    """Keeps ``rows`` requests in the engine: a finished one is replaced at once."""

    def __init__(self, engine: Any, workload: str, rows: int, link: Any = None) -> None:
        import random

        from ops.bench.engine.host_stub import DeviceClock

        self.engine, self.workload, self.link = engine, workload, link
        self.clock = DeviceClock().install(engine)
        self.device_times: list[float] = []  # per step: seconds in the device stand-ins
        self.host_cpu: list[float] = []  # per step: engine-thread CPU s outside them
        self.batches: list[Any] = []  # what went to the output process (the identity check)
        self.rng = random.Random(0)
        self.count = 0
        for _ in range(rows):
            self.add()

    def add(self) -> None:
        from protocol.sampling import SamplingParams

        i = self.count
        self.count += 1
        prompt = [self.rng.randrange(3, 500) for _ in range(PROMPT_LEN)]
        self.engine.add_request(f"r{i}", prompt, SamplingParams(**params_for(self.workload, i)))

    def step(self) -> tuple[float, int]:
        start, device = time.perf_counter(), self.clock.seconds
        cpu, device_cpu = time.thread_time(), self.clock.cpu_seconds
        batch = self.engine.step()  # token ids only: text is the output side's
        elapsed = time.perf_counter() - start
        self.device_times.append(self.clock.seconds - device)
        self.host_cpu.append(time.thread_time() - cpu - (self.clock.cpu_seconds - device_cpu))
        if self.link is not None:
            self.link.send(batch)
            self.batches.append(batch)
        for _ in range(len(batch.ends)):
            self.add()
        return elapsed, len(batch)


def run_workload(workload: str, steps: int, rows: int, redis_url: str | None) -> dict[str, Any]:
    engine = make_engine(rows)
    link = start_output(engine, redis_url) if redis_url else None
    feeder = Feeder(engine, workload, rows, link)
    while len(engine.scheduler.running) < rows or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        feeder.step()  # prefill everything first
    for _ in range(20):
        feeder.step()
    engine.phase_s.clear()
    times: list[float] = []
    feeder.device_times.clear()
    feeder.host_cpu.clear()
    tokens = 0
    before = wait_caught_up(link, len(feeder.batches)) if link is not None else {}
    run_start = time.perf_counter()
    for _ in range(steps):
        elapsed, n = feeder.step()
        times.append(elapsed)
        tokens += n
    phases = {k: round(v / steps * 1e3, 3) for k, v in engine.phase_s.items()}
    out = output_fields(link, feeder, before, run_start, steps) if link is not None else {}
    return out | {
        "workload": workload, "rows": rows, "steps": steps,
        "engine_ms_per_step": round(statistics.median(times) * 1e3, 3),
        "host_ms_per_step": round(statistics.median(
            t - d for t, d in zip(times, feeder.device_times, strict=True)) * 1e3, 3),
        "host_cpu_ms_per_step": round(statistics.median(feeder.host_cpu) * 1e3, 3),
        "device_standin_ms_per_step": round(statistics.mean(feeder.device_times) * 1e3, 3),
        "engine_ms_p90": round(sorted(times)[int(0.9 * len(times))] * 1e3, 3),
        "phases_ms": phases,
        "tokens_per_step": round(tokens / steps, 1),
        "sampling_bytes_per_step": sampling_bytes(workload, rows),
    }


def sampling_bytes(workload: str, rows: int) -> int:
    """Device traffic of the workload's sampling ops at 128k vocabulary (float32 logits),
    counted from the ops dispatched (``sampling_traffic.py``)."""
    from ops.bench.techniques.sampling_traffic import sampling_bytes_per_step
    from protocol.sampling import SamplingParams

    return sampling_bytes_per_step([SamplingParams(**params_for(workload, i))
                                    for i in range(rows)])


WINDOW_DECODE = False  # --window-decode: the output process's A/B baseline
DECODE_STREAM = False  # --decode-stream: DecodeStream, not the byte table (A/B)


def start_output(engine: Any, redis_url: str) -> Any:
    from ops.bench.service.standalone_output import start
    from worker.engine.output.rust_decode import decode_spec

    return start({"tokenizer": engine.config.model.model, "redis_url": redis_url,
                  "collect": True, "decode_spec": decode_spec(engine.tokenizer),
                  "window_decode": WINDOW_DECODE, "decode_stream": DECODE_STREAM})


def wait_caught_up(link: Any, batches: int) -> dict[str, Any]:
    """The output process's stats once it has taken ``batches`` batches."""
    while True:
        link.poll()
        if link.stats.get("batches", -1) >= batches:
            return dict(link.stats)
        time.sleep(0.05)


def output_fields(link: Any, feeder: Feeder, before: dict[str, Any], run_start: float,
                  steps: int) -> dict[str, Any]:
    """The output process's share: busy ms per batch, tokens that reached Redis per second
    (until it caught up with the run's last batch), and every stream's text against the
    in-process path over the same batches."""
    after = wait_caught_up(link, len(feeder.batches))
    wall = time.perf_counter() - run_start
    link.close()
    from worker.engine.output.text_output import StreamTexts

    texts = StreamTexts(feeder.engine.tokenizer, lambda stream, stop: None)
    local: dict[str, str] = {}
    for batch in feeder.batches:
        for o in texts.apply(batch):
            local[f"{o.request_id}/{o.index}"] = local.get(f"{o.request_id}/{o.index}", "") + o.text
    published = after["published"] - before["published"]
    busy = after["busy_s"] - before["busy_s"]
    busy_cpu = after.get("busy_cpu_s", 0.0) - before.get("busy_cpu_s", 0.0)
    return {
        "output_ms_per_step": round(busy / steps * 1e3, 3),
        "published_tok_s": round(published / wall),
        "output_capacity_tok_s": round(published / busy) if busy else None,
        "output_cpu_tok_s": round(published / busy_cpu) if busy_cpu else None,
        "output_batches_per_pass": round(steps / max(1, after["passes"] - before["passes"]), 2),
        "texts_identical": link.texts == local, "output_torch_loaded": after["torch_loaded"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--workload", action="append", choices=WORKLOADS)
    parser.add_argument("--quick", action="store_true", help="30 steps")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--no-output", action="store_true", help="engine half only")
    parser.add_argument("--window-decode", action="store_true",
                        help="the output process decodes with two window decodes a token, "
                        "not DecodeStream (the A/B baseline)")
    parser.add_argument("--decode-stream", action="store_true",
                        help="the output process decodes with DecodeStream, not the "
                        "byte-level table (ByteDetokenizer's A/B baseline)")
    args = parser.parse_args()
    global WINDOW_DECODE, DECODE_STREAM
    WINDOW_DECODE, DECODE_STREAM = args.window_decode, args.decode_stream
    import torch

    # the stub's ops stand for launches; two threads spin on a shared machine
    torch.set_num_threads(1)
    steps = 30 if args.quick else args.steps
    results = []
    with redis_for(not args.no_output) as url:
        for workload in args.workload or WORKLOADS:
            row = run_workload(workload, steps, args.rows, url)
            print(json.dumps(row), flush=True)
            results.append(row)
    if not args.no_write:
        RESULTS.write_text(json.dumps({
            "machine": platform.processor() or platform.machine(),
            "python": platform.python_version(), "results": results}, indent=2) + "\n")


@contextlib.contextmanager
def redis_for(wanted: bool) -> Iterator[str | None]:
    """A throwaway redis-server for the output process to publish to (None: no output)."""
    if not wanted:
        yield None
        return
    from ops.bench.service.gateway_procs import start_redis

    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_redis(Path(tmp))
        try:
            yield url
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
