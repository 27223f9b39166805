"""Parallel tool calls cut by ``max_tokens`` on the default model, with and without the
call budget (``worker/engine/structured/call_budget.py``; docs/tools.md).

Each request is the chat request the gateway makes of ``tool_choice="required"`` with two
tools and parallel calls (the worker's own tool prompt, temperature 1, a seed) at one
``max_tokens`` of a range, run in-process on the engine twice: as served, and with the
budget turned off. Per ``max_tokens`` it counts the answers that end in a cut call, the
mean number of complete calls, and the complete calls the budget cost (a list ended
where the next call would have fit). Usage:

    .venv/bin/python ops/bench/techniques/cut_calls.py [--seeds 20]

Writes ``ops/bench/results/cut_calls.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from ops.bench.techniques.tools import ASK, TOOLS  # noqa: E402
from protocol.sampling import SamplingParams  # noqa: E402
from protocol.structured.constraint import StructuredOutput  # noqa: E402
from protocol.structured.tool_syntax import parse_calls, whole_arguments  # noqa: E402
from protocol.structured.tools import FunctionTool, ToolCalls  # noqa: E402

BUDGETS = (40, 60, 80, 100, 150, 200, 300)
NAMES = {t["function"]["name"] for t in TOOLS}
SPEC = StructuredOutput(tools=ToolCalls(
    tools=[FunctionTool(**t["function"]) for t in TOOLS], mode="required"))


def run(engine: Any, jobs: list[tuple[int, int]]) -> list[tuple[int, bool]]:
    """(complete calls, ends in a cut call) per job, all in one batch."""
    from worker.engine.output.text_output import TextOutputs

    text: dict[str, str] = {}
    finish: dict[str, str] = {}
    for i, (budget, seed) in enumerate(jobs):
        engine.add_request(f"r{i}", None, SamplingParams(
            temperature=1.0, seed=seed, max_tokens=budget, structured_output=SPEC),
            messages=ASK)
    outputs = TextOutputs.of(engine)
    while engine.has_unfinished_requests():
        for out in outputs.step():
            text[out.request_id] = text.get(out.request_id, "") + out.text
            if out.finished:
                finish[out.request_id] = str(out.finish_reason)
    got = []
    for i in range(len(jobs)):
        parsed = parse_calls(text[f"r{i}"], NAMES, cut=True)
        calls = parsed[1] if parsed else []
        cut = finish[f"r{i}"] == "length" and bool(calls) and not whole_arguments(
            calls[-1][1])
        got.append((len(calls) - cut, cut))
    return got


def main() -> None:
    import torch

    from worker import LLM
    from worker.engine.structured import call_budget

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(2)
    engine = LLM(device="cpu", kv_cache_blocks=2048, max_num_seqs=64).engine
    jobs = [(b, s) for b in BUDGETS for s in range(args.seeds)]
    started = time.time()
    served = run(engine, jobs)
    keep = call_budget.CallBudget.of
    call_budget.CallBudget.of = staticmethod(lambda *a: None)  # type: ignore[method-assign]
    try:
        free = run(engine, jobs)
    finally:
        call_budget.CallBudget.of = keep  # type: ignore[method-assign]
    rows = []
    print(f"{'max_tokens':>10} {'cut (off)':>10} {'cut (on)':>9} {'calls (off)':>12} "
          f"{'calls (on)':>11} {'calls lost':>11}")
    for budget in BUDGETS:
        at = [i for i, (b, _) in enumerate(jobs) if b == budget]
        row = {"max_tokens": budget, "requests": len(at),
               "cut_without_budget": sum(free[i][1] for i in at),
               "cut_with_budget": sum(served[i][1] for i in at),
               "calls_without_budget": sum(free[i][0] for i in at),
               "calls_with_budget": sum(served[i][0] for i in at),
               "calls_lost": sum(max(0, free[i][0] - served[i][0]) for i in at)}
        rows.append(row)
        print(f"{budget:>10} {row['cut_without_budget']:>10} {row['cut_with_budget']:>9} "
              f"{row['calls_without_budget']:>12} {row['calls_with_budget']:>11} "
              f"{row['calls_lost']:>11}")
    out = ROOT / "ops" / "bench" / "results" / "cut_calls.json"
    out.write_text(json.dumps({"seeds": args.seeds, "model": "default", "rows": rows,
                               "seconds": round(time.time() - started, 1)}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
