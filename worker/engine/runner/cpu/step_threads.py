"""Small CPU steps run on one thread.

Why: every parallel op of a step forms a thread team (wake the other threads, join them
at the end). For a step of a few tokens on a small model the ops are microseconds long,
so the team costs more than the work, and on a machine shared with other processes the
join waits for a descheduled thread's next time slice. Measured on the 2-core dev machine
under load (the default model): a one-row decode step 2-3x slower at 2 threads than at 1,
a 5-20 token prefill 35-900 ms at 2 threads against 13-40 ms at 1; quiet, MKL's one-row
products are as fast or faster at 1 thread (the 8192x256 LM head: 226 vs 278 us).

A step is small when its tokens times the model's linear weights (multiply-adds) stay
under :data:`SERIAL_MACS`, about 5-10 ms of one core: the default model's decode steps
and prompts up to ~19 tokens, never a multi-billion-parameter model's step.

The arithmetic does not change with the thread count on the paths this covers: MKL's
matrix-vector product (one-row projections), the packed oneDNN GEMMs and SDPA split the
output, not the reduction; ``tests/worker/engine/runner/test_lean_decode.py`` checks the logits
bit for bit against the configured thread count.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

SERIAL_MACS = 1 << 27  # ~134M multiply-adds


def linear_macs_per_token(model: nn.Module) -> int:
    """Multiply-adds per token of the model's 2-D weights (its projections and LM head;
    an embedding table is a lookup, not a product)."""
    seen: set[int] = set()
    total = 0
    for mod in model.modules():
        weight = getattr(mod, "weight", None)
        if isinstance(mod, nn.Embedding) or not isinstance(weight, torch.Tensor):
            continue
        if weight.dim() == 2 and weight.data_ptr() not in seen:
            seen.add(weight.data_ptr())
            total += weight.numel()
    return total  # a tied LM head counts once, as the output module (embeddings skipped)


def serial_tokens(model: nn.Module) -> int:
    """The most tokens a step of ``model`` may have and still run on one thread."""
    return SERIAL_MACS // max(1, linear_macs_per_token(model))


@contextmanager
def serial_if(small: bool) -> Iterator[None]:
    """One torch thread inside the block when ``small`` (and more were configured)."""
    threads = torch.get_num_threads()
    if not small or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
