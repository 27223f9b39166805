"""Segmented LoRA shrink and expand for a batch whose tokens use different adapters.

The Punica / S-LoRA idea: one launch serves every adapter of the step. Each token carries
an adapter slot (``-1``: none); ``lora_segments`` sorts the token indices by slot once per
step, on the device, and each program takes up to ``BLOCK_M`` tokens of one slot, so its
tile multiplies by that slot's matrices alone (a real ``tl.dot``, not a per-token
matrix-vector product). The grid is ``(token blocks, column blocks, slots)``: it depends
only on the token count and the pool's size, never on which adapters are in the step, so
a CUDA graph captured once serves any mix; programs past their slot's tokens return.
A program loads and stores only its own slot's tokens (padding lanes masked on both), so
no token ever meets another slot's matrices: one adapter's NaN or Inf stays in its own
rows, and the shrink's rows of tokens with no adapter are neither written nor read.

    shrink: t[tok]  = x[tok] @ A[s]^T                   [T, in] -> [T, R] fp32
    expand: y[tok] += scale[s] * (t[tok] @ B[s]^T)      [T, R] -> [T, out], in place

``A`` [S, R, in] and ``B`` [S, out, R] are the slot pool's stacked buffers, ranks below R
zero-padded. The expand keeps ``t`` in fp32 and widens B's tile to fp32: its product is
only ``[BLOCK_M, R] x [R, BLOCK_N]`` (bandwidth-bound on B, not on the multiply), and
rounding ``t`` to bf16 first would add an error the merged weights do not have (the
interpreter's float-to-bf16 conversion also rounds differently from torch's).
``kernels/lora_reference.py`` holds the pure-torch twin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _checks as chk
from kernels._attention_core import _dot, dot_needs_upcast, pow2_at_least

BLOCK_M = 16  # tokens per program: decode steps hold few tokens per adapter
BLOCK_K = 64  # shrink: input features per loop iteration
BLOCK_N = 64  # expand: output features per program


def lora_segments(
    token_slots: torch.Tensor,  # [T] int, -1 = no adapter
    num_slots: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_tokens [T] int32, starts [S + 1] int32): the tokens of slot ``s`` are
    ``sorted_tokens[starts[s]:starts[s + 1]]``. Device ops only, no host sync."""
    slots = token_slots.to(torch.int64)
    sorted_slots, order = torch.sort(slots, stable=True)
    bounds = torch.arange(num_slots + 1, device=slots.device, dtype=torch.int64)
    starts = torch.searchsorted(sorted_slots, bounds)  # first token of slot >= s
    return order.to(torch.int32), starts.to(torch.int32)


@triton.jit
def _shrink_kernel(
    x_ptr,  # [T, K]
    a_ptr,  # [S, R, K]
    tokens_ptr,  # [T] int32, sorted by slot
    starts_ptr,  # [S + 1] int32
    out_ptr,  # [T, R] fp32
    in_features,
    rank,
    stride_xt,
    stride_as,
    stride_ar,
    stride_ot,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    slot = tl.program_id(2)
    lo = tl.load(starts_ptr + slot)
    hi = tl.load(starts_ptr + slot + 1)
    first = lo + tl.program_id(0) * BLOCK_M
    if first >= hi:
        return
    rows = first + tl.arange(0, BLOCK_M)  # [M]
    row_ok = rows < hi
    tok = tl.load(tokens_ptr + rows, mask=row_ok, other=0).to(tl.int64)  # [M]
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # [R]
    r_ok = offs_r < rank
    a_base = a_ptr + slot.to(tl.int64) * stride_as + offs_r[None, :] * stride_ar
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [K]
        k_ok = offs_k < in_features
        xt = tl.load(x_ptr + tok[:, None] * stride_xt + offs_k[None, :],
                     mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [M, K]
        at = tl.load(a_base + offs_k[:, None], mask=k_ok[:, None] & r_ok[None, :],
                     other=0.0)  # [K, R]
        acc += _dot(xt, at, UPCAST)
    tl.store(out_ptr + tok[:, None] * stride_ot + offs_r[None, :], acc,
             mask=row_ok[:, None] & r_ok[None, :])


@triton.jit
def _expand_kernel(
    t_ptr,  # [T, R] fp32
    b_ptr,  # [S, N, R]
    scale_ptr,  # [S] fp32
    tokens_ptr,  # [T] int32, sorted by slot
    starts_ptr,  # [S + 1] int32
    y_ptr,  # [T, N], updated in place
    out_features,
    rank,
    stride_tt,
    stride_bs,
    stride_bn,
    stride_yt,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    slot = tl.program_id(2)
    lo = tl.load(starts_ptr + slot)
    hi = tl.load(starts_ptr + slot + 1)
    first = lo + tl.program_id(0) * BLOCK_M
    if first >= hi:
        return
    rows = first + tl.arange(0, BLOCK_M)  # [M]
    row_ok = rows < hi
    tok = tl.load(tokens_ptr + rows, mask=row_ok, other=0).to(tl.int64)  # [M]
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [N]
    n_ok = offs_n < out_features
    offs_r = tl.arange(0, BLOCK_R)  # [R]: the whole rank in one tile
    r_ok = offs_r < rank
    bt = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_n[None, :] * stride_bn
                 + offs_r[:, None], mask=r_ok[:, None] & n_ok[None, :], other=0.0)  # [R, N]
    t = tl.load(t_ptr + tok[:, None] * stride_tt + offs_r[None, :],
                mask=row_ok[:, None] & r_ok[None, :], other=0.0)  # [M, R]
    delta = _dot(t, bt.to(tl.float32), False)  # [M, N]: t stays fp32 (module docstring)
    scale = tl.load(scale_ptr + slot)
    y_off = tok[:, None] * stride_yt + offs_n[None, :]
    mask = row_ok[:, None] & n_ok[None, :]
    y = tl.load(y_ptr + y_off, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + y_off, (y + scale * delta).to(y_ptr.dtype.element_ty), mask=mask)


def _check_segments(tokens: torch.Tensor, starts: torch.Tensor, num_tokens: int,
                    num_slots: int) -> None:
    chk.check_tensor("sorted_tokens", tokens, ndim=1, dtypes=(torch.int32,))
    chk.check_tensor("starts", starts, ndim=1, dtypes=(torch.int32,))
    if tokens.shape[0] != num_tokens:
        raise ValueError(f"sorted_tokens has {tokens.shape[0]} entries, expected {num_tokens}")
    if starts.shape[0] != num_slots + 1:
        raise ValueError(f"starts has {starts.shape[0]} entries, expected {num_slots + 1}")


def lora_shrink(
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [S, R, in]
    sorted_tokens: torch.Tensor,  # [T] int32, from lora_segments
    starts: torch.Tensor,  # [S + 1] int32
    out: torch.Tensor,  # [T, R] fp32; rows of tokens with no adapter are left as they are
) -> None:
    """Triton version of ``kernels.lora_reference.lora_shrink``, into ``out``."""
    x = chk.check_tensor("x", x, ndim=2, dtypes=chk.FLOAT_DTYPES)
    a = chk.check_tensor("a", a, ndim=3, dtypes=(x.dtype,))
    chk.check_tensor("out", out, ndim=2, dtypes=(torch.float32,))
    num_tokens, in_features = x.shape
    num_slots, rank, _ = a.shape
    if a.shape[2] != in_features or tuple(out.shape) != (num_tokens, rank):
        raise ValueError(f"x {tuple(x.shape)}, a {tuple(a.shape)} and out {tuple(out.shape)} "
                         "must be [T, in], [S, R, in] and [T, R]")
    _check_segments(sorted_tokens, starts, num_tokens, num_slots)
    chk.check_same_device(x=x, a=a, sorted_tokens=sorted_tokens, starts=starts, out=out)
    if num_tokens == 0:
        return
    block_r = pow2_at_least(rank, 16)
    grid = (triton.cdiv(num_tokens, BLOCK_M), 1, num_slots)
    _shrink_kernel[grid](
        x, a, sorted_tokens, starts, out, in_features, rank,
        x.stride(0), a.stride(0), a.stride(1), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_R=block_r, BLOCK_K=BLOCK_K, UPCAST=dot_needs_upcast(x.dtype),
    )  # fmt: skip


def lora_expand(
    t: torch.Tensor,  # [T, R] fp32, from lora_shrink
    b: torch.Tensor,  # [S, out, R]
    scale: torch.Tensor,  # [S] fp32
    sorted_tokens: torch.Tensor,  # [T] int32, from lora_segments
    starts: torch.Tensor,  # [S + 1] int32
    y: torch.Tensor,  # [T, out], updated in place
) -> None:
    """Triton version of ``kernels.lora_reference.lora_expand`` (in place on ``y``)."""
    t = chk.check_tensor("t", t, ndim=2, dtypes=(torch.float32,))
    b = chk.check_tensor("b", b, ndim=3, dtypes=chk.FLOAT_DTYPES)
    y = chk.check_tensor("y", y, ndim=2, dtypes=chk.FLOAT_DTYPES)
    chk.check_tensor("scale", scale, ndim=1, dtypes=(torch.float32,))
    num_tokens, rank = t.shape
    num_slots, out_features, _ = b.shape
    if b.shape[2] != rank or tuple(y.shape) != (num_tokens, out_features) or \
            scale.shape[0] != num_slots:
        raise ValueError(f"t {tuple(t.shape)}, b {tuple(b.shape)}, scale "
                         f"{tuple(scale.shape)} and y {tuple(y.shape)} must be [T, R], "
                         "[S, out, R], [S] and [T, out]")
    _check_segments(sorted_tokens, starts, num_tokens, num_slots)
    chk.check_same_device(t=t, b=b, scale=scale, sorted_tokens=sorted_tokens, starts=starts,
                          y=y)
    if num_tokens == 0:
        return
    grid = (triton.cdiv(num_tokens, BLOCK_M), triton.cdiv(out_features, BLOCK_N), num_slots)
    _expand_kernel[grid](
        t, b, scale, sorted_tokens, starts, y, out_features, rank,
        t.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=pow2_at_least(rank, 16),
    )  # fmt: skip
