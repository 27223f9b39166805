"""Which slice of each weight a rank keeps: column, row, KV-head and vocab splits.

Pure index arithmetic on tensors, so a loader can take each rank's slice straight from
the checkpoint's (lazily mapped) tensors without building the whole model on any rank.
Weights follow ``nn.Linear``'s layout: ``[out_features, in_features]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def even_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of rank's equal share of ``total`` (which ``size`` must divide)."""
    if total % size:
        raise ValueError(f"{total} does not split evenly over {size} ranks")
    part = total // size
    return rank * part, (rank + 1) * part


def kv_head_range(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of the KV heads a rank holds: its share, or one replicated head.

    With fewer KV heads than ranks each head serves ``size // num_kv_heads`` ranks, the
    ranks whose query heads it groups with.
    """
    if num_kv_heads >= size:
        return even_range(num_kv_heads, rank, size)
    head = rank // (size // num_kv_heads)
    return head, head + 1


def column_shard(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank's rows of a column-parallel weight (or bias): output features split."""
    start, end = even_range(weight.shape[0], rank, size)
    return weight[start:end]


def row_shard(weight: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank's columns of a row-parallel weight: input features split (bias is not)."""
    start, end = even_range(weight.shape[1], rank, size)
    return weight[:, start:end]


def head_shard(weight: torch.Tensor, head_dim: int, heads: tuple[int, int]) -> torch.Tensor:
    """Rows of a q/k/v projection (or its bias) for heads ``[start, end)``."""
    return weight[heads[0] * head_dim:heads[1] * head_dim]


def vocab_range(vocab_size: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of the vocabulary rows a rank holds; the last takes the remainder."""
    part = -(-vocab_size // size)  # ceil
    start = min(rank * part, vocab_size)
    return start, min(start + part, vocab_size)


@dataclass(frozen=True)
class ShardCut:
    """Which slice of a full projection a sharded linear holds, for what must be cut like
    its weight (a LoRA adapter's matrices): ``axis`` "out" keeps output features
    ``[start, end)`` (column-parallel, q/k/v heads), "in" keeps input features (row
    parallel: its partial outputs are summed over the ranks); ``full``: that axis's
    length in the unsharded projection."""

    axis: str  # "out" | "in"
    start: int
    end: int
    full: int
