"""Multi-LoRA on a tensor-parallel worker: rank 0 tells its followers each step's adapters.

Rank 0 alone registers adapters, pins them to requests and picks the slots (``manager.py``);
its followers must hold the same adapters in the same slots and read the same token ->
slot map, or the row-parallel all-reduces would sum different deltas. So before each
forward with a row on an adapter or a slot written, rank 0 broadcasts a ``LoraStepSync``:
the slots it wrote since the last step, in the order it wrote them, with the adapters'
host weights (every rank then holds the same adapter, cut to its shard by
``LoraSlots.write_at``), and the step's token -> slot map. Other steps send nothing: a
follower clears its metadata after every step. The weights travel once per slot write,
not per step; a step adds only its map.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from worker.engine.lora.adapter import LoraAdapter
from worker.engine.lora.metadata import LoraMetadata, build_metadata
from worker.engine.lora.slots import LoraSlots


@dataclass(frozen=True)
class LoraStepSync:
    """What a follower needs before it runs the step rank 0 broadcasts next."""

    writes: tuple[tuple[int, LoraAdapter], ...]  # (slot, adapter) in rank 0's order
    token_slots: np.ndarray | None  # [T] int64, -1: the base model; None: no adapter row


def take_sync(slots: LoraSlots, token_slots: np.ndarray | None) -> LoraStepSync:
    """Rank 0: the journal's writes since the last step (drained) and this step's map."""
    journal = slots.journal if slots.journal is not None else []
    writes = tuple(journal)
    journal.clear()
    return LoraStepSync(writes, token_slots)


def apply_sync(slots: LoraSlots, sync: LoraStepSync) -> LoraMetadata | None:
    """A follower: replay rank 0's slot writes, then this step's metadata (or None)."""
    for slot, adapter in sync.writes:
        slots.write_at(slot, adapter)
    if sync.token_slots is None:
        return None
    return build_metadata(sync.token_slots, slots.ranks, slots.scales, slots.max_rank,
                          slots.scale.device)
