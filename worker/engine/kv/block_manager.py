"""Paged KV-cache bookkeeping on the host: free list, reference counts, block tables,
and the automatic prefix cache.

The model runner owns the KV tensors; this class only decides which block ids each
request may write to. Each table is also a row of one host array (``host_tables.py``),
which the step's inputs are built from. Running out of blocks is a normal answer (``None``) that the
scheduler turns into waiting or preemption — never an exception.

Prefix caching (after vLLM v1's ``KVCacheManager``, written anew): a *full* block is
identified by a hash chained over (parent block's hash, its token ids), rooted in a salt
naming whatever else changes the KV (model, cache dtype, block size) and the request's
partition (``_root_of``: cache scope, LoRA adapter): no lookup crosses partitions, so one
tenant's blocks time nothing of another's prompts (``docs/tenants.md``). Once a request has
allocated a block that becomes full this step, the block is registered under its hash. A
request reaching a block boundary with only cached blocks ahead (a new request, a
recomputed one after preemption, one resumed after a crash) takes the longest cached
chain instead of computing it. Freed blocks keep their contents and hash; the free list
is in least-recently-used order, so a cached block is evicted only when the pool needs a
block and nothing older is free. Blocks with no hash (partial last blocks) are reused
first. Registration happens at allocation, so a request admitted later in the same step
can share blocks another computes in that very step (each layer stores every token's
K/V before any attention reads it); ``forget_step`` undoes this step's registrations when
the forward fails, so no block is ever cached with contents that were not computed.

With a host tier (``kv/host_tier.py``, ``attach_tier``), an evicted block with a hash is
copied to host memory first, and ``cached_prefix`` goes on looking there: a host hit is
returned as its hash and ``allocate_slots`` gives it a fresh block that the copy fills.
A finished request's partly filled last block is kept too (``block_partials.py``). The
hashes of blocks that leave the cache for good can be listed (``block_evictions.py``).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from worker.engine.kv.block_evictions import EvictionLog
from worker.engine.kv.block_partials import PartialBlocks, PartialHit
from worker.engine.kv.block_registrations import StepRegistrations
from worker.engine.kv.host_tables import HostTables
from worker.engine.kv.host_tier import HostTier
from worker.engine.request import Request


@dataclass
class CacheStats:
    """Prefix-cache counters: tokens looked up at admission and tokens found cached."""

    queries: int = 0
    hits: int = 0


def chain_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The hash of one full block given its parent's. SHA-256, not Python's ``hash``: a
    collision would hand one request another's KV, and tuple hashes can be forced."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class BlockManager(StepRegistrations, PartialBlocks, EvictionLog):
    def __init__(
        self, num_blocks: int, block_size: int, watermark: float = 0.01,
        enable_caching: bool = True, salt: str = "",
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        # Blocks held back when admitting *new* requests, so running ones can still grow.
        self.watermark_blocks = int(watermark * num_blocks)
        # Free blocks, least recently used first (popped for allocation from the front).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self._root = hashlib.sha256(f"ferry-kv|{salt}|{block_size}".encode()).digest()
        self._hash_of: dict[int, bytes] = {}  # block -> hash, for cached blocks
        self._block_of: dict[bytes, int] = {}  # hash -> block
        # Each table's row in a host array (input building reads them vectorized), and
        # per row the leading table blocks hashed (registered in the prefix cache).
        self.host = HostTables()
        self._step: list[tuple[str, int, bytes]] = []  # registrations since begin_step
        self._prev_step: list[tuple[str, int, bytes]] = []  # the step's before
        self.stats = CacheStats()
        self.tier: HostTier | None = None  # the KV cache's host tier, when on
        self.evicted: list[bytes] | None = None  # hashes gone for good, when tracked

    def attach_tier(self, tier: HostTier | None) -> None:
        """Keep evicted cached blocks in ``tier`` (needs the prefix cache)."""
        self.tier = tier if self.enable_caching else None
        if self.tier is not None:
            self.tier.evicted = self.evicted

    def flush_copies(self, pool: object) -> None:
        """Run the host tier's queued copies against the device pool (before a forward)."""
        if self.tier is not None and self.tier.has_pending:
            self.tier.flush(pool)  # type: ignore[arg-type]

    # -- queries -----------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any request (cached ones included: they are evictable)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def tables(self) -> dict[str, list[int]]:
        """Every request's block table (read only: the buffers on the device mirror it)."""
        return self._tables

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, request_id: str, total_tokens: int) -> int:
        held = len(self._tables.get(request_id, ()))
        return max(0, self.blocks_needed(total_tokens) - held)

    def block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The chained hashes of the request's first ``num_blocks`` full blocks (cached on
        the request and extended as its tokens grow)."""
        return self._hashes(request, num_blocks)[:num_blocks]

    def _hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The request's own list of block hashes, grown to at least ``num_blocks``."""
        hashes, bs, tokens = request.block_hashes, self.block_size, request.all_token_ids
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else self._root_of(request)
            hashes.append(chain_hash(parent, tokens[i * bs:(i + 1) * bs]))
        return hashes

    def _root_of(self, request: Request) -> bytes:
        """The hash chain's root, which every key of the request's blocks (full, kept
        partial, host-tier copies) descends from: they match only the same cache scope's
        (a tenant, a sharing group, a salt) and the same LoRA adapter's (its
        ``cache_key``), never the base model's. Both None: the shared default space."""
        root = self._root
        # ASCII after the root: never the bytes of a block (token ids' high bytes are 0)
        if request.cache_scope is not None:
            root = hashlib.sha256(root + b"scope|" + request.cache_scope.encode()).digest()
        if request.lora is not None:
            root = hashlib.sha256(root + b"lora|" + request.lora.cache_key.encode()).digest()
        return root

    def cached_prefix(self, request: Request) -> list[int | bytes | PartialHit]:
        """Cached blocks that continue the request's table from where it has computed, up
        to its last token (whose logits must be computed): a device block id, or the hash
        of a block the host tier holds, and last maybe a kept partial block
        (``block_partials.py``). Empty unless the request stands at a block boundary with
        nothing allocated ahead."""
        table = self._tables.get(request.request_id, [])
        computed = request.num_computed_tokens
        if not self.enable_caching or computed != len(table) * self.block_size:
            return []
        end = min(request.num_tokens - 1, request.num_known_tokens)
        limit = end // self.block_size
        if limit < len(table) or end <= computed:
            return []
        hits: list[int | bytes | PartialHit] = []
        tier = self.tier
        for h in self.block_hashes(request, limit)[len(table):]:
            block = self._block_of.get(h)
            if block is not None:
                hits.append(block)
            elif tier is not None and h in tier:
                hits.append(h)
            else:
                break
        partial = self._partial_hit(request, len(table) + len(hits), end)
        if partial is not None:
            hits.append(partial)
        return hits

    # -- mutations ---------------------------------------------------------------------
    def allocate_slots(
        self, request_id: str, total_tokens: int, *, admitting: bool = False,
        cached: Sequence[int | bytes | PartialHit] = (),
    ) -> list[int] | None:
        """Grow the request's table to hold ``total_tokens`` tokens: first the ``cached``
        blocks (from ``cached_prefix``; a hash is restored from the host tier into a
        fresh block), then fresh ones.

        Returns the newly added fresh block ids, or ``None`` (nothing changed) when the
        free list cannot cover them — keeping the watermark in reserve when ``admitting``.
        """
        table = self._tables.get(request_id, [])
        need = max(0, self.blocks_needed(total_tokens) - len(table) - len(cached))
        partial = cached[-1] if cached and isinstance(cached[-1], PartialHit) else None
        device = [b for b in cached if isinstance(b, int)]
        if partial is not None and partial.block is not None:
            device.append(partial.block)
        restores = len(cached) - len(device)
        reclaimed = sum(1 for block in device if self._ref_counts[block] == 0)
        reserve = self.watermark_blocks if admitting else 0
        if need + restores > len(self._free) - reclaimed - reserve:
            return None
        if request_id not in self._tables:
            self._tables[request_id] = table
            self.host.assign(request_id)
        row = self.host.row_of(request_id)
        assert row is not None
        for block in device:  # claimed before a restore could evict one of them
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1
        if restores and self.tier is not None:  # no restore may evict the next one
            held = [entry for entry in cached if isinstance(entry, bytes)]
            self.tier.hold(held if partial is None or partial.block is not None
                           else [*held, partial.key])
        hits = [entry if isinstance(entry, int) else self._restore(entry)
                if isinstance(entry, bytes) else self._take_partial(entry) for entry in cached]
        table.extend(hits)
        if hits:  # a partial block is registered once it is full, by cache_full_blocks
            self.host.registered[row] = len(table) - (partial is not None)
        new_blocks = [self._take_free_block() for _ in range(need)]
        table.extend(new_blocks)
        if hits or new_blocks:
            self.host.append(row, [*hits, *new_blocks])
        return new_blocks

    def grow_decodes(self, requests: list[Request], rows: list[int], grow: list[bool],
                     register: list[bool]) -> int:
        """Decode rows, in order, beyond their one token: a fresh block at the end of the
        table where ``grow`` (a decode entering a new block: ``allocate_slots`` for that
        case), then ``cache_full_blocks`` where ``register``. Stops before the first row
        that finds no free block (nothing changed for it); returns the rows done."""
        tables, host = self._tables, self.host
        for i, request in enumerate(requests):
            if grow[i]:
                if not self._free:
                    return i
                table = tables[request.request_id]
                table.append(self._take_free_block())
                host.append_one(rows[i], table[-1])
            if register[i]:
                self.cache_full_blocks(request, request.num_tokens)
        return len(requests)

    def _take_free_block(self) -> int:
        block, _ = self._free.popitem(last=False)
        old = self._hash_of.pop(block, None)  # evict: its contents are about to change
        if old is not None and self._block_of.get(old) == block:
            del self._block_of[old]
            if self.tier is not None:
                self.tier.offload(block, old)
            elif self.evicted is not None:
                self.evicted.append(old)
        self._ref_counts[block] = 1
        return block

    def _restore(self, block_hash: bytes) -> int:
        """A fresh block registered under ``block_hash``, filled from the host tier."""
        assert self.tier is not None
        block = self._take_free_block()
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        self.tier.restore(block_hash, block)
        self.tier.stats.hit_tokens += self.block_size
        return block

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that are full once ``num_tokens`` are computed."""
        if not self.enable_caching:
            return
        rid = request.request_id
        row = self.host.row_of(rid)
        if row is None:
            return
        table = self._tables[rid]
        # blocks holding a pending token (placeholder) wait for a later step's call
        full = min(min(num_tokens, request.num_known_tokens) // self.block_size, len(table))
        start = int(self.host.registered[row])
        if full <= start:
            return
        hashes = self._hashes(request, full)
        for i in range(start, full):
            h, block = hashes[i], table[i]
            if h not in self._block_of and block not in self._hash_of:
                self._block_of[h] = block
                self._hash_of[block] = h
                self._step.append((rid, block, h))
        self.host.registered[row] = full

    def free(self, request_id: str) -> None:
        """Release every block the request holds (a no-op for unknown ids). Cached blocks
        go to the back of the LRU list, tail blocks first; blocks without a hash to the
        front (they hold nothing worth keeping)."""
        table = self._tables.pop(request_id, None)
        self.host.release(request_id)
        if not table:
            return
        for block in reversed(table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
                if block not in self._hash_of:
                    self._free.move_to_end(block, last=False)
