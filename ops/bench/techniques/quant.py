"""Quantized weights on the CPU: fp32, bf16, fp8, int8 and int4, same models, same run.

For the default model and the ~30M benchmark Llama, per method: weight bytes (parameters
and buffers, each storage once; "resident" adds the oneDNN packed copies that the fp32/bf16
paths keep beside the weights), single-stream tok/s (one request, greedy, EOS ignored),
``mixed`` tok/s (``workload.main_workload``: prompts 32-512, outputs 16-256, all at once)
and, for the default model, bits per byte on held-out text (the training split's held-out
stdlib files, scored through the engine's prompt logprobs in windows). transformers'
``generate`` in fp32 is the single-stream baseline. Writes ``results/quant.json``.

    .venv/bin/python ops/bench/techniques/quant.py [--mixed 16] [--stream-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "ops" / "train"))

import torch  # noqa: E402

from ops.bench.engine import baselines  # noqa: E402
from ops.bench.engine.workload import Job, build_bench_model, main_workload, run_jobs  # noqa: E402

METHODS = [("fp32", {}), ("bf16", {"dtype": "bfloat16"}), ("fp8", {"quantization": "fp8"}),
           ("int8", {"quantization": "int8"}), ("int4", {"quantization": "int4"})]


def weight_bytes(model: Any) -> tuple[int, int]:
    """(parameters and buffers, each storage once; the same plus oneDNN packed copies)."""
    seen: dict[int, int] = {}
    tensors = [*model.parameters(), *model.buffers()]
    packed = 0
    for m in model.modules():
        if type(m).__name__ == "PackedLinear":  # plain attributes, not parameters
            tensors += [m.weight] + ([m.bias] if m.bias is not None else [])
            packed += m.weight.nbytes  # the opaque oneDNN copy: as many elements
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    base = sum(seen.values())
    return base, base + packed


def engine_for(path: str, options: dict[str, Any]) -> Any:
    from worker import Engine, EngineConfig

    return Engine(EngineConfig.create(path, device="cpu", num_blocks=1024, **options))


def tok_s(engine: Any, jobs: list[Job]) -> float:
    run_jobs(engine, [Job(jobs[0].prompt[:8], 4)])  # warm
    start = time.perf_counter()
    run_jobs(engine, jobs)
    return sum(j.max_tokens for j in jobs) / (time.perf_counter() - start)


def heldout_ids(tokenizer: Any, max_bytes: int) -> tuple[list[list[int]], int]:
    """Windows of held-out token ids (at most 512 each) and the bytes they cover."""
    from data import load_corpus

    text = "\n".join(load_corpus().heldout_texts)[:max_bytes]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [ids[i:i + 512] for i in range(0, len(ids), 512)], len(text.encode())


def bits_per_byte(engine: Any, windows: list[list[int]], nbytes: int) -> float:
    """Every token after a window's first, scored given the window before it."""
    from protocol.sampling import SamplingParams
    from worker.engine.output.text_output import TextOutputs

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    nats = 0.0
    for i, ids in enumerate(windows):
        engine.add_request(f"bpb-{i}", ids, params)
    while engine.has_unfinished_requests():
        for out in TextOutputs.of(engine).step():
            for entry in getattr(out, "prompt_logprobs", None) or []:
                if entry[1] is not None:
                    nats -= entry[1]
    return nats / math.log(2) / nbytes


def _engines(path: str, methods: list[str]) -> dict[str, tuple[Any, str]]:
    engines = {}
    for method, options in [m for m in METHODS if m[0] in methods]:
        note = ""
        try:
            engine = engine_for(path, options)
        except RuntimeError as exc:  # oneDNN refused a packed bf16 shape on this CPU
            note = f"unpacked weights (packing failed: {str(exc)[:60]})"
            engine = engine_for(path, {**options, "pack_weights": False})
        engines[method] = (engine, note)
    return engines


def run_model(name: str, path: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every method's engine is built first, then timed in interleaved rounds (the best of
    ``--rounds`` per method), so a noisy spell on a shared machine hits them all alike."""
    stream = [Job(list(range(2, 34)), args.stream_tokens)]
    mixed = main_workload(args.mixed)
    hf = baselines.load_hf(path)
    baselines.sequential(hf, [Job(stream[0].prompt[:8], 4)])  # warm
    engines = _engines(path, args.methods.split(","))
    best: dict[str, dict[str, float]] = {m: {"stream": 0.0, "mixed": 0.0, "hf": 0.0}
                                         for m in engines}
    for _ in range(args.rounds):
        start = time.perf_counter()
        baselines.sequential(hf, stream)
        hf_rate = args.stream_tokens / (time.perf_counter() - start)
        for method, (engine, _) in engines.items():
            got = best[method]
            got["hf"] = max(got["hf"], hf_rate)
            got["stream"] = max(got["stream"], tok_s(engine, stream))
            got["mixed"] = max(got["mixed"], tok_s(engine, mixed))
    windows, nbytes = ([], 0) if name != "default" else heldout_ids(
        next(iter(engines.values()))[0].tokenizer, args.heldout_bytes)
    rows: list[dict[str, Any]] = []
    for method, (engine, note) in engines.items():
        base, resident = weight_bytes(engine.runner.model)
        row = {"model": name, "method": method, "weight_bytes": base,
               "resident_weight_bytes": resident,
               "stream_tok_s": round(best[method]["stream"], 1),
               "mixed_tok_s": round(best[method]["mixed"], 1), **({"note": note} if note else {})}
        if windows:
            row["bits_per_byte"] = round(bits_per_byte(engine, windows, nbytes), 4)
        rows.append(row)
        print(f"  {name} {method}: {row}", flush=True)
    rows.append({"model": name, "method": "transformers generate fp32",
                 "stream_tok_s": round(max(b["hf"] for b in best.values()), 1)})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'model':<8} {'method':<28} {'weights MB':>10} {'x fp32':>7} {'stream tok/s':>12} "
             f"{'x fp32':>7} {'x hf':>6} {'mixed tok/s':>11} {'x fp32':>7} {'bits/byte':>9}"]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        fp32 = next(r for r in mine if r["method"] == "fp32")
        hf = next(r for r in mine if r["method"].startswith("transformers"))
        for r in mine:
            wb = r.get("weight_bytes")
            lines.append(
                f"{model:<8} {r['method']:<28} "
                f"{(wb or 0) / 1e6:>10.2f} {(wb or 0) / fp32['weight_bytes']:>7.3f} "
                f"{r['stream_tok_s']:>12.1f} {r['stream_tok_s'] / fp32['stream_tok_s']:>7.2f} "
                f"{r['stream_tok_s'] / hf['stream_tok_s']:>6.2f} "
                f"{r.get('mixed_tok_s', 0):>11.1f} "
                f"{r.get('mixed_tok_s', 0) / fp32['mixed_tok_s']:>7.2f} "
                f"{r.get('bits_per_byte', float('nan')):>9.4f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mixed", type=int, default=16, help="requests of the mixed workload")
    ap.add_argument("--stream-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--heldout-bytes", type=int, default=40_000)
    ap.add_argument("--models", default="default,llama-30m")
    ap.add_argument("--methods", default=",".join(m for m, _ in METHODS))
    ap.add_argument("--out", default=str(ROOT / "ops/bench/results/quant.json"))
    args = ap.parse_args()
    from worker.models import default_model_path

    paths = {"default": str(default_model_path()), "llama-30m": build_bench_model()}
    rows: list[dict[str, Any]] = []
    for name in args.models.split(","):
        rows += run_model(name, paths[name], args)
    print(table(rows))
    Path(args.out).write_text(json.dumps({
        "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
