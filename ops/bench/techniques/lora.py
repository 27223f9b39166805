"""CPU throughput with multi-LoRA: the same workload on the base model alone and spread
over 4 rank-16 adapters (every projection adapted), side by side in one run; also the
LoRA engine with no request on an adapter (``lora_idle``: the wrappers' skip path).

The benchmark model (``workload.py``, ~30M parameters), greedy, every request in the
batch at once; each request of the LoRA run uses adapter ``i % 4``. Configurations
alternate for ``--rounds`` rounds in one process with one torch thread; reported: median
output tokens per second of wall time and of process CPU time (CPU time is the steadier
measure on a shared machine, see ``engine_ab.py``), and the LoRA/base ratio (the issue asks
for >= 0.8x).

    .venv/bin/python ops/bench/techniques/lora.py [--requests 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from ops.bench.engine.workload import Job, build_bench_model, main_workload  # noqa: E402
from worker.engine.output.text_output import TextOutputs  # noqa: E402

ADAPTERS = 4
RANK = 16


def _engine(path: str, adapters: list[str]) -> Any:
    """The engine as a worker builds it: LoRA on with the adapters as start modules."""
    from worker import Engine, EngineConfig

    lora: dict[str, Any] = dict(max_loras=ADAPTERS, max_lora_rank=RANK, lora_modules=[
        f"a{i}={adapter}" for i, adapter in enumerate(adapters)]) if adapters else {}
    return Engine(EngineConfig.create(
        path, device="cpu", max_num_seqs=64, max_num_batched_tokens=1024, num_blocks=3300,
        long_prefill_token_threshold=512, enable_prefix_caching=False, **lora))


def _run(engine: Any, jobs: list[Job], adapters: int) -> tuple[float, float, int]:
    """(wall s, CPU s, output tokens) for every job at once; job ``i`` names adapter
    ``a{i % adapters}`` (the engine pins and unpins its slot)."""
    from protocol.sampling import SamplingParams

    wall, cpu = time.perf_counter(), time.process_time()
    for i, job in enumerate(jobs):
        engine.add_request(str(i), job.prompt, SamplingParams(
            temperature=0, max_tokens=job.max_tokens, ignore_eos=True),
            lora_name=f"a{i % adapters}" if adapters else None)
    tokens = 0
    while engine.has_unfinished_requests():
        for out in TextOutputs.of(engine).step():
            tokens += len(out.new_token_ids)
    return time.perf_counter() - wall, time.process_time() - cpu, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "ops/bench/results/lora.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    from tests.worker.engine.lora_adapters import write_adapter
    from worker.engine.lora.targets import base_targets

    path = build_bench_model()
    jobs = main_workload(args.requests)
    base = _engine(path, [])
    with tempfile.TemporaryDirectory() as tmp:
        targets = base_targets(base.runner.model, path)
        adapters = [write_adapter(Path(tmp) / f"a{i}", targets, rank=RANK, alpha=32, seed=i)
                    for i in range(ADAPTERS)]
        lora4 = _engine(path, adapters)
        # lora_idle: the same engine as lora4 with no request on an adapter (the skip)
        engines = {"base": (base, 0), "lora_idle": (lora4, 0), "lora4": (lora4, ADAPTERS)}
        for engine, n in engines.values():
            _run(engine, jobs[:4], n)  # warm-up
        runs: dict[str, list[tuple[float, float, int]]] = {k: [] for k in engines}
        for _ in range(args.rounds):
            for name, (engine, n) in engines.items():
                runs[name].append(_run(engine, jobs, n))
    result: dict[str, Any] = {"requests": args.requests, "rounds": args.rounds,
                              "adapters": ADAPTERS, "rank": RANK}
    for name, rows in runs.items():
        result[name] = {"wall_tok_s": statistics.median(t / w for w, _, t in rows),
                        "cpu_tok_s": statistics.median(t / c for _, c, t in rows),
                        "tokens": rows[0][2]}
    for key in ("wall_tok_s", "cpu_tok_s"):
        for name in ("lora_idle", "lora4"):
            result[f"ratio_{name}_{key}"] = result[name][key] / result["base"][key]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
