"""CPU MoE experts: Ferry's grouped path against transformers' experts modules, one run.

One experts module per shape, built by transformers (Mixtral's and Qwen3-MoE's classes,
fp32, random weights), called on the same hidden states and routing three ways,
alternating for ``--rounds`` rounds in one process with one torch thread:

- ``eager``: transformers' per-expert module loop (one-hot mask, ``torch.where`` per expert);
- ``hf_grouped``: transformers' default ``grouped_mm`` implementation;
- ``ferry``: ``worker.engine.runner.moe.experts_forward`` (sorted slices, one matmul per
  expert and projection), the path Ferry's CPU workers take.

Token counts cover decode (1, 8 rows) and prefill chunks (64, 256 rows); routings are
uniform random top-k. Reported: the median milliseconds per call (wall and process CPU
time; CPU time is the steadier on a shared machine) and each path's speed-up over eager.
Every path's output is checked against eager first (max abs difference printed).

``--engine-requests N`` (default 16) also runs the paged engine end to end on a Mixtral
checkpoint built here (4 layers, hidden 256, top-2 of 4 experts, random weights, fp32):
the same greedy workload (prompts of 32 tokens, 32 new tokens each, all at once) on one
engine loaded as Ferry loads it and one whose experts are switched back to transformers'
eager modules, alternating for ``--rounds`` rounds; output tokens per second of wall and
CPU time, and a check that both produced the same tokens.

    .venv/bin/python ops/bench/techniques/moe.py [--rounds 5] [--calls 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from worker.engine.runner import moe  # noqa: E402

SHAPES = {  # name -> (config class, kwargs): Mixtral-like top-2 of 8, Qwen3-MoE-like top-8 of 64
    "mixtral_e8_k2": ("MixtralConfig", dict(hidden_size=512, intermediate_size=1024,
                                            num_local_experts=8, num_experts_per_tok=2)),
    "qwen3moe_e64_k8": ("Qwen3MoeConfig", dict(hidden_size=512, moe_intermediate_size=256,
                                               num_experts=64, num_experts_per_tok=8)),
}
TOKENS = (1, 8, 64, 256)
PATHS = ("eager", "hf_grouped", "ferry")


def _experts(cls_name: str, kwargs: dict[str, Any]) -> tuple[Any, int, int]:
    """(experts module, experts, top_k) with weights ~ N(0, 0.05)."""
    import transformers

    cfg = getattr(transformers, cls_name)(num_hidden_layers=1, **kwargs)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    module = next(m for m in model.modules() if moe.is_experts_module(m))
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.05)
    return module, module.down_proj.shape[0], cfg.num_experts_per_tok


def _call(path: str, module: Any, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor):
    if path == "ferry":
        return moe.experts_forward(module, x, ids, w)
    from transformers.integrations.moe import grouped_mm_experts_forward

    if path == "hf_grouped":
        return grouped_mm_experts_forward(module, x, ids, w)
    return type(module).forward.__wrapped__(module, x, ids, w)


def _time(path: str, module: Any, args: tuple[torch.Tensor, ...],
          calls: int) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        _call(path, module, *args)
    return ((time.perf_counter() - wall) / calls * 1e3,
            (time.process_time() - cpu) / calls * 1e3)


def bench_shape(name: str, rounds: int, calls: int) -> list[dict[str, Any]]:
    module, experts, top_k = _experts(*SHAPES[name])
    gen = torch.Generator().manual_seed(0)
    rows = []
    for tokens in TOKENS:
        hidden = module.down_proj.shape[1]
        x = torch.randn(tokens, hidden, generator=gen)
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
        w = torch.softmax(torch.randn(tokens, top_k, generator=gen), -1)
        with torch.no_grad():
            want = _call("eager", module, x, ids, w)
            diffs = {p: float((_call(p, module, x, ids, w) - want).abs().max()) for p in PATHS}
            times: dict[str, list[tuple[float, float]]] = {p: [] for p in PATHS}
            for _ in range(rounds):
                for p in PATHS:
                    times[p].append(_time(p, module, (x, ids, w), calls))
        row: dict[str, Any] = dict(shape=name, tokens=tokens, max_abs_diff=diffs)
        for p in PATHS:
            row[f"{p}_wall_ms"] = statistics.median(t[0] for t in times[p])
            row[f"{p}_cpu_ms"] = statistics.median(t[1] for t in times[p])
        for p in PATHS[1:]:
            row[f"{p}_speedup_cpu"] = row["eager_cpu_ms"] / row[f"{p}_cpu_ms"]
        rows.append(row)
        print(f"{name:16} T={tokens:4}  " + "  ".join(
            f"{p} {row[f'{p}_wall_ms']:8.3f} ms wall {row[f'{p}_cpu_ms']:8.3f} ms cpu"
            for p in PATHS) + "  ferry/eager x{:.2f} hf_grouped/eager x{:.2f}".format(
            row["ferry_speedup_cpu"], row["hf_grouped_speedup_cpu"]), flush=True)
    return rows


def _engine_run(engine: Any, jobs: list[list[int]]) -> tuple[float, float, list[list[int]]]:
    from protocol.sampling import SamplingParams
    from worker.engine.output.text_output import TextOutputs

    wall, cpu = time.perf_counter(), time.process_time()
    for i, prompt in enumerate(jobs):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=32,
                                                          ignore_eos=True))
    out: list[list[int]] = [[] for _ in jobs]
    while engine.has_unfinished_requests():
        for o in TextOutputs.of(engine).step():
            out[int(o.request_id)] += o.new_token_ids
    return time.perf_counter() - wall, time.process_time() - cpu, out


def bench_engine(requests: int, rounds: int) -> dict[str, Any]:
    import random
    import tempfile

    from tests.checkpoints import build_checkpoint
    from worker import Engine, EngineConfig

    root = Path(tempfile.mkdtemp(prefix="ferry-moe-bench-"))
    path = build_checkpoint("mixtral", root, layers=4, hidden=256)
    engines = {}
    for name in ("eager", "ferry"):
        engine = Engine(EngineConfig.create(path, device="cpu", max_num_seqs=64,
                                            enable_prefix_caching=False))
        if name == "eager":
            engine.runner.model.set_experts_implementation("eager")
        engines[name] = engine
    rng = random.Random(0)
    vocab = engines["ferry"].runner.shape.vocab_size
    jobs = [[rng.randrange(vocab) for _ in range(32)] for _ in range(requests)]
    runs: dict[str, list[tuple[float, float, list[list[int]]]]] = {n: [] for n in engines}
    for engine in engines.values():
        _engine_run(engine, jobs[:2])  # warm-up
    for _ in range(rounds):
        for name, engine in engines.items():
            runs[name].append(_engine_run(engine, jobs))
    tokens = requests * 32
    result: dict[str, Any] = dict(requests=requests, new_tokens=tokens,
                                  same_tokens=runs["eager"][0][2] == runs["ferry"][0][2])
    for name, rows in runs.items():
        result[f"{name}_wall_tok_s"] = statistics.median(tokens / w for w, _, _ in rows)
        result[f"{name}_cpu_tok_s"] = statistics.median(tokens / c for _, c, _ in rows)
    result["ferry_over_eager_cpu"] = result["ferry_cpu_tok_s"] / result["eager_cpu_tok_s"]
    result["ferry_over_eager_wall"] = result["ferry_wall_tok_s"] / result["eager_wall_tok_s"]
    print("engine", json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--engine-requests", type=int, default=16)
    parser.add_argument("--out", default=str(ROOT / "ops/bench/results/moe.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [r for name in SHAPES for r in bench_shape(name, args.rounds, args.calls)]
    result = dict(torch=torch.__version__, threads=1, rounds=args.rounds, calls=args.calls,
                  shapes={k: v[1] for k, v in SHAPES.items()}, rows=rows,
                  engine=bench_engine(args.engine_requests, args.rounds))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
