"""The host tier under tensor parallelism: every rank copies the same blocks each step.

Rank 0's tier decides what moves (its slot map, its LRU); each rank holds its own heads'
share of every block, so each follower keeps a host pool of the same slots shaped like
its own device pool, and applies rank 0's copies to it. Rank 0 broadcasts a step's copies
(``HostCopies``) just before that step's inputs, only on steps that have any; a follower
replays them on its pool before the forward, in the order rank 0 does (out, then in).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from worker.engine.kv.host_tier import HostTier


@dataclass(frozen=True)
class HostCopies:
    """One step's host-tier copies: (device block, host slot) out, (host slot, device
    block) in, and the tier's size in blocks (a follower sizes its mirror from it)."""

    outs: list[tuple[int, int]]
    ins: list[tuple[int, int]]
    num_slots: int


def lead_flush(blocks: Any, pool: torch.Tensor, send: Any | None) -> None:
    """Rank 0: hand this step's copies to the followers (``send``), then run them here."""
    tier: HostTier | None = blocks.tier
    if send is not None and tier is not None and tier.has_pending:
        outs, ins = tier.pending()
        send(HostCopies(outs, ins, tier.num_blocks))
    blocks.flush_copies(pool)


class TierMirror:
    """A follower's host pool: rank 0's slots, this rank's heads; made at the first copy."""

    def __init__(self) -> None:
        self.tier: HostTier | None = None

    def replay(self, copies: HostCopies, pool: torch.Tensor) -> None:
        """Apply rank 0's copies to this rank's device ``pool`` ([layers, 2, blocks,
        block_size, Hkv, D]) and its host mirror."""
        if self.tier is None:
            layers, two, _, block_size, heads, dim = pool.shape
            self.tier = HostTier(copies.num_slots, (layers, two, block_size, heads, dim),
                                 pool.dtype, pool.device)
        self.tier.replay(pool, copies.outs, copies.ins)
