"""The refusals at start and the shard arithmetic, without any process group."""

from __future__ import annotations

import pytest
import torch

from worker.engine.distributed.sharding import (
    column_shard,
    even_range,
    head_shard,
    kv_head_range,
    row_shard,
    vocab_range,
)
from worker.engine.distributed.tp_config import (
    TensorParallelError,
    TPConfig,
    check_devices,
    check_heads,
)


def test_size_beyond_visible_cuda_devices_is_refused_naming_both() -> None:
    with pytest.raises(TensorParallelError, match=r"size 4 exceeds the 2 visible"):
        check_devices(4, "cuda", 2)
    check_devices(4, "cpu", 0)  # CPU ranks share the host
    check_devices(2, "cuda", 2)


@pytest.mark.parametrize(("size", "heads", "kv", "message"), [
    (3, 32, 8, "does not divide the model's 32 attention heads"),
    (4, 32, 6, "does not divide the model's 6 KV heads"),
    (8, 24, 3, "not a multiple of the model's 3 KV heads"),
])
def test_heads_that_do_not_split_are_refused(size: int, heads: int, kv: int,
                                             message: str) -> None:
    with pytest.raises(TensorParallelError, match=message):
        check_heads(size, heads, kv)


def test_config_rejects_bad_rank_and_size() -> None:
    with pytest.raises(TensorParallelError):
        TPConfig(size=0)
    with pytest.raises(TensorParallelError):
        TPConfig(size=2, rank=2)
    assert not TPConfig().enabled and TPConfig(size=2, rank=1).enabled


def test_kv_heads_are_split_or_replicated() -> None:
    assert [kv_head_range(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # 2 KV heads over 4 ranks: ranks 0,1 share head 0 (their query heads group with it)
    assert [kv_head_range(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]


def test_shards_reassemble_the_weight() -> None:
    w = torch.arange(24.0).reshape(6, 4)
    assert torch.equal(torch.cat([column_shard(w, r, 3) for r in range(3)]), w)
    assert torch.equal(torch.cat([row_shard(w, r, 2) for r in range(2)], dim=1), w)
    assert torch.equal(head_shard(w, 2, (1, 2)), w[2:4])
    with pytest.raises(ValueError, match="does not split evenly"):
        even_range(5, 0, 2)


def test_vocab_ranges_cover_an_uneven_vocabulary() -> None:
    ranges = [vocab_range(10, r, 3) for r in range(3)]
    assert ranges == [(0, 4), (4, 8), (8, 10)]
