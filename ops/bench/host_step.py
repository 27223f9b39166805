"""Host time of one engine step at 256 running requests, with the model stubbed.

    .venv/bin/python ops/bench/host_step.py [--steps 200] [--workload NAME ...] [--quick]

The real ``Engine`` on the default model with ``host_stub.StubModel`` in place of its body,
so what is timed is exactly the host work a GPU step pays (see ``host_stub.py``). Requests
that end are replaced at once, so the batch stays full. One JSON line per workload:

* ``greedy`` — temperature 0; ``sampled`` — temperature 0.8, top-p 0.95, seeded;
  ``penalties`` — 10% of rows with a frequency penalty; ``grammar`` — 10% of rows with a
  JSON-schema grammar; ``logprobs`` — every row asks for 5 logprobs.

Fields: ``engine_ms_per_step`` (median wall time of ``Engine.step()``), ``phases_ms`` (mean
per step of each engine phase). Results go to ``ops/bench/results/host_step.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
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
    from ops.bench.host_stub import stub_engine
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

    def __init__(self, engine: Any, workload: str, rows: int) -> None:
        import random

        self.engine, self.workload = engine, workload
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
        start = time.perf_counter()
        batch = self.engine.step()  # token ids only: text is the output side's
        elapsed = time.perf_counter() - start
        for _ in range(len(batch.ends)):
            self.add()
        return elapsed, len(batch)


def run_workload(workload: str, steps: int, rows: int) -> dict[str, Any]:
    engine = make_engine(rows)
    feeder = Feeder(engine, workload, rows)
    while len(engine.scheduler.running) < rows or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
        feeder.step()  # prefill everything first
    for _ in range(20):
        feeder.step()
    engine.timer.reset()
    times: list[float] = []
    tokens = 0
    for _ in range(steps):
        elapsed, n = feeder.step()
        times.append(elapsed)
        tokens += n
    phases = {k: round(v / steps * 1e3, 3) for k, v in engine.timer.totals.items()}
    return {
        "workload": workload, "rows": rows, "steps": steps,
        "engine_ms_per_step": round(statistics.median(times) * 1e3, 3),
        "engine_ms_p90": round(sorted(times)[int(0.9 * len(times))] * 1e3, 3),
        "phases_ms": phases,
        "tokens_per_step": round(tokens / steps, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--workload", action="append", choices=WORKLOADS)
    parser.add_argument("--quick", action="store_true", help="30 steps")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(2)
    steps = 30 if args.quick else args.steps
    results = []
    for workload in args.workload or WORKLOADS:
        row = run_workload(workload, steps, args.rows)
        print(json.dumps(row), flush=True)
        results.append(row)
    if not args.no_write:
        RESULTS.write_text(json.dumps({
            "machine": platform.processor() or platform.machine(),
            "python": platform.python_version(), "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
