"""Grouped mixture of experts in torch: the CPU path, for any expert layout.

Transformers' per-expert loop builds a ``[E + 1, K, T]`` one-hot mask and runs a
``torch.where`` per expert to find its tokens. Here the ``T * K`` (token, expert) pairs
are sorted by expert once; each chosen expert then takes one contiguous slice of the
gathered rows and runs it as one matmul per projection; the router weights scale the
sorted rows in one multiply, one scatter puts them back in pair order, and the top-k
sum is a ``view().sum()``. Experts nobody chose cost nothing. The expert itself is a
callable (``expert(e, rows [n, H]) -> [n, H]``), so a layout with biases, transposed
weights or another gate (gpt-oss) runs here as well as the SiLU-gated one
(``silu_expert``), which is the layout the fused Triton kernel takes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Expert = Callable[[int, torch.Tensor], torch.Tensor]


def silu_expert(w13: torch.Tensor, w2: torch.Tensor) -> Expert:
    """The SiLU-gated expert of ``w13`` [E, 2I, H] (gate rows, then up rows), ``w2`` [E, H, I]."""
    inter = w2.shape[2]

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(rows, w13[e])  # [n, 2I]
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # [n, I]
        return F.linear(act, w2[e])  # [n, H]

    return expert


def grouped_moe(
    hidden: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, K] expert ids in [0, num_experts)
    topk_weights: torch.Tensor,  # [T, K]
    expert: Expert,
    num_experts: int,
) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * expert(topk_ids[t, j], hidden[t])``, [T, H]."""
    tokens, top_k = topk_ids.shape
    if tokens == 0 or top_k == 0:
        return torch.zeros_like(hidden)
    flat = topk_ids.reshape(-1).to(torch.int64)  # [P]
    order = torch.argsort(flat, stable=True)  # pairs sorted by expert
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    if len(counts) > num_experts:
        raise ValueError(f"an expert id is >= num_experts ({num_experts})")
    rows = hidden[order // top_k]  # [P, H] each pair's token, in expert order
    out = torch.empty(rows.shape[0], hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
    start = 0
    for e, count in enumerate(counts):
        if count:
            out[start:start + count] = expert(e, rows[start:start + count])
            start += count
    weighted = out * topk_weights.reshape(-1)[order, None]  # [P, H], promotes like eager
    unsorted = torch.empty_like(weighted)
    unsorted[order] = weighted
    return unsorted.view(tokens, top_k, -1).sum(1).to(hidden.dtype)
