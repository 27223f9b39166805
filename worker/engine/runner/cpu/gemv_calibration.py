"""CPU: up to how many rows a projection runs faster on ``F.linear`` than on its packed
oneDNN weight, measured once at load on this machine.

Why measured: the crossover is the CPU's, not the model's. On one dev machine (2026-11-26,
one thread) ``F.linear`` won up to 32 rows for weights under 1 MiB (the default model's 42
projections at 3 rows 0.83 vs 2.29 ms), and that was the fixed rule; on the next one (an
AMD EPYC with AVX-512, same day) the packed weight won from 2 rows (the same 42 at 3 rows
2.95 vs 2.35 ms, at 16 rows 4.09 vs 2.83), so that rule cost a batch-16 decode step ~8%
of its CPU. Both paths are fp32 products of the same weights (``test_packed_linear.py``);
the speculative benchmark's 192 greedy outputs at batch 16 were the same with either rule.

How: the projections are split as ``PackedLinear`` splits them (weights up to
``_CACHED_BYTES``, and larger ones), each group timed on both paths at 1, 2, 4, ... 32
rows, its weights cycled as a step streams them (the first ``SAMPLE_BYTES`` of them),
best of ``TRIALS``; the group's threshold is the last row count ``F.linear`` won before
the packed path first won. Each row count is timed on the threads its steps run on: one
where ``step_threads`` serializes a step of that many tokens (``serial_rows``: up to ~19
at the default model), torch's configured count above. 0.04 s at the default model on the
AVX-512 machine (the packed path won at 2 rows, so the measurement stopped there), a few
tenths where ``F.linear`` wins to 32; one result per process for a set of weight shapes
and threads (engines of the same model reuse it). A fixed ``ModelConfig.packed_gemv_rows``
(``FERRY_PACKED_GEMV_ROWS``) skips the measurement.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch.nn import functional as F

from worker.engine.runner.cpu.packed_linear import _CACHED_BYTES, PackedLinear
from worker.engine.runner.cpu.step_threads import serial_if

ROWS = (1, 2, 4, 8, 16, 32)
TRIALS = 3
SAMPLE_BYTES = 64 << 20  # weights timed per group: enough to leave the caches as a step
_measured: dict[tuple[object, ...], int] = {}


def set_gemv_rows(modules: list[PackedLinear], fixed: int | None = None,
                  serial_rows: int = 0) -> dict[str, int]:
    """Set every module's few-row threshold: ``fixed`` for all, else measured per group
    (small and large weights), a step of at most ``serial_rows`` tokens timed on one
    thread as the runner runs it; returns {group: threshold} (the worker logs it)."""
    groups: dict[str, list[PackedLinear]] = {"small": [], "large": []}
    for m in modules:
        groups["small" if m.weight.numel() * m.weight.element_size() <= _CACHED_BYTES
               else "large"].append(m)
    chosen: dict[str, int] = {}
    for name, members in groups.items():
        if not members:
            continue
        rows = fixed if fixed is not None else measured_gemv_rows(members, serial_rows)
        for m in members:
            m.gemv_rows = rows
        chosen[name] = rows
    return chosen


def measured_gemv_rows(modules: list[PackedLinear], serial_rows: int = 0) -> int:
    """The last of ``ROWS`` at which ``F.linear`` beat the packed weight (0: it never
    did), over the group's first ``SAMPLE_BYTES`` of weights; cached by their shapes,
    the threads and the dtype."""
    sample: list[PackedLinear] = []
    size = 0
    for m in modules:
        if sample and size >= SAMPLE_BYTES:
            break
        sample.append(m)
        size += m.weight.numel() * m.weight.element_size()
    key = (tuple((m.out_features, m.in_features) for m in sample), torch.get_num_threads(),
           serial_rows, sample[0].weight.dtype)
    if key not in _measured:
        _measured[key] = _crossover(sample, serial_rows)
    return _measured[key]


def _crossover(sample: list[PackedLinear], serial_rows: int) -> int:
    best = 0
    with torch.inference_mode():
        for rows in ROWS:
            # inputs in the weights' dtype: a bf16 weight's packed op takes no fp32 rows
            xs = [torch.randn(rows, m.in_features, dtype=m.weight.dtype) for m in sample]

            def plain(xs: list[torch.Tensor] = xs) -> None:
                for m, x in zip(sample, xs, strict=True):
                    F.linear(x, m.weight, m.bias)

            def packed(xs: list[torch.Tensor] = xs) -> None:
                for m, x in zip(sample, xs, strict=True):
                    m.packed_rows(x)

            with serial_if(rows <= serial_rows):
                if _best_time(packed) <= _best_time(plain):
                    break
            best = rows
    return best


def _best_time(run: Callable[[], object]) -> float:
    run()  # warm: oneDNN builds its primitive for a new shape on the first call
    best = float("inf")
    for _ in range(TRIALS):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best
