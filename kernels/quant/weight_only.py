"""Weight-only quantized matmuls for CUDA in Triton: W8A16 and W4A16.

    int8:  y[m, n] = scale[n] * sum_k x[m, k] * q[n, k]                      (+ bias[n])
    int4:  y[m, n] = sum_g scale[n, g] * sum_{k in g} x[m, k] * (q[n, k] - zero[n, g])

Each program owns a ``BLOCK_M`` x ``BLOCK_N`` output tile and walks K in ``BLOCK_K``
steps: the weight tile is loaded in its stored width (one byte a weight for int8, half a
byte for int4), widened in registers to the activations' dtype (exact: int8 and 0..15 fit
bf16/fp16) and multiplied on the tensor cores with fp32 accumulation, so the weight
crosses memory at its quantized size: what makes weight-only quantization pay at decode
sizes. int8's per-channel scale multiplies the finished accumulator (it is constant along
K); int4's scale and zero point change per group of ``group`` columns, so a K step never
straddles a group (``BLOCK_K`` divides the group) and its partial product is scaled
before it is added: ``(x . q) * s - (sum x) * z * s`` per group.

Layouts (``worker/engine/runner/quant``'s CUDA layouts): x [M, K]; int8 q [N, K] int8,
scale [N] fp32; int4 packed [N, K/2] uint8 (column 2j in the low nibble, 2j + 1 in the
high one), scales_zeros [N, K/group, 2] fp32 (scale, zero). Tested under the interpreter
against the dequantize-then-matmul reference (``tests/kernels/test_weight_only.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._attention_core import dot_needs_upcast

BLOCK_M = 16
BLOCK_N = 64
BLOCK_K = 32


@triton.jit
def _wdot(x, q, UPCAST: tl.constexpr):
    """x [BM, BK] @ q [BK, BN] (integers), q widened to x's dtype; fp32 accumulation.
    Under the interpreter bf16 is raw uint16, so both go to fp32 (exact either way)."""
    if UPCAST:
        return tl.dot(x.to(tl.float32), q.to(tl.float32), input_precision="ieee")
    return tl.dot(x, q.to(x.dtype), input_precision="ieee")


@triton.jit
def _w8_kernel(x_ptr, q_ptr, scale_ptr, bias_ptr, y_ptr, M, N, K,
               stride_xm, stride_ym, HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rk = tl.arange(0, BLOCK_K)  # [BK]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)  # [BM, BK]
        q = tl.load(q_ptr + rn[None, :] * K + kk[:, None],
                    mask=(rn[None, :] < N) & (kk[:, None] < K), other=0)  # [BK, BN] int8
        acc += _wdot(x, q, UPCAST)
    acc *= tl.load(scale_ptr + rn, mask=rn < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0)[None, :].to(tl.float32)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _w4_kernel(x_ptr, p_ptr, sz_ptr, bias_ptr, y_ptr, M, N, K, GROUPS,
               stride_xm, stride_ym, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
               UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    rk = tl.arange(0, BLOCK_K)  # [BK]
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # BLOCK_K divides GROUP: one group per step
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :],
                    mask=m_ok[:, None] & (kk[None, :] < K), other=0.0)  # [BM, BK]
        byte = tl.load(p_ptr + rn[None, :] * (K // 2) + kk[:, None] // 2,
                       mask=n_ok[None, :] & (kk[:, None] < K), other=0)  # [BK, BN] uint8
        q = (byte >> ((kk[:, None] % 2) * 4).to(tl.uint8)) & 0xF
        part = _wdot(x, q, UPCAST)  # [BM, BN] fp32: x . q over the step
        g = k0 // GROUP
        sz = sz_ptr + (rn * GROUPS + g) * 2
        scale = tl.load(sz, mask=n_ok, other=0.0)  # [BN]
        zero = tl.load(sz + 1, mask=n_ok, other=0.0)
        xsum = tl.sum(x.to(tl.float32), axis=1)  # [BM]
        acc += part * scale[None, :] - xsum[:, None] * (zero * scale)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0)[None, :].to(tl.float32)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _check(x: torch.Tensor, n: int, k: int) -> None:
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"weight-only matmul: x {tuple(x.shape)} for a [{n}, {k}] weight "
                         "(rows must be contiguous)")


def w8a16_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp16/bf16/fp32, q [N, K] int8, scale [N] fp32 -> [M, N] in x's dtype."""
    n, k = q.shape
    _check(x, n, k)
    m = x.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _w8_kernel[grid](x, q.contiguous(), scale.float().contiguous(), bias if bias is not None
                     else y, y, m, n, k, x.stride(0), y.stride(0), HAS_BIAS=bias is not None,
                     UPCAST=dot_needs_upcast(x.dtype), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                     BLOCK_K=BLOCK_K)
    return y


def w4a16_matmul(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor,
                 group: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K], packed [N, K/2] uint8, scales_zeros [N, K/group, 2] fp32 -> [M, N]."""
    n, k = packed.shape[0], packed.shape[1] * 2
    _check(x, n, k)
    if group % BLOCK_K or k % group:
        raise ValueError(f"w4a16: group {group} must be a multiple of {BLOCK_K} dividing "
                         f"K={k}")
    m = x.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _w4_kernel[grid](x, packed.contiguous(), scales_zeros.float().contiguous(),
                     bias if bias is not None else y, y, m, n, k, k // group, x.stride(0),
                     y.stride(0), GROUP=group, HAS_BIAS=bias is not None,
                     UPCAST=dot_needs_upcast(x.dtype), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                     BLOCK_K=BLOCK_K)
    return y
