"""The KV cache's host tier: evicted cached blocks copied to host memory and back.

Unit level: a block evicted with a hash is copied out before the forward can overwrite
it, a prompt continuing on the host gets fresh blocks filled from there (bytes equal),
a full tier evicts its least recently used copy but never one read this step, a forgotten
hash (failed forward) is dropped. Engine level: a pool small enough to preempt, tier on
vs off vs a roomy pool: the same greedy tokens, and the tier really restored blocks.
"""

from __future__ import annotations

import pytest
import torch

from protocol.sampling import SamplingParams
from tests.checkpoints import build_checkpoint
from tests.worker.engine.kv.test_prefix_cache import _run, _workload
from worker import Engine, EngineConfig
from worker.engine.kv.block_manager import BlockManager
from worker.engine.kv.host_tier import HostTier, host_tier_bytes
from worker.engine.request import Request

BS = 4


def _pool(blocks: int) -> torch.Tensor:
    # [layers, 2, blocks + 1 scratch, block_size, Hkv, D]
    return torch.zeros(2, 2, blocks + 1, BS, 1, 3)


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def _fill(pool: torch.Tensor, table: list[int], seed: float) -> None:
    for i, block in enumerate(table):
        pool[:, :, block] = seed + i


def _cached_then_freed(host_blocks: int, tokens: int
                       ) -> tuple[torch.Tensor, BlockManager, HostTier, torch.Tensor]:
    """A 4-block pool with a ``host_blocks`` tier, after request "a" of ``tokens`` tokens
    computed (its blocks filled with known values, returned) and freed: its full blocks
    stay cached on the device until something evicts them."""
    pool = _pool(4)
    bm = BlockManager(4, BS, watermark=0)
    tier = HostTier.for_pool(pool, host_blocks * pool[:, :, 0].numel() * pool.element_size())
    assert tier is not None and tier.num_blocks == host_blocks
    bm.attach_tier(tier)
    first = _request("a", list(range(tokens)))
    assert bm.allocate_slots("a", tokens, cached=bm.cached_prefix(first)) is not None
    bm.cache_full_blocks(first, tokens)
    _fill(pool, bm.block_table("a"), 10.0)
    saved = pool[:, :, bm.block_table("a")[:tokens // BS]].clone()
    bm.free("a")
    return pool, bm, tier, saved


def test_evicted_blocks_come_back_from_the_host() -> None:
    pool, bm, tier, saved = _cached_then_freed(10, 13)  # 3 full blocks + 1 token
    other = _request("b", list(range(100, 116)))  # takes every block: a's are evicted
    assert bm.allocate_slots("b", 16, cached=bm.cached_prefix(other)) is not None
    assert tier.has_pending and tier.stats.offloaded == 3
    bm.flush_copies(pool)  # copies out land before b's forward overwrites the blocks
    _fill(pool, bm.block_table("b"), 50.0)
    bm.free("b")
    again = _request("c", list(range(13)))
    hits = bm.cached_prefix(again)
    assert len(hits) == 3 and all(isinstance(h, bytes) for h in hits)
    assert bm.allocate_slots("c", 13, cached=hits) is not None
    bm.flush_copies(pool)
    assert torch.equal(pool[:, :, bm.block_table("c")[:3]], saved)
    assert tier.stats.restored == 3 and tier.stats.hit_tokens == 3 * BS
    bm.check_invariants()


def test_full_tier_keeps_slots_read_this_step() -> None:
    tier = HostTier(2, (1, 2, BS, 1, 3), torch.float32, torch.device("cpu"))
    tier.offload(0, b"x")
    tier.offload(1, b"y")
    tier.flush(_pool(4)[:1])
    tier.restore(b"x", 2)  # x is read this step: y (older in use now) goes instead
    tier.offload(3, b"z")
    assert b"x" in tier and b"z" in tier and b"y" not in tier
    tier.offload(0, b"w")  # x and z busy this step: not copied
    assert tier.stats.dropped == 1 and b"w" not in tier
    tier.forget(b"z")  # busy: its slot is freed only after the flush
    tier.offload(1, b"v")
    assert b"v" not in tier
    tier.flush(_pool(4)[:1])
    tier.offload(1, b"v")
    assert b"v" in tier


def test_restoring_into_a_full_tier_keeps_the_other_hits() -> None:
    """A host hit of two blocks, the tier full: the block the first restore evicts from
    the device is copied out, and the tier's LRU slot then is the second hit. It must stay
    (a worker died here of a KeyError, #32's kill-mid-swap test)."""
    pool, bm, tier, saved = _cached_then_freed(2, 9)  # 2 full blocks + 1 token
    other = _request("b", list(range(100, 116)))  # 4 full blocks: a's go to the tier
    assert bm.allocate_slots("b", 16, cached=bm.cached_prefix(other)) is not None
    bm.cache_full_blocks(other, 16)
    bm.flush_copies(pool)
    _fill(pool, bm.block_table("b"), 50.0)
    bm.free("b")
    assert tier.num_cached == 2
    again = _request("c", list(range(9)))
    hits = bm.cached_prefix(again)
    assert len(hits) == 2 and all(isinstance(h, bytes) for h in hits)
    assert bm.allocate_slots("c", 9, cached=hits) is not None
    bm.flush_copies(pool)
    assert torch.equal(pool[:, :, bm.block_table("c")[:2]], saved)
    # the three of b's blocks c takes (two restored into, one fresh) found no free slot
    assert tier.stats.restored == 2 and tier.stats.dropped == 3
    bm.check_invariants()


def test_sizes() -> None:
    pool = _pool(4)
    assert HostTier.for_pool(pool, 0) is None
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert host_tier_bytes(0, cuda) == 0 and host_tier_bytes(123, cpu) == 123
    assert 0 < host_tier_bytes(None, cuda) <= 16 << 30
    assert host_tier_bytes(None, cpu) == 0  # the device pool is host memory already
    with pytest.raises(ValueError):
        host_tier_bytes(-1, cpu)
    with pytest.raises(ValueError):
        HostTier(0, (1, 2, BS, 1, 1), torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_checkpoint("llama", tmp_path_factory.mktemp("kv-tier"))


def _engine(path: str, num_blocks: int, host_bytes: int) -> Engine:
    return Engine(EngineConfig.create(
        path, num_blocks=num_blocks, block_size=8, max_num_seqs=6, max_num_batched_tokens=96,
        long_prefill_token_threshold=24, device="cpu", host_memory_bytes=host_bytes))


def test_outputs_identical_with_swaps_and_host_hits(checkpoint: str) -> None:
    roomy = _engine(checkpoint, 400, 0)
    jobs = _workload(roomy.runner.shape.vocab_size)
    want = _run(roomy, jobs)
    small_off = _engine(checkpoint, 36, 0)
    assert small_off.block_manager.tier is None
    small_on = _engine(checkpoint, 36, 64 << 20)
    got_off, got_on = _run(small_off, jobs), _run(small_on, jobs)
    assert got_on == want and got_off == want
    tier = small_on.block_manager.tier
    assert tier is not None
    assert tier.stats.restored > 0, tier.stats
    assert small_on.scheduler.num_preemptions > 0
    # the tier saved computing: fewer prompt tokens run than with the tier off
    assert small_on.block_manager.stats.hits > small_off.block_manager.stats.hits
    stats = small_on.stats()  # what the heartbeat, /metrics and ferry top show
    assert stats.prefix_cache_host_hits == tier.stats.hit_tokens > 0
    assert stats.kv_host_blocks_total == tier.num_blocks and stats.kv_host_blocks_cached > 0
    assert small_off.stats().kv_host_blocks_total == 0
    small_on.block_manager.check_invariants()
