"""Partly filled last blocks in the prefix cache: what a finished request leaves behind.

The prefix cache names full blocks only, so a conversation's next turn, whose prompt is the
previous turn's prompt and answer plus a new message, found everything but the previous
turn's last block: the answer rarely ends on a block boundary, and up to ``block_size - 1``
tokens were computed again (15 of a returning turn's 64 new tokens in
``ops/bench/engine/kv_tier.py``,
a quarter of its forward). Here a request that finishes normally (a stop or its length)
leaves its partly filled last block cached under a key naming its parent block's hash and
the tokens it holds (``partial_key``), next to the full blocks. It is evicted before any
of them (at the front of the free list, where a block without a hash always went: keeping
it evicts no full block sooner), through the host tier when one is attached. A request
whose chain of full blocks ends where such a block continues with the same leading tokens
takes it (``PartialHit``) and computes from the first token after them.

A partial block is taken, not shared: the new owner writes past its kept tokens, so a
device hit leaves the cache (unregistered as it is claimed: it had no other holder), and a
host hit is copied into a fresh block that is not registered either. Why only at a normal
finish: the request's last token sampled was read back, so every position before it was
computed by a forward that completed (or, overlapped, runs before the next one on the same
stream); an aborted or failed request, or a preempted one, keeps nothing partial.

A mixin of ``BlockManager`` (its maps, free list and tier).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from worker.engine.request import Request

if TYPE_CHECKING:
    from worker.engine.kv.host_tier import HostTier

# After the parent hash: never the bytes of a token id (an id's high bytes are 0), so no
# partial key is the hash of a full block.
_TAG = b"partial|"


def partial_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a block holding ``tokens`` (fewer than a block) after ``parent``."""
    return hashlib.sha256(parent + _TAG + array("q", tokens).tobytes()).digest()


@dataclass(frozen=True)
class PartialHit:
    """A cached partly filled block continuing a request's chain: its key, how many
    leading tokens it holds, and its device block (None: it is in the host tier)."""

    key: bytes
    tokens: int
    block: int | None


class PartialBlocks:
    """Reads and writes the ``BlockManager``'s maps (see there)."""

    block_size: int
    enable_caching: bool
    tier: HostTier | None
    _tables: dict[str, list[int]]
    _ref_counts: list[int]
    _free: OrderedDict[int, None]
    _block_of: dict[bytes, int]
    _hash_of: dict[int, bytes]

    if TYPE_CHECKING:  # the BlockManager's own methods, declared for the type checker only
        def _hashes(self, request: Request, num_blocks: int) -> list[bytes]: ...

        def _root_of(self, request: Request) -> bytes: ...

        def _take_free_block(self) -> int: ...

        def free(self, request_id: str) -> None: ...

    def _parent(self, request: Request, block_index: int) -> bytes:
        if block_index == 0:
            return self._root_of(request)
        return self._hashes(request, block_index)[block_index - 1]

    def free_keeping_partial(self, request: Request) -> None:
        """``free`` the finishing request's blocks, keeping its last one if partly filled:
        under ``partial_key`` of its computed tokens, all but the last one (sampled, never
        run through the model). It stays at the front of the free list, where ``free``
        puts every block without a hash: the first evicted (through the host tier when one
        is attached), so keeping it pushes no full block out of the device cache sooner."""
        kept = self._partial_of(request)
        self.free(request.request_id)
        if kept is not None and kept[1] not in self._block_of:
            self._block_of[kept[1]] = kept[0]
            self._hash_of[kept[0]] = kept[1]

    def _partial_of(self, request: Request) -> tuple[int, bytes] | None:
        """The request's partly filled last block and its key, or None."""
        table = self._tables.get(request.request_id)
        if not self.enable_caching or not table:
            return None
        computed = min(request.num_computed_tokens, request.num_tokens - 1)
        full, kept = divmod(computed, self.block_size)
        if kept == 0 or full >= len(table):
            return None
        block = table[full]
        if self._ref_counts[block] != 1 or block in self._hash_of:
            return None
        start = full * self.block_size
        key = partial_key(self._parent(request, full), request.all_token_ids[start:computed])
        return block, key

    def hit_tokens(self, hits: Sequence[int | bytes | PartialHit]) -> int:
        """The tokens ``cached_prefix``'s answer covers."""
        if hits and isinstance(hits[-1], PartialHit):
            return (len(hits) - 1) * self.block_size + hits[-1].tokens
        return len(hits) * self.block_size

    def _partial_hit(self, request: Request, block_index: int, end: int) -> PartialHit | None:
        """The kept partial block with the most of the request's tokens from block
        ``block_index`` on, fewer than a block and not past token ``end``; None if none."""
        start = block_index * self.block_size
        most = min(self.block_size - 1, end - start)
        if most < 1:
            return None
        parent, tokens = self._parent(request, block_index), request.all_token_ids
        for n in range(most, 0, -1):
            key = partial_key(parent, tokens[start:start + n])
            block = self._block_of.get(key)
            if block is not None:
                return PartialHit(key, n, block)
            if self.tier is not None and key in self.tier:
                return PartialHit(key, n, None)
        return None

    def _take_partial(self, hit: PartialHit) -> int:
        """The device block of a partial hit, out of the cache (its new owner writes past
        the kept tokens), or a fresh block the host copy fills."""
        if hit.block is not None:
            del self._block_of[hit.key]
            del self._hash_of[hit.block]
            return hit.block
        assert self.tier is not None
        block = self._take_free_block()
        self.tier.restore(hit.key, block)
        self.tier.stats.hit_tokens += hit.tokens
        return block
