"""One step's token-to-adapter-slot assignment, and the holder the projections read it from.

The runner builds a ``LoraMetadata`` once per step and puts it in the ``LoraStep`` that
every wrapped projection holds (an explicit object, no global); ``None`` there means no
row of the step uses an adapter, and the projections skip LoRA entirely. On CUDA it holds
the token indices sorted by slot, computed on the device (``kernels.lora.lora_segments``).
On a CPU it holds each slot's tokens (a slice when they are contiguous, as a prefill
chunk's are: no gather) and, for a step of at most ``WIDE_MAX_TOKENS`` tokens, the
``wide`` scale matrix: ``[T, n·R]`` over the slots from the lowest to the highest in use,
each token's own slot's first ``rank`` columns holding its scale and every other entry 0,
with ``wide_own`` marking those columns (the layer selects them: ``layer._apply_wide``).
A projection then costs three ops whatever the mix of adapters (``layer.py``): per-group
gathers and matmuls cost ~10 small torch calls per adapter, which on a decode step of 16
rows over 4 adapters more than doubled a projection's time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kernels.lora_reference import LoraGroups
from worker.engine.runner.transfer import host_to_device

WIDE_MAX_TOKENS = 256


@dataclass(frozen=True)
class LoraMetadata:
    token_slots: torch.Tensor  # [T] int32 on the model's device, -1 = no adapter
    groups: LoraGroups | None  # CPU path
    ranks: list[int]  # [S] host: each slot's rank (the CPU path multiplies only that)
    scales: list[float] = field(default_factory=list)  # [S] host: each slot's scale (CPU)
    wide: torch.Tensor | None = None  # CPU, small steps: [T, n*R] fp32 (module docstring)
    wide_own: torch.Tensor | None = None  # [T, n*R] bool: each token's own slot's columns
    # the columns of the flat [.., S*R] views that ``wide`` covers
    wide_cols: slice = field(default_factory=lambda: slice(0))
    sorted_tokens: torch.Tensor | None = None  # [T] int32, CUDA: tokens sorted by slot
    starts: torch.Tensor | None = None  # [S + 1] int32, CUDA: each slot's first sorted token


@dataclass
class LoraStep:
    """Shared by every wrapped projection; the runner sets ``meta`` before each forward
    and clears it after."""

    meta: LoraMetadata | None = None


def cpu_groups(token_slots: np.ndarray) -> LoraGroups:
    """Each used slot's tokens, in slot order; a contiguous run becomes a slice."""
    groups: LoraGroups = []
    for slot in np.unique(token_slots).tolist():
        if slot < 0:
            continue
        where = np.flatnonzero(token_slots == slot)
        lo, hi = int(where[0]), int(where[-1]) + 1
        groups.append((slot, slice(lo, hi) if hi - lo == len(where)
                       else torch.from_numpy(where)))
    return groups


def wide_scales(token_slots: np.ndarray, ranks: list[int], scales: list[float],
                max_rank: int) -> tuple[torch.Tensor, torch.Tensor, slice]:
    """([T, n*R] fp32 scales, [T, n*R] bool own columns, the flat columns they cover):
    slots lo..hi-1 are those in use."""
    used = token_slots[token_slots >= 0]
    lo, hi = int(used.min()), int(used.max()) + 1
    cols = np.arange((hi - lo) * max_rank)  # [n*R]
    col_slot, col_r = lo + cols // max_rank, cols % max_rank
    safe = np.maximum(token_slots, 0)[:, None]  # [T, 1]
    own = (col_slot[None, :] == token_slots[:, None]) & \
        (col_r[None, :] < np.asarray(ranks)[safe])  # [T, n*R]
    wide = np.where(own, np.asarray(scales, dtype=np.float32)[safe], np.float32(0))
    return (torch.from_numpy(wide.astype(np.float32)), torch.from_numpy(own),
            slice(lo * max_rank, hi * max_rank))


def build_metadata(token_slots: np.ndarray, ranks: list[int], scales: list[float],
                   max_rank: int, device: torch.device) -> LoraMetadata | None:
    """``token_slots`` [T] int (-1: no adapter) -> the step's metadata; None when no token
    uses an adapter. ``ranks``/``scales``: each slot's, host copies."""
    if not len(token_slots) or int(token_slots.max()) < 0:
        return None
    slots = torch.from_numpy(token_slots.astype(np.int32))
    if device.type != "cuda":
        wide, own, cols = (wide_scales(token_slots, ranks, scales, max_rank)
                           if len(token_slots) <= WIDE_MAX_TOKENS else (None, None, slice(0)))
        return LoraMetadata(slots, cpu_groups(token_slots), list(ranks), list(scales), wide,
                            own, cols)
    from kernels.lora import lora_segments

    slots = host_to_device(slots, device)
    sorted_tokens, starts = lora_segments(slots, len(ranks))
    return LoraMetadata(slots, None, list(ranks), sorted_tokens=sorted_tokens, starts=starts)
