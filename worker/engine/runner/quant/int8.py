"""INT8 weight-only linear layers and embeddings (per output channel / per row, symmetric).

CPU, up to ``KERNEL_ROWS`` rows (decode steps): float32 activations go to Ferry's C++
kernel (``kernels/quant/cpu_int8_linear.py``: int8 weights widened in registers, fp32
sums, the scale on the finished sum); bf16 activations, or a machine without a C++ compiler, to
``torch._weight_int8pack_mm`` (bf16 activations: ~15x slower with fp32 ones, so an fp32
model's are cast for it and back). At the default model's sizes the two casts cost as
much as the product: the 704x256 projection at one row 12 us in the kernel against 19-36
us for cast, ``_weight_int8pack_mm``, cast; fp32 ``F.linear`` 19-33 us (2-core dev
machine, loaded). Above ``KERNEL_ROWS`` rows (prefill chunks, large batches): the weight
widened to bf16 (exact) for oneDNN's bf16 GEMM, ~2x the packed fp32 GEMM of the float
model at 64-512 rows there. CUDA: the Triton W8A16 kernel (``kernels/quant/weight_only.py``:
the int8 tile widened in registers, tensor cores, fp32 accumulation). The scale always
multiplies the output (a factor constant along K).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

INT8_MAX = 127.0
# CPU: above this many rows (prefill chunks, large batches) the weight is widened for a
# GEMM: the int8 kernels are matrix-vector kernels at heart, several times slower than a
# GEMM at 128+ rows (ops/bench/techniques/quant.py)
KERNEL_ROWS = 32


@functools.cache
def native_kernel() -> bool:
    """Whether Ferry's C++ int8 kernel builds and loads here (a C++ compiler is needed)."""
    from kernels.quant import cpu_int8_linear

    return cpu_int8_linear.unavailable_reason() is None


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (int8 [N, K], fp32 scale [N]): symmetric, one scale per row."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / INT8_MAX).clamp(min=1e-12)  # [N]
    q = torch.round(w / scale[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """``y = x (q * scale[:, None])^T + b`` with q int8 [out, in] and one scale per row."""

    weight = None  # no float weight: what code looking for a tied weight sees
    qweight: torch.Tensor
    scale: torch.Tensor
    scale_bf16: torch.Tensor

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 ) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("qweight", q.contiguous())  # [N, K] int8
        self.register_buffer("scale", scale.float().contiguous())  # [N]
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16).contiguous())
        self.bias = None if bias is None else bias.detach().clone()
        self.bias32 = None if bias is None else bias.detach().float().contiguous()  # kernel
        self._call: tuple[Any, ...] | None = None  # the C++ kernel and the buffers' addresses

    @classmethod
    def from_linear(cls, linear: nn.Module, q: torch.Tensor | None = None,
                    scale: torch.Tensor | None = None) -> Int8Linear:
        if q is None or scale is None:
            q, scale = quantize_rows(linear.weight)  # type: ignore[arg-type]
        return cls(q, scale, getattr(linear, "bias", None))

    def dequantized(self) -> torch.Tensor:  # [N, K] fp32: the reference weight
        return self.qweight.float() * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        flat = x.reshape(-1, self.in_features)
        if flat.device.type == "cuda":  # the Triton W8A16 kernel, the bias in it
            from kernels.quant.weight_only import w8a16_matmul

            return w8a16_matmul(flat.contiguous(), self.qweight, self.scale, self.bias,
                                ).view(*x.shape[:-1], self.out_features)
        if flat.device.type != "cpu":
            out = F.linear(flat, self.qweight.to(x.dtype)) * self.scale.to(x.dtype)
        elif flat.shape[0] <= KERNEL_ROWS:
            if flat.dtype == torch.float32 and native_kernel():  # the bias in the kernel
                return self._native(flat).view(*x.shape[:-1], self.out_features)
            out = torch._weight_int8pack_mm(flat.to(torch.bfloat16), self.qweight,
                                            self.scale_bf16).to(x.dtype)
        else:  # int8 -> bf16 is exact: the kernel's arithmetic, on oneDNN's bf16 GEMM
            out = F.linear(flat.to(torch.bfloat16), self.qweight.to(torch.bfloat16))
            out = out.to(x.dtype) * self.scale.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def _native(self, flat: torch.Tensor) -> torch.Tensor:  # [M, K] fp32 -> [M, N] fp32
        """The C++ kernel, called with the layer's buffer addresses taken once (at a
        decode step's sizes a checked call's Python costs as much as the product)."""
        if self._call is None:
            from kernels.quant import cpu_int8_linear

            cpu_int8_linear.int8_linear(flat[:1].contiguous(), self.qweight, self.scale,
                                        self.bias32)  # the layouts checked, once
            self._call = (cpu_int8_linear.kernel(), self.qweight.data_ptr(),
                          self.scale.data_ptr(),
                          None if self.bias32 is None else self.bias32.data_ptr())
        fn, weight, scale, bias = self._call
        if flat.stride(1) != 1:
            flat = flat.contiguous()
        m, n, k = flat.shape[0], self.out_features, self.in_features
        out = torch.empty(m, n)
        fn(flat.data_ptr(), flat.stride(0), m, weight, n, k, scale, bias, out.data_ptr())
        return out

    def _apply(self, fn: Any, recurse: bool = True) -> Int8Linear:
        self._call = None  # the buffers may move: take their addresses again
        return super()._apply(fn, recurse)  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


class Int8Embedding(nn.Module):
    """An embedding whose table is an ``Int8Linear``'s int8 rows (the tied LM head's, when
    the checkpoint ties them: one copy serves both)."""

    weight = None

    def __init__(self, table: Int8Linear, dtype: torch.dtype,
                 padding_idx: int | None = None) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype
        self.padding_idx = padding_idx
        self.num_embeddings, self.embedding_dim = int(table.qweight.shape[0]), \
            int(table.qweight.shape[1])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., H]
        rows = F.embedding(ids, self.table.qweight).to(self.dtype)
        return rows * self.table.scale[ids].to(self.dtype).unsqueeze(-1)
