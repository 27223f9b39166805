"""One step's token-to-adapter-slot assignment, and the holder the projections read it from.

The runner builds a ``LoraMetadata`` once per step and puts it in the ``LoraStep`` that
every wrapped projection holds (an explicit object, no global); ``None`` there means no
row of the step uses an adapter, and the projections skip LoRA entirely. On a CPU the
metadata holds each slot's tokens (a slice when they are contiguous, as a prefill chunk's
are: no gather); on CUDA the token indices sorted by slot, computed on the device
(``kernels.lora.lora_segments``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.lora_reference import LoraGroups
from worker.engine.transfer import host_to_device


@dataclass(frozen=True)
class LoraMetadata:
    token_slots: torch.Tensor  # [T] int32 on the model's device, -1 = no adapter
    groups: LoraGroups | None  # CPU path
    ranks: list[int]  # [S] host: each slot's rank (the CPU path multiplies only that)
    sorted_tokens: torch.Tensor | None  # [T] int32, CUDA path: tokens sorted by slot
    starts: torch.Tensor | None  # [S + 1] int32, CUDA path: each slot's first sorted token


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


def build_metadata(token_slots: np.ndarray, ranks: list[int],
                   device: torch.device) -> LoraMetadata | None:
    """``token_slots`` [T] int (-1: no adapter) -> the step's metadata; None when no token
    uses an adapter."""
    if not len(token_slots) or int(token_slots.max()) < 0:
        return None
    slots = torch.from_numpy(token_slots.astype(np.int32))
    if device.type != "cuda":
        return LoraMetadata(slots, cpu_groups(token_slots), list(ranks), None, None)
    from kernels.lora import lora_segments

    slots = host_to_device(slots, device)
    sorted_tokens, starts = lora_segments(slots, len(ranks))
    return LoraMetadata(slots, None, list(ranks), sorted_tokens, starts)
