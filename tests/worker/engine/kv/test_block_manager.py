import pytest

from worker.engine.kv.block_manager import BlockManager


def test_allocate_grows_table_lazily_and_free_returns_everything():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate_slots("a", 5) is not None  # 2 blocks
    assert len(bm.block_table("a")) == 2
    assert bm.allocate_slots("a", 8) == []  # still fits in 2 blocks
    assert len(bm.allocate_slots("a", 9) or []) == 1
    assert bm.num_free_blocks == 5
    bm.free("a")
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_running_out_is_an_answer_not_an_exception():
    bm = BlockManager(num_blocks=3, block_size=4)
    assert bm.allocate_slots("a", 12) is not None
    assert bm.allocate_slots("b", 1) is None
    assert bm.block_table("b") == []  # nothing half-allocated
    assert bm.allocate_slots("a", 13) is None
    assert len(bm.block_table("a")) == 3
    bm.check_invariants()


def test_watermark_only_applies_when_admitting():
    bm = BlockManager(num_blocks=100, block_size=1, watermark=0.05)
    assert bm.allocate_slots("a", 95, admitting=True) is not None
    assert bm.allocate_slots("b", 1, admitting=True) is None
    assert bm.allocate_slots("a", 100) is not None  # running requests may use the reserve


def test_free_unknown_is_noop_and_tables_distinct():
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.free("nobody")
    bm.allocate_slots("a", 4)
    bm.allocate_slots("b", 4)
    assert not set(bm.block_table("a")) & set(bm.block_table("b"))
    bm.free("a")
    bm.free("a")  # double free is harmless
    bm.free("b")
    bm.check_invariants()
    assert bm.num_free_blocks == 6


@pytest.mark.parametrize("blocks,size", [(0, 16), (4, 0)])
def test_bad_sizes(blocks, size):
    with pytest.raises(ValueError):
        BlockManager(blocks, size)


# -- prefix caching ----------------------------------------------------------------------
from protocol.sampling import SamplingParams  # noqa: E402
from worker.engine.kv.block_manager import chain_hash  # noqa: E402
from worker.engine.request import Request  # noqa: E402


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4))


def _run(bm: BlockManager, req: Request, num_tokens: int | None = None) -> list[int]:
    """Admit ``req`` as the scheduler does: cached blocks first, then compute the rest."""
    hits = bm.cached_prefix(req)
    req.num_computed_tokens += len(hits) * bm.block_size
    total = num_tokens if num_tokens is not None else req.num_tokens
    assert bm.allocate_slots(req.request_id, total, cached=hits) is not None
    bm.cache_full_blocks(req, total)
    req.num_computed_tokens = total
    return hits


def test_chain_hash_depends_on_the_whole_prefix_and_the_salt():
    a = chain_hash(b"root", [1, 2, 3, 4])
    assert a == chain_hash(b"root", [1, 2, 3, 4])
    assert a != chain_hash(b"root", [1, 2, 3, 5]) and a != chain_hash(b"other", [1, 2, 3, 4])
    r1, r2 = _req("x", list(range(8))), _req("y", list(range(8)))
    assert BlockManager(4, 4, salt="m1").block_hashes(r1, 2) == \
        BlockManager(4, 4, salt="m1").block_hashes(r2, 2)
    assert BlockManager(4, 4, salt="m1").block_hashes(r1, 2) != \
        BlockManager(4, 4, salt="m2").block_hashes(_req("z", list(range(8))), 2)


def test_shared_prefix_blocks_are_reused_and_the_last_token_is_computed():
    bm = BlockManager(num_blocks=16, block_size=4, watermark=0)
    first = _req("a", list(range(10)))  # 2 full blocks + 2 tokens
    assert _run(bm, first) == []
    assert bm.num_cached_blocks == 2
    second = _req("b", list(range(8)) + [50, 51, 52])
    hits = _run(bm, second)
    assert hits == bm.block_table("a")[:2] and bm.block_table("b")[:2] == hits
    exact = _req("c", list(range(8)))  # exactly the 2 cached blocks: the last is recomputed
    assert _run(bm, exact) == bm.block_table("a")[:1]
    bm.check_invariants()
    for rid in "abc":
        bm.free(rid)
    assert bm.num_free_blocks == 16 and bm.num_cached_blocks >= 2
    bm.check_invariants()


def test_freed_cached_blocks_are_evicted_least_recently_used_and_junk_first():
    bm = BlockManager(num_blocks=6, block_size=2, watermark=0)
    old, new = _req("old", [1, 2, 3, 4, 9]), _req("new", [5, 6, 7, 8, 9])
    _run(bm, old)
    bm.free("old")
    _run(bm, new)
    bm.free("new")
    assert bm.num_cached_blocks == 4  # each left 2 full blocks; the partial ones hold no hash
    assert bm.allocate_slots("x", 4) is not None  # the 2 unhashed blocks go first
    assert bm.num_cached_blocks == 4
    assert bm.allocate_slots("x", 8) is not None  # then the least recently used: "old"
    assert bm.cached_prefix(_req("o", [1, 2, 3, 4, 9])) == []
    assert len(bm.cached_prefix(_req("n", [5, 6, 7, 8, 9]))) == 2
    bm.check_invariants()


def test_cached_blocks_need_no_free_room_when_held_and_count_when_free():
    bm = BlockManager(num_blocks=4, block_size=2, watermark=0)
    a = _req("a", [1, 2, 3, 4, 5])
    _run(bm, a)  # 3 blocks, 2 cached, all held
    b = _req("b", [1, 2, 3, 4, 6])
    hits = bm.cached_prefix(b)
    assert len(hits) == 2
    assert bm.allocate_slots("b", 5, cached=hits) is not None  # only 1 fresh block needed
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_forget_step_unregisters_what_was_not_computed():
    bm = BlockManager(num_blocks=8, block_size=2, watermark=0)
    bm.begin_step()
    a = _req("a", [1, 2, 3, 4, 5])
    _run(bm, a)
    assert bm.num_cached_blocks == 2
    bm.forget_step()
    assert bm.num_cached_blocks == 0
    assert bm.cached_prefix(_req("b", [1, 2, 3, 4, 5])) == []
    bm.check_invariants()


def test_caching_off_behaves_as_before():
    bm = BlockManager(num_blocks=8, block_size=2, enable_caching=False)
    _run(bm, _req("a", [1, 2, 3, 4, 5]))
    assert bm.num_cached_blocks == 0 and bm.cached_prefix(_req("b", [1, 2, 3, 4, 5])) == []
