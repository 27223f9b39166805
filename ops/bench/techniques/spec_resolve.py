"""Batch-1 speculative retries: the one-pass resolve of accepted runs against the
per-position loop it replaced (``worker/engine/speculative/resolve.py``), ABAB in one
process, CPU time (``time.process_time``).

Each round and variant: a fresh speculating engine (``spec_decode.py``'s settings,
``max_num_seqs`` 1), N held-out code prompts answered once (untimed: fills the store),
then the same N again as retries (timed: the pass where whole drafts are accepted). Prints
per variant the retries' CPU time, the part of it spent resolving the tokens after each
row's first, and whether both variants' outputs are identical.

    python ops/bench/techniques/spec_resolve.py [--n 8] [--out 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from ops.bench.techniques.spec_decode import ENGINE_KW, SPEC_KW, repeat_jobs, run_pass  # noqa: E402
from worker.engine.output.step_batch import StepBatch  # noqa: E402
from worker.engine.request import Request  # noqa: E402
from worker.engine.sched.schedule_output import ScheduledRequest, SchedulerOutput  # noqa: E402
from worker.engine.speculative import engine_hooks  # noqa: E402
from worker.engine.speculative.resolve import resolve_rest  # noqa: E402


def per_position(engine: Any, sampling: list[Request], accepted: list[list[int]],
                 outputs: StepBatch) -> None:
    """The per-position loop (the merge base's ``SpecDecoding._resolve_rest``)."""
    position = 1
    while True:
        todo = [(r, seq[position]) for r, seq in zip(sampling, accepted, strict=True)
                if len(seq) > position and not r.is_finished]
        if not todo:
            return
        step = SchedulerOutput([ScheduledRequest(r, 1, True) for r, _ in todo], len(todo))
        engine.scheduler.advance(step)
        engine.apply_tokens(outputs, step, [t for _, t in todo], [None] * len(todo))
        position += 1


def timed(fn: Any, spent: list[float]) -> Any:
    def call(*args: Any) -> None:
        start = time.process_time()
        fn(*args)
        spent[0] += time.process_time() - start
    return call


def one(path: str, jobs: list[Any], fn: Any) -> dict[str, Any]:
    from worker import Engine, EngineConfig

    spent = [0.0]
    engine_hooks.resolve_rest = timed(fn, spent)  # type: ignore[attr-defined]
    engine = Engine(EngineConfig.create(path, max_num_seqs=1, **ENGINE_KW, **SPEC_KW))
    run_pass(engine, jobs, "a")
    spent[0] = 0.0
    got = run_pass(engine, jobs, "b")
    got["resolve_s"] = spent[0]
    del engine
    gc.collect()
    return got


def main() -> None:
    from worker.models import default_model_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8, help="prompts (and retries)")
    ap.add_argument("--out", type=int, default=32, help="tokens per answer")
    ap.add_argument("--rounds", type=int, default=2, help="old/new pairs, ABAB")
    args = ap.parse_args()
    torch.set_num_threads(1)
    path = default_model_path()
    jobs = [type(j)(j.prompt, args.out) for j in repeat_jobs(args.n, args.out)]
    one(path, jobs[:2], resolve_rest)  # warm-up: first-call costs
    runs: dict[str, list[dict[str, Any]]] = {"per-position": [], "one-pass": []}
    for _ in range(args.rounds):
        for label, fn in (("per-position", per_position), ("one-pass", resolve_rest)):
            runs[label].append(one(path, jobs, fn))
            r = runs[label][-1]
            print(f"{label:<13} retries cpu {r['cpu_s']:.3f}s, resolve {r['resolve_s']:.3f}s,"
                  f" steps {r['steps']}, accepted {r['accepted']}", flush=True)
    old, new = runs["per-position"], runs["one-pass"]
    same = all(a["outs"] == b["outs"] for a, b in zip(old, new, strict=True))
    cpu_old, cpu_new = (sum(r["cpu_s"] for r in v) for v in (old, new))
    res_old, res_new = (sum(r["resolve_s"] for r in v) for v in (old, new))
    print(f"retries cpu: per-position {cpu_old:.3f}s, one-pass {cpu_new:.3f}s, "
          f"ratio {cpu_old / cpu_new:.3f}x; resolve: {res_old:.3f}s -> {res_new:.3f}s "
          f"({res_old / cpu_old:.1%} -> {res_new / cpu_new:.1%} of cpu); "
          f"outputs identical: {same}")


if __name__ == "__main__":
    main()
