import pytest

from worker.engine.block_manager import BlockManager


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
