"""Structured-output throughput: a batch of 64 with half the rows constrained vs all free.

Same engine, same default model, same prompts, one run; the workloads alternate so
machine noise hits all of them alike. Rows:

* all free: 64 requests, 64 tokens each (``ignore_eos``);
* half regex: 32 of them constrained by a regex that cannot end before 64 tokens, so every
  row still produces exactly 64 tokens: the difference is the constraint's whole cost
  (mask fill, transfer, apply, matcher advance);
* half json_schema: 32 of them constrained by a typical schema; they stop when the JSON is
  complete, so fewer tokens (tokens/s is the comparable number).

Wall-clock tokens/s and tokens per CPU-second of this process are both reported: on a
shared machine the second is the steadier measure of the work a constraint adds.
Prints a table and writes ``ops/bench/results/structured.json``. Usage:

    .venv/bin/python ops/bench/techniques/structured.py [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

BATCH = 64
MAX_TOKENS = 64
REGEX = r"[a-zA-Z0-9_ .,:()=]{4000}"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["# record\nrecord = ", "def ", "class ", "import ", "for item in ", "x = "]


def workload(kind: str) -> list[Any]:
    from protocol.sampling import SamplingParams

    params = []
    for i in range(BATCH):
        constraint: dict[str, Any] | None = None
        if i % 2 == 1 and kind == "regex":
            constraint = {"regex": REGEX}
        elif i % 2 == 1 and kind == "json_schema":
            constraint = {"json_schema": SCHEMA}
        params.append(SamplingParams(
            max_tokens=MAX_TOKENS, temperature=1.0, seed=i, ignore_eos=constraint is None
            or kind == "regex", structured_output=constraint))
    return params


def run(engine: Any, kind: str) -> dict[str, float]:
    params = workload(kind)
    before = dict(engine.phase_s)
    start, cpu_start = time.perf_counter(), time.process_time()
    for i, p in enumerate(params):
        engine.add_request(f"{kind}-{i}-{time.monotonic_ns()}", PROMPTS[i % len(PROMPTS)], p)
    tokens = 0
    from worker.engine.output.text_output import TextOutputs

    while engine.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in TextOutputs.of(engine).step())
    seconds = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    sample = engine.phase_s.get("sample", 0.0) - before.get("sample", 0.0)
    return {"seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds,
            "tok_cpu_s": tokens / cpu, "sample_s": sample}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from worker import LLM

    torch.set_num_threads(args.threads)
    llm = LLM(device="cpu", kv_cache_blocks=1024, max_num_seqs=BATCH)
    kinds = ("free", "regex", "json_schema")
    for kind in kinds:  # warm-up: compiles (cache), oneDNN primitives, allocator
        run(llm.engine, kind)
    results: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            results[kind].append(run(llm.engine, kind))
    summary = {}
    for kind in kinds:
        rounds = results[kind]
        # Ratios are taken round by round (neighbouring runs see the same machine load).
        free_rounds = results["free"]
        ratios = [r["tok_s"] / f["tok_s"] for r, f in zip(rounds, free_rounds, strict=True)]
        cpu_ratios = [r["tok_cpu_s"] / f["tok_cpu_s"]
                      for r, f in zip(rounds, free_rounds, strict=True)]
        summary[kind] = {
            "tok_s": round(statistics.median(r["tok_s"] for r in rounds), 1),
            "tokens": int(statistics.median(r["tokens"] for r in rounds)),
            "seconds": round(statistics.median(r["seconds"] for r in rounds), 2),
            "sample_phase_s": round(statistics.median(r["sample_s"] for r in rounds), 3),
            "vs_free": round(statistics.median(ratios), 3),
            "vs_free_rounds": [round(x, 3) for x in ratios],
            "tok_per_cpu_s": round(statistics.median(r["tok_cpu_s"] for r in rounds), 1),
            "vs_free_cpu": round(statistics.median(cpu_ratios), 3),
        }
    labels = {"free": "all free", "regex": "half regex (64 tok each)",
              "json_schema": "half json_schema"}
    print(f"{'workload (batch 64)':<28}{'tok/s':>9}{'tokens':>8}{'s':>7}{'sample s':>10}"
          f"{'vs free':>9}{'tok/cpu-s':>11}{'vs free':>9}")
    for kind in kinds:
        s = summary[kind]
        print(f"{labels[kind]:<28}{s['tok_s']:>9}{s['tokens']:>8}{s['seconds']:>7}"
              f"{s['sample_phase_s']:>10}{s['vs_free']:>9}{s['tok_per_cpu_s']:>11}"
              f"{s['vs_free_cpu']:>9}")
    print(f"load average at the end: {os.getloadavg()[0]:.2f} (2 cores: above 2, the "
          "machine was shared and wall-clock ratios are noise)")
    out = ROOT / "ops/bench/results/structured.json"
    machine = {"cpu": platform.machine(), "threads": args.threads, "torch": torch.__version__,
               "device": "cpu"}
    machine["loadavg_1m"] = round(os.getloadavg()[0], 2)  # type: ignore[assignment]
    out.write_text(json.dumps({"machine": machine, "batch": BATCH, "max_tokens": MAX_TOKENS,
                               "rounds": args.rounds, "results": summary}, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
