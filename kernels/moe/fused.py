"""Fused mixture-of-experts: every expert of a layer in two grouped GEMM launches.

A token routed to ``top_k`` experts becomes ``top_k`` (token, expert) pairs; pair ``p`` is
``token p // top_k``'s ``p % top_k``-th choice. ``moe_align`` sorts the pairs by expert
and pads each expert's run to a multiple of ``BLOCK_M`` (padding lanes hold the sentinel
``T * top_k``), so every row block of the sorted list belongs to one expert; it records
that expert per block (``-1`` past the last real block). Its sizes are upper bounds that
depend only on ``T``, ``top_k`` and ``E``, never on the routing: no device-to-host sync,
and a CUDA graph captured once serves any routing.

    gate_up:  h[p]   = silu(x[p // k] @ w13[e, :I]^T) * (x[p // k] @ w13[e, I:]^T)   [P, I]
    down:     y[p]   = router_weight[p] * (h[p] @ w2[e]^T)                          [P, H]
    sum:      out[t] = sum_j y[t * k + j]                                            [T, H]

The first launch keeps two accumulators per tile (the gate and the up columns of the same
output features), so SiLU-and-multiply happens in its epilogue and the ``[P, 2I]``
intermediate never exists. Each program owns a ``BLOCK_M`` x ``BLOCK_N`` tile of one
expert's rows; padding lanes are masked on load and store, so experts no token chose
cost nothing but their programs' early return. The top-k sum is a ``view().sum()``:
deterministic (no atomics), fp32-accumulated.

Experts are bf16/fp16/fp32, or FP8 (``float8_e4m3fn``) or INT8 weights with an fp32 scale
per expert and output feature: each tile is widened to the activation dtype (exact for
e4m3 and int8 into bf16) and the accumulator multiplied by the column's scale after the K
loop, which is the dequantized product exactly (the scale is constant along K).
Layouts are transformers': ``w13`` [E, 2I, H] (gate rows, then up rows), ``w2`` [E, H, I].
``kernels.reference.moe_experts`` is the naive per-expert loop it is tested against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _checks as chk
from kernels._attention_core import _dot, dot_needs_upcast

BLOCK_M = 16  # pairs per program: decode steps route few tokens to each expert
BLOCK_N = 64
BLOCK_K = 32
FP8 = torch.float8_e4m3fn
SCALED = (FP8, torch.int8)  # weight dtypes that come with a per-feature scale


def moe_align(
    topk_ids: torch.Tensor,  # [T, K] int expert ids
    num_experts: int,
    block_m: int = BLOCK_M,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [P_max] int32, block_expert [P_max // block_m] int32).

    ``sorted_pairs`` lists pair indices grouped by expert, each expert's run padded to a
    multiple of ``block_m`` with the sentinel ``T * K``; ``block_expert[b]`` is the expert
    of rows ``b * block_m ...`` (``-1``: no rows). Device ops only.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)  # [P]
    num_pairs, device = flat.numel(), flat.device
    max_padded = num_pairs + num_experts * (block_m - 1)
    max_padded = (max_padded + block_m - 1) // block_m * block_m
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)  # [E] end of each expert's padded run
    starts = ends - padded
    order = torch.argsort(flat, stable=True)  # pairs sorted by expert
    sorted_experts = flat[order]
    first = torch.cumsum(counts, 0) - counts  # each expert's first index in ``order``
    rank = torch.arange(num_pairs, device=device) - first[sorted_experts]
    sorted_pairs = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[starts[sorted_experts] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, max_padded, block_m, device=device)  # [B]
    block_expert = torch.searchsorted(ends, block_starts, right=True)  # first end > start
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_pairs, block_expert.to(torch.int32)


@triton.jit
def _widen(w, a, UPCAST: tl.constexpr):
    """A weight tile in the dot's dtype: fp32 when the dot upcasts (straight from int8/fp8:
    the interpreter has no int8 -> bf16 conversion), else the activations' dtype."""
    if UPCAST:
        return w.to(tl.float32)
    return w.to(a.dtype)


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # [rows, K] activations (rows = tokens for gate_up, pairs for down)
    w_ptr,  # [E, N_w, K] expert weights (N_w = 2N when GATED)
    scale_ptr,  # [E, N_w] fp32 per-feature scale (FP8/INT8 weights only)
    out_ptr,  # [P, N]
    pairs_ptr,  # [P_max] int32 sorted pair ids, sentinel = num_pairs
    block_expert_ptr,  # [P_max // BLOCK_M] int32
    route_w_ptr,  # [P] router weight of each pair (MUL_ROUTE only)
    num_pairs, n_out, k_in, top_k,
    stride_am, stride_we, stride_wn, stride_se, stride_om,
    GATED: tl.constexpr,  # two accumulators (gate rows n, up rows N + n), SiLU * up
    MUL_ROUTE: tl.constexpr,
    W_SCALED: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM]
    valid = pairs < num_pairs
    rows = tl.where(valid, pairs // top_k, 0)  # GATED reads tokens; down passes top_k=1
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n_out
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_in
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_am + offs_k[None, :],
                    mask=valid[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
        w_off = offs_n[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]: W^T tile
        w_mask = n_ok[None, :] & k_ok[:, None]
        w = tl.load(w_base + w_off, mask=w_mask, other=0.0)
        acc += _dot(a, _widen(w, a, UPCAST), UPCAST)
        if GATED:
            w_up = tl.load(w_base + n_out * stride_wn + w_off, mask=w_mask, other=0.0)
            acc_up += _dot(a, _widen(w_up, a, UPCAST), UPCAST)
    if W_SCALED:
        s_base = scale_ptr + expert.to(tl.int64) * stride_se
        acc *= tl.load(s_base + offs_n, mask=n_ok, other=0.0)[None, :]
        if GATED:
            acc_up *= tl.load(s_base + n_out + offs_n, mask=n_ok, other=0.0)[None, :]
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_ROUTE:
        acc *= tl.load(route_w_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def _launch(a, w, scale, out, pairs, block_expert, route_w, *, gated: bool, top_k: int):
    n_out, k_in = out.shape[1], a.shape[1]
    grid = (block_expert.shape[0], triton.cdiv(n_out, BLOCK_N))
    _moe_gemm_kernel[grid](
        a, w, scale if scale is not None else w, out, pairs, block_expert,
        route_w if route_w is not None else out,
        out.shape[0], n_out, k_in, top_k,
        a.stride(0), w.stride(0), w.stride(1), scale.stride(0) if scale is not None else 0,
        out.stride(0),
        GATED=gated, MUL_ROUTE=route_w is not None, W_SCALED=scale is not None,
        UPCAST=dot_needs_upcast(a.dtype),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
    )


def _check(x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale) -> None:
    chk.check_tensor("hidden", x, ndim=2, dtypes=chk.FLOAT_DTYPES)
    w_dtypes = (*chk.FLOAT_DTYPES, *SCALED)
    chk.check_tensor("w13", w13, ndim=3, dtypes=w_dtypes)
    chk.check_tensor("w2", w2, ndim=3, dtypes=w_dtypes)
    chk.check_tensor("topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64))
    chk.check_tensor("topk_weights", topk_weights, ndim=2, dtypes=chk.FLOAT_DTYPES)
    tokens, hidden = x.shape
    experts, two_i, _ = w13.shape
    if w13.shape[2] != hidden or two_i % 2 or w2.shape != (experts, hidden, two_i // 2):
        raise ValueError(f"expert shapes must be w13 [E, 2I, {hidden}] and w2 [E, {hidden}, I], "
                         f"got {tuple(w13.shape)} and {tuple(w2.shape)}")
    if topk_ids.shape[0] != tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_weights must both be [{tokens}, K], got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if w13.stride(1) != hidden or w2.stride(1) != two_i // 2:
        raise ValueError("w13 and w2 must be contiguous within each expert")
    for name, w, scale in (("w13", w13, w13_scale), ("w2", w2, w2_scale)):
        if (w.dtype in SCALED) != (scale is not None):
            raise ValueError(f"{name}_scale must be given exactly when {name} is fp8 or int8")
        if scale is not None and (scale.dtype != torch.float32 or scale.shape != w.shape[:2]
                                  or scale.stride(1) != 1):
            raise ValueError(f"{name}_scale must be contiguous fp32 {tuple(w.shape[:2])}, "
                             f"got {scale.dtype} {tuple(scale.shape)}")
    chk.check_same_device(hidden=x, w13=w13, w2=w2, topk_ids=topk_ids, topk_weights=topk_weights)


def fused_moe(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H] gate rows then up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_ids: torch.Tensor,  # [T, K]
    topk_weights: torch.Tensor,  # [T, K] router weight of each choice
    w13_scale: torch.Tensor | None = None,  # [E, 2I] fp32, FP8/INT8 w13 only
    w2_scale: torch.Tensor | None = None,  # [E, H] fp32, FP8/INT8 w2 only
) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t])``: [T, H], hidden's dtype."""
    _check(hidden, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale)
    tokens, hidden_size = hidden.shape
    top_k, inter = topk_ids.shape[1], w2.shape[2]
    if tokens == 0 or top_k == 0:
        return torch.zeros_like(hidden)
    pairs, block_expert = moe_align(topk_ids, w13.shape[0])
    num_pairs = tokens * top_k
    act = hidden.new_empty(num_pairs, inter)  # [P, I]
    _launch(hidden, w13, w13_scale, act, pairs, block_expert, None, gated=True, top_k=top_k)
    out = torch.empty(num_pairs, hidden_size, dtype=torch.float32, device=hidden.device)
    route_w = topk_weights.reshape(-1).contiguous()  # [P]
    _launch(act, w2, w2_scale, out, pairs, block_expert, route_w, gated=False, top_k=1)
    return out.view(tokens, top_k, hidden_size).sum(1).to(hidden.dtype)
