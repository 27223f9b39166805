"""Weight-only INT8 linear layer on the CPU: the C++ kernel in ``csrc/int8_linear_cpu.cpp``.

``y = x (q * scale[:, None])^T + bias`` with float32 activations, int8 weights [N, K] and
one float32 scale per output row: each weight is widened to float32 in registers and the
scale multiplies the finished sum, so the result is the dequantized fp32 product up to
float32 rounding. Made for decode steps (a few rows): there torch's packed int8 kernel
needs bf16 activations (its fp32 path is ~15x slower), and the two casts around it cost as
much as the product at the default model's sizes (``ops/bench/techniques/quant.py``).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from kernels.native_build import NativeBuildError, load

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def kernel() -> Callable[..., int]:
    """The C function itself: ``(x, ldx, m, w, n, k, scale, bias, y)``, addresses and sizes
    (a caller that checked its layouts once calls it directly)."""
    fn = load("int8_linear_cpu.cpp").ferry_int8_linear
    fn.restype = ctypes.c_int
    fn.argtypes = [_P, _I64, _I64, _P, _I64, _I64, _P, _P, _P]
    return fn  # type: ignore[no-any-return]


def unavailable_reason() -> str | None:
    """None when the kernel builds and loads here (a C++ compiler is needed), else why."""
    try:
        kernel()
    except NativeBuildError as exc:
        return str(exc)
    return None


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 (rows contiguous), qweight [N, K] int8 contiguous, scale [N] and
    bias [N] float32 contiguous -> [M, N] float32. The caller guarantees the layouts (the
    layer holds its buffers so); the shapes are checked here."""
    m, k = x.shape
    n = qweight.shape[0]
    if (x.dtype != torch.float32 or x.stride(1) != 1 or qweight.shape[1] != k
            or qweight.dtype != torch.int8 or scale.shape != (n,)
            or (bias is not None and bias.shape != (n,))):
        raise ValueError(f"int8_linear: x {tuple(x.shape)} {x.dtype}, weight "
                         f"{tuple(qweight.shape)} {qweight.dtype}, scale {tuple(scale.shape)}")
    out = torch.empty(m, n, dtype=torch.float32)
    rc = kernel()(x.data_ptr(), x.stride(0), m, qweight.data_ptr(), n, k, scale.data_ptr(),
                   None if bias is None else bias.data_ptr(), out.data_ptr())
    if rc != 0:
        raise ValueError(f"int8_linear: bad shapes (rc {rc})")
    return out
