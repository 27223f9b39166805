"""Quantized MoE experts on the CPU: weight bytes and the grouped path's speed, one run.

Weight bytes: the experts of the tiny test MoEs (``tests/.../quant/agreement.py``'s
Mixtral, ``tests/checkpoints.py``'s Qwen3-MoE) loaded as Ferry loads them, fp32 and
``--quantization fp8|int8|int4``, against fp32.

Speed: one Mixtral-shaped experts module (hidden 512, intermediate 1024, top-2 of 8, fp32
activations, random weights), its experts float or quantized by each method, called
through ``worker.engine.runner.moe.experts_forward`` (the path Ferry's CPU workers take)
on the same hidden states and routing, alternating for ``--rounds`` rounds in one process
with one torch thread; the median milliseconds per call (process CPU time, the steadier
on a shared machine) at decode (1, 8 rows) and prefill-chunk (64 rows) sizes, each
method's against float. Every quantized output is checked against the per-expert
reference on its dequantized weights first (max abs difference printed).

    .venv/bin/python ops/bench/techniques/quant_moe.py [--rounds 5] [--calls 20]
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

from worker.engine.runner import moe  # noqa: E402

METHODS = ("fp8", "int8", "int4")
TOKENS = (1, 8, 64)


def tiny_bytes() -> dict[str, dict[str, float]]:
    """Experts' bytes of the tiny test MoEs per method, and against fp32."""
    from tests.checkpoints import build_checkpoint
    from tests.worker.engine.runner.quant.agreement import build_moe
    from worker.engine.config import ModelConfig
    from worker.engine.runner.model_loader import load_model
    from worker.engine.runner.quant.experts import experts_bytes

    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in (("mixtral", build_moe(Path(tmp))),
                           ("qwen3_moe", build_checkpoint("qwen3_moe", Path(tmp)))):
            full = experts_bytes(load_model(ModelConfig(path, pack_weights=False)).model)
            row: dict[str, float] = {"fp32": full}
            for method in METHODS:
                got = experts_bytes(load_model(ModelConfig(path, quantization=method)).model)
                row[method], row[f"{method}_x"] = got, round(got / full, 4)
            out[name] = row
    return out


def _modules() -> dict[str, Any]:
    import transformers

    from worker.engine.runner.quant.experts import QuantizedExperts, attach, quantize_projection

    cfg = transformers.MixtralConfig(num_hidden_layers=1, hidden_size=512,
                                     intermediate_size=1024, num_local_experts=8,
                                     num_experts_per_tok=2)
    torch.manual_seed(0)
    modules: dict[str, Any] = {}
    for method in ("float", *METHODS):
        model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        module = next(m for m in model.modules() if moe.is_experts_module(m))
        with torch.no_grad():
            torch.manual_seed(1)
            module.gate_up_proj.normal_(0, 0.05)
            module.down_proj.normal_(0, 0.05)
            if method != "float":
                w13, w2 = module.gate_up_proj.detach(), module.down_proj.detach()
                group = 128 if method == "int4" else 0
                attach(module, QuantizedExperts(method, quantize_projection(method, w13, group),
                                                quantize_projection(method, w2, group), 8, 1024))
        modules[method] = module
    return modules


def speed(rounds: int, calls: int) -> dict[str, Any]:
    from kernels import reference

    modules = _modules()
    gen = torch.Generator().manual_seed(2)
    results: dict[str, Any] = {}
    for tokens in TOKENS:
        x = torch.randn(tokens, 512, generator=gen)
        ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(tokens)])
        w = torch.softmax(torch.randn(tokens, 2, generator=gen), -1)
        errors = {}
        with torch.no_grad():
            for method in METHODS:
                q = modules[method].ferry_quantized
                w13, w2 = q.dequantized()
                want = reference.moe_experts(x, w13, w2, ids, w)
                errors[method] = float((moe.experts_forward(modules[method], x, ids, w)
                                        - want).abs().max())
            times: dict[str, list[float]] = {m: [] for m in modules}
            for _ in range(rounds):
                for method, module in modules.items():
                    moe.experts_forward(module, x, ids, w)  # warm
                    start = time.process_time()
                    for _ in range(calls):
                        moe.experts_forward(module, x, ids, w)
                    times[method].append((time.process_time() - start) / calls * 1e3)
        med = {m: statistics.median(t) for m, t in times.items()}
        results[str(tokens)] = {"cpu_ms": {m: round(v, 4) for m, v in med.items()},
                                "x_float": {m: round(med["float"] / v, 3)
                                            for m, v in med.items()},
                                "max_abs_err": errors}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / "ops/bench/results/quant_moe.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    report = {"bytes": tiny_bytes(), "speed": speed(args.rounds, args.calls)}
    print(json.dumps(report, indent=1))
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
