"""Cuts of fused projections: each rank its share of every part, not a slice of the whole.

A fused weight stacks parts along its output rows: Phi-3's ``qkv_proj`` is ``[q (H*d);
k (KV*d); v (KV*d)]``, Phi-3's and GLM-4's ``gate_up_proj`` ``[gate (I); up (I)]``, and
GPT-NeoX's ``query_key_value`` interleaves them per head, ``[h0: q k v (3d); h1: ...]``.
A contiguous slice of the first two would hand rank 0 all of q and rank 1 all of k and v;
these cuts take each rank's heads (or intermediate units) out of every part, in the
module's own order, so its forward splits them the way it splits the whole.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from worker.engine.distributed.layers import HeadLinear, RowParallelLinear
from worker.engine.distributed.sharding import even_range, kv_head_range
from worker.engine.distributed.tp_config import TensorParallelError


class RowsLinear(nn.Module):
    """A fused projection holding the output rows ``rows`` of the full one (and their
    bias). No ``cut``: its rows are not one range, so a LoRA adapter on it is refused."""

    def __init__(self, full: nn.Linear, rows: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach()[rows].contiguous(), requires_grad=False)
        self.bias = (None if full.bias is None else nn.Parameter(
            full.bias.detach()[rows].contiguous(), requires_grad=False))
        self.in_features, self.out_features = self.weight.shape[1], self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)  # [..., len(rows)]


def _span(start: int, end: int, offset: int = 0) -> torch.Tensor:
    return torch.arange(offset + start, offset + end)


def qkv_rows(heads: int, head_dim: int, q: tuple[int, int],
             kv_heads: int, kv: tuple[int, int]) -> torch.Tensor:
    """Rows of a ``[q; k; v]`` fused weight for query heads ``q`` and KV heads ``kv``."""
    q_rows = _span(q[0] * head_dim, q[1] * head_dim)
    k_rows = _span(kv[0] * head_dim, kv[1] * head_dim, heads * head_dim)
    v_rows = _span(kv[0] * head_dim, kv[1] * head_dim, (heads + kv_heads) * head_dim)
    return torch.cat([q_rows, k_rows, v_rows])


def gate_up_rows(inter: int, rank: int, size: int) -> torch.Tensor:
    """Rows of a ``[gate; up]`` fused weight for rank's share of the intermediate units."""
    start, end = even_range(inter, rank, size)
    return torch.cat([_span(start, end), _span(start, end, inter)])


def shard_fused_mlp(mlp: Any, rank: int, size: int) -> None:
    """``gate_up_proj`` (an ``nn.Linear`` of ``[gate; up]``) by units, ``down_proj`` by rows:
    the module's ``chunk(2)`` then splits this rank's gate from its up."""
    inter = mlp.gate_up_proj.out_features // 2
    mlp.gate_up_proj = RowsLinear(mlp.gate_up_proj, gate_up_rows(inter, rank, size))
    mlp.down_proj = RowParallelLinear(mlp.down_proj, rank, size)


def shard_phi3_attention(attn: Any, config: Any, rank: int, size: int) -> None:
    """Phi-3's ``qkv_proj`` by heads of each part; its forward finds the q/k boundary from
    ``config.num_attention_heads`` and ``num_key_value_heads``, so the module gets a copy
    of the config naming its local heads (the model's own config stays whole)."""
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, \
        attn.head_dim
    q = even_range(heads, rank, size)
    kv = kv_head_range(kv_heads, rank, size)
    attn.qkv_proj = RowsLinear(attn.qkv_proj, qkv_rows(heads, head_dim, q, kv_heads, kv))
    attn.o_proj = RowParallelLinear(attn.o_proj, rank, size)
    local = copy.copy(attn.config)
    local.num_attention_heads = q[1] - q[0]
    attn.config = local
    attn.num_key_value_heads = kv[1] - kv[0]
    attn.num_key_value_groups = (q[1] - q[0]) // (kv[1] - kv[0])


def shard_neox_attention(attn: Any, config: Any, rank: int, size: int) -> None:
    """GPT-NeoX's ``query_key_value`` is per head ``[q k v]`` (3d rows each), so a rank's
    heads are one range of ``3d``-row blocks; ``dense`` by rows (bias added once)."""
    heads = config.num_attention_heads
    if getattr(config, "num_key_value_heads", heads) != heads:
        raise TensorParallelError(
            f"GPT-NeoX attention with {config.num_key_value_heads} KV heads for {heads} "
            "query heads: its fused layout has one of each per head")
    q = even_range(heads, rank, size)
    attn.query_key_value = HeadLinear(attn.query_key_value, 3 * attn.head_size, q)
    attn.dense = RowParallelLinear(attn.dense, rank, size)
