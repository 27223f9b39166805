"""The prefix cache's list of blocks gone for good (what prefix affinity's book drops).

Without a host tier, a freed cached block taken for other content is listed, once; one
still cached is not, nor one that came back before the drain. With a tier, a block only
moved to the host is not listed; one the tier cannot keep (a host slot reused for another
block, or no slot free) is. A registration a failed step takes back is listed. Nothing is
recorded until tracking is turned on.
"""

from __future__ import annotations

import torch

from protocol.sampling import SamplingParams
from worker.engine.kv.block_manager import BlockManager
from worker.engine.kv.host_tier import HostTier
from worker.engine.request import Request

BS = 4


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def _run(bm: BlockManager, rid: str, tokens: list[int], keep: bool = False) -> Request:
    """Admit, compute (register the full blocks) and, unless ``keep``, free a request."""
    request = _request(rid, tokens)
    assert bm.allocate_slots(rid, len(tokens), cached=bm.cached_prefix(request)) is not None
    bm.cache_full_blocks(request, len(tokens))
    if not keep:
        bm.free(rid)
    return request


def _tiered(device_blocks: int, host_blocks: int) -> tuple[BlockManager, HostTier,
                                                           torch.Tensor]:
    pool = torch.zeros(2, 2, device_blocks + 1, BS, 1, 3)  # [layers, 2, blocks, bs, Hkv, D]
    tier = HostTier.for_pool(pool, host_blocks * pool[:, :, 0].numel() * pool.element_size())
    assert tier is not None and tier.num_blocks == host_blocks
    bm = BlockManager(device_blocks, BS, watermark=0)
    bm.attach_tier(tier)
    bm.track_evictions()
    return bm, tier, pool


def test_a_reused_cached_block_is_listed_once_and_a_cached_one_never() -> None:
    bm = BlockManager(4, BS, watermark=0)
    bm.track_evictions()
    a = _run(bm, "a", list(range(8)))  # two full blocks, freed: still cached
    held = bm.block_hashes(a, 2)
    assert bm.drain_evicted() == []
    _run(bm, "b", list(range(100, 108)))  # two free blocks: a's stay cached
    assert bm.drain_evicted() == [] and bm.num_cached_blocks == 4
    _run(bm, "c", list(range(200, 208)), keep=True)  # reuses a's blocks (least recent)
    gone = bm.drain_evicted()
    assert sorted(gone) == sorted(held) and len(gone) == len(set(gone))
    assert bm.drain_evicted() == []  # drained
    bm.check_invariants()


def test_a_hash_evicted_twice_is_listed_once_and_one_back_in_the_cache_not_at_all() -> None:
    bm = BlockManager(2, BS, watermark=0)
    bm.track_evictions()
    a = _run(bm, "a", list(range(4)))
    _run(bm, "b", list(range(100, 104)))
    _run(bm, "c", list(range(200, 208)))  # evicts a and b
    _run(bm, "a2", list(range(4)))  # a computed again: cached once more...
    _run(bm, "d", list(range(300, 308)))  # ...and evicted again (with c)
    gone = bm.drain_evicted()
    assert gone.count(bm.block_hashes(a, 1)[0]) == 1 and len(gone) == len(set(gone))
    _run(bm, "e", list(range(400, 408)))  # evicts d's blocks...
    _run(bm, "d2", list(range(300, 304)))  # ...and d's first comes back before the drain
    d_first = bm.block_hashes(_request("d", list(range(300, 308))), 1)[0]
    assert d_first not in bm.drain_evicted()


def test_nothing_is_recorded_until_tracking_is_on() -> None:
    bm = BlockManager(2, BS, watermark=0)
    _run(bm, "a", list(range(8)))
    _run(bm, "b", list(range(100, 108)))  # evicts a
    assert bm.evicted is None and bm.drain_evicted() == []


def test_with_a_host_tier_a_block_moved_there_is_kept_and_one_it_cannot_hold_listed() -> None:
    bm, tier, pool = _tiered(device_blocks=3, host_blocks=2)
    a = _run(bm, "a", list(range(8)))
    a0, a1 = bm.block_hashes(a, 2)
    b = _run(bm, "b", list(range(100, 108)))  # a's second block moves to the host tier
    b0, b1 = bm.block_hashes(b, 2)
    bm.flush_copies(pool)
    assert a1 in tier and bm.drain_evicted() == []  # a0 on the device, a1 on the host
    # a again: a0 from the device, a1 restored from the host into a block b1 held (b1
    # to the host's last free slot), and a fresh block for its last token, which b0 held:
    # no slot is free of this step's copies, so b0 leaves both tiers
    again = _request("a2", list(range(8)) + [9])
    hits = bm.cached_prefix(again)
    assert len(hits) == 2 and isinstance(hits[0], int) and hits[1] == a1
    assert bm.allocate_slots("a2", 9, cached=hits) is not None
    bm.flush_copies(pool)
    assert bm.drain_evicted() == [b0] and b1 in tier
    # the host reuses its two slots for other blocks: b1 is gone; a1, on the device
    # again, is not
    tier.offload(2, b"x" * 32)
    tier.offload(2, b"y" * 32)
    bm.flush_copies(pool)
    assert a1 not in tier and b1 not in tier
    assert bm.drain_evicted() == [b1]
    bm.check_invariants()


def test_with_a_full_tier_an_eviction_it_cannot_copy_is_listed() -> None:
    bm, tier, pool = _tiered(device_blocks=3, host_blocks=1)
    a = _run(bm, "a", list(range(12)))
    _run(bm, "b", list(range(100, 112)))  # three evictions in one step, one host slot
    kept = [h for h in bm.block_hashes(a, 3) if h in tier]
    gone = bm.drain_evicted()
    assert len(kept) == 1 and sorted(gone + kept) == sorted(bm.block_hashes(a, 3))
    assert tier.stats.dropped == 2
    bm.flush_copies(pool)


def test_a_registration_taken_back_is_listed() -> None:
    bm = BlockManager(4, BS, watermark=0)
    bm.track_evictions()
    bm.begin_step()
    a = _run(bm, "a", list(range(8)), keep=True)
    bm.forget_step()  # the forward failed: never computed
    assert sorted(bm.drain_evicted()) == sorted(bm.block_hashes(a, 2))
    bm.check_invariants()
