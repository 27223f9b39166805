"""Device memory traffic of one sampling step: the old torch ops against the fused pass.

    .venv/bin/python ops/bench/techniques/sampling_traffic.py [--rows 256] [--vocab 131072]
        [--dtype float32|bfloat16] [--sample-rows 8] [--no-write]

Both paths sample ``rows`` rows at temperature 0.8, top-p 0.95, seeded (``host_step.py``'s
``sampled`` workload). The torch ops run on the ``meta`` device under a dispatch mode that
adds up, per op, the bytes of its tensor inputs and outputs (views count nothing): what
the op has to read and write at the least (a sort is counted as one read and one write, a
lower bound). The fused kernel's traffic is counted by design: it reads a row's logits
once per pass and writes one token; its passes per row are measured by running the kernel
(on a GPU: every row; on a CPU: ``--sample-rows`` rows under the Triton interpreter, the
mean scaled to ``rows``). The new path's own torch ops (the parameter uploads) are counted
by the dispatch mode with the kernel stubbed. Prints a table, writes
``ops/bench/results/sampling_traffic.json``.

The logits are a model-like distribution: a Gaussian body (std 2.5) and a head of 32
tokens per row lifted by up to ~25, so the top-p boundary falls where a real model's does,
a few units under the maximum.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

if not torch.cuda.is_available():  # no GPU: the kernel runs under the Triton interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (before triton is first imported)

RESULTS = ROOT / "ops" / "bench" / "results" / "sampling_traffic.json"
ROWS, VOCAB = 256, 131072
GB = 1e9


class ByteCounter(TorchDispatchMode):
    """Per aten op: bytes of its tensor inputs plus outputs (views excepted)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not getattr(func, "is_view", False):
            tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out))
                       if isinstance(t, torch.Tensor)]
            self.bytes[str(func.overloadpacket.__name__)] += sum(
                t.numel() * t.element_size() for t in tensors)
        return out

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


def sampled_rows(rows: int) -> list[Any]:
    from protocol.sampling import SamplingParams
    from worker.engine.sample.sampler import SamplingRow

    return [SamplingRow(SamplingParams(temperature=0.8, top_p=0.95, seed=i), 10, [1, 2], [])
            for i in range(rows)]


def old_sample(logits: torch.Tensor, rows: list[Any], keys: list[int]) -> torch.Tensor:
    """The sampler before the fused pass (its ``launch`` without logprobs and grammar):
    the torch filters, softmax, and the noise over ``[rows, vocab]``. keys: one per row."""
    from kernels.sampling_reference import exponential
    from worker.engine.runner.transfer import to_device
    from worker.engine.sample.logits_processors import (
        apply_allowed_token_ids,
        apply_bad_words,
        apply_logit_bias,
        apply_penalties,
        apply_top_k_top_p_min_p,
    )

    device = logits.device
    logits = apply_logit_bias(apply_penalties(logits.float(), rows), rows)
    logits = apply_bad_words(apply_allowed_token_ids(logits, rows), rows)
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if not sampled:
        return tokens
    index = to_device(sampled, torch.long, device)
    sub = logits.index_select(0, index)
    picked = [rows[i] for i in sampled]
    temps = to_device([r.params.temperature for r in picked], torch.float32, device)
    probs = torch.softmax(apply_top_k_top_p_min_p(sub / temps.unsqueeze(1), picked), dim=-1)
    noise = exponential(to_device([keys[i] for i in sampled], torch.long, device),
                        logits.shape[1])
    return tokens.index_copy(0, index, (probs / noise).argmax(dim=-1))


def model_like_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """[rows, vocab] float32: a Gaussian body and a lifted head (see the docstring)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 2.5
    head = torch.randint(0, vocab, (rows, 32), generator=gen)
    lift = torch.rand(rows, 32, generator=gen) * 25.0
    return logits.scatter_add_(1, head, lift)


def counted(fn: Callable[[], Any]) -> ByteCounter:
    with ByteCounter() as counter:
        fn()
    return counter


def old_traffic(rows: int, vocab: int, dtype: torch.dtype) -> ByteCounter:
    from worker.engine.sample.sampler import Sampler

    meta = torch.empty(rows, vocab, dtype=dtype, device="meta")
    picked = sampled_rows(rows)
    keys = [Sampler()._key(r) for r in picked]
    return counted(lambda: old_sample(meta, picked, keys))


def passes_per_row(rows: int, vocab: int, dtype: torch.dtype, sample_rows: int) -> list[int]:
    """The fused kernel's reads of each row's logits, measured by running it."""
    from kernels.sampling import sample
    from worker.engine.sample.sampler import Sampler, sampling_tensors

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n = rows if device.type == "cuda" else min(rows, sample_rows)
    picked = sampled_rows(n)
    logits = model_like_logits(n, vocab).to(device=device, dtype=dtype)
    tensors = sampling_tensors(picked, [Sampler()._key(r) for r in picked], device)
    passes = torch.zeros(n, dtype=torch.int32, device=device)
    sample(logits, tensors, passes)
    return [int(p) for p in passes.cpu()]


def new_traffic(rows: list[Any], vocab: int, dtype: torch.dtype, sampled_passes: float,
                grammar: tuple[list[int], torch.Tensor] | None = None) -> tuple[ByteCounter, int]:
    """(the torch ops ``Sampler.launch`` dispatches around the kernel, the kernel's bytes
    by design: one read of a greedy row, ``sampled_passes`` reads of a sampled one)."""
    import worker.engine.sample.sampler as sampler_module

    meta = torch.empty(len(rows), vocab, dtype=dtype, device="meta")
    real = sampler_module._sample_pass
    sampler_module._sample_pass = lambda logits, t, fused=True: torch.empty(  # type: ignore[assignment]
        logits.shape[0], dtype=torch.long, device=logits.device)
    try:
        ops = counted(lambda: sampler_module.Sampler().launch(meta, rows, grammar))
    finally:
        sampler_module._sample_pass = real  # type: ignore[assignment]
    reads = sum(1.0 if r.params.greedy else sampled_passes for r in rows)
    row_bytes = vocab * torch.empty((), dtype=dtype).element_size()
    # per row: 4 params and a key read, a token and a pass count written
    return ops, int(reads * row_bytes + len(rows) * (16 + 8 + 8 + 4))


def recorded_passes(vocab: int = VOCAB, sample_rows: int = 2) -> float:
    """Mean passes of a temperature/top-p row: from the last results file when it has the
    vocabulary (float32), else measured on ``sample_rows`` rows."""
    if RESULTS.exists():
        for result in json.loads(RESULTS.read_text())["results"]:
            if result["vocab"] == vocab and result["dtype"] == "float32":
                return float(result["passes_mean"])
    passes = passes_per_row(sample_rows, vocab, torch.float32, sample_rows)
    return sum(passes) / len(passes)


def sampling_bytes_per_step(params: list[Any], vocab: int = VOCAB) -> int:
    """The new path's device bytes for one step whose rows have these ``SamplingParams``
    (float32 logits of ``vocab``; ``host_step.py``'s field): the ops dispatched around the
    kernel (penalties, masks, logprobs, a grammar's bitmask for rows with one) plus the
    kernel by design."""
    from worker.engine.sample.sampler import SamplingRow

    rows = [SamplingRow(p, 10, [1, 2, 3], [4, 4, 9]) for p in params]
    constrained = [i for i, p in enumerate(params) if p.structured_output is not None]
    grammar = (constrained, torch.full((len(constrained), (vocab + 31) // 32), -1,
                                       dtype=torch.int32)) if constrained else None
    passes = recorded_passes(vocab) if any(not p.greedy for p in params) else 1.0
    ops, kernel = new_traffic(rows, vocab, torch.float32, passes, grammar)
    return ops.total + kernel


def measure(rows: int, vocab: int, dtype: torch.dtype, sample_rows: int) -> dict[str, Any]:
    old = old_traffic(rows, vocab, dtype)
    passes = passes_per_row(rows, vocab, dtype, sample_rows)
    ops, kernel = new_traffic(sampled_rows(rows), vocab, dtype, sum(passes) / len(passes))
    return {
        "dtype": str(dtype).removeprefix("torch."), "rows": rows, "vocab": vocab,
        "old_gb": round(old.total / GB, 3), "new_gb": round((ops.total + kernel) / GB, 3),
        "new_kernel_gb": round(kernel / GB, 3), "new_torch_ops_bytes": ops.total,
        "passes_mean": round(sum(passes) / len(passes), 3), "passes_max": max(passes),
        "passes_rows_measured": len(passes),
        "old_ops_gb": {k: round(v / GB, 3) for k, v in old.bytes.most_common()},
    }


def table(result: dict[str, Any]) -> str:
    lines = [f"{result['rows']} rows x {result['vocab']} vocab, {result['dtype']} logits, "
             "temperature 0.8, top-p 0.95", f"{'op':<28}{'old GB':>10}{'new GB':>10}"]
    for op, gb in result["old_ops_gb"].items():
        lines.append(f"{op:<28}{gb:>10.3f}{'':>10}")
    lines.append(f"{'fused sampling kernel':<28}{'':>10}{result['new_kernel_gb']:>10.3f}")
    lines.append(f"{'total':<28}{result['old_gb']:>10.3f}{result['new_gb']:>10.3f}")
    lines.append(f"kernel passes per row: mean {result['passes_mean']}, max "
                 f"{result['passes_max']} ({result['passes_rows_measured']} rows measured)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=ROWS)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--dtype", action="append", choices=("float32", "bfloat16"))
    parser.add_argument("--sample-rows", type=int, default=8)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    results = []
    for name in args.dtype or ("float32", "bfloat16"):
        result = measure(args.rows, args.vocab, getattr(torch, name), args.sample_rows)
        print(table(result), flush=True)
        results.append(result)
    if not args.no_write:
        RESULTS.write_text(json.dumps({"results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
