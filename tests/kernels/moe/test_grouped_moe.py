"""The grouped torch MoE path (the CPU path) equals the naive per-expert loop."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.moe.grouped import grouped_moe, silu_expert


@pytest.mark.parametrize("tokens, top_k, pool", [(1, 1, 6), (1, 4, 6), (7, 2, 2), (20, 4, 6)])
def test_grouped_matches_per_expert_loop(tokens, top_k, pool) -> None:
    gen = torch.Generator().manual_seed(tokens * 10 + top_k)
    experts, hidden, inter = 6, 24, 16
    ids = torch.stack([torch.randperm(max(pool, top_k), generator=gen)[:top_k]
                       for _ in range(tokens)])  # pool < experts: some experts unchosen
    w = torch.softmax(torch.randn(tokens, top_k, generator=gen), -1)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen)
    w2 = torch.randn(experts, hidden, inter, generator=gen)
    got = grouped_moe(x, ids, w, silu_expert(w13, w2), experts)
    torch.testing.assert_close(got, reference.moe_experts(x, w13, w2, ids, w),
                               atol=1e-4, rtol=1e-4)


def test_out_of_range_expert_is_refused() -> None:
    x, w13, w2 = torch.zeros(2, 4), torch.zeros(3, 8, 4), torch.zeros(3, 4, 4)
    ids = torch.tensor([[0], [3]])
    with pytest.raises(ValueError, match="num_experts"):
        grouped_moe(x, ids, torch.ones(2, 1), silu_expert(w13, w2), 3)
