"""Quantized MoE experts: every expert of one layer stored quantized, computed from it.

Transformers holds an MoE layer's experts as one module of two 3-D parameters,
``gate_up_proj`` [E, 2I, H] (gate rows, then up rows) and ``down_proj`` [E, H, I]. Here
they become a ``QuantizedExperts`` child of that module (the float parameters are
deleted), which ``runner/moe.py`` finds and runs:

- ``fp8`` and ``int8``: one ``[E, N, K]`` tensor of float8_e4m3fn / int8 weights and one
  fp32 scale per expert and output feature ``[E, N]``. On CUDA the fused Triton kernel
  takes them as they are (each tile widened to the activation dtype, the scale on the
  finished sum); on the CPU each expert the router chose is one matmul on its slice
  widened to the activation dtype (exact: every e4m3 and int8 value is a bf16 value),
  scaled after the product, or, for int8 with fp32 rows at decode sizes, Ferry's C++
  int8 kernel on the slice itself. Experts nobody chose are never touched.
- ``int4``: one ``Int4Linear`` per expert and projection (groups of input columns, scale
  and zero point), so each expert runs on the packed int4 kernels the dense layers use.

Activations stay in the model's dtype for every method, FP8 included (weight-only
experts, as the fused kernel computes them): a checkpoint's static input scales for the
experts are not applied. Only the SiLU-gated layout (``runner/moe.fused_layout``) is
quantized; the loader leaves other layouts (gpt-oss's biased, transposed experts) in the
model's dtype, and refuses a checkpoint that holds them quantized.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from worker.engine.runner.quant.int4 import Int4Linear, quantize_groups
from worker.engine.runner.quant.int8 import KERNEL_ROWS, native_kernel, quantize_rows


class ScaledExperts(nn.Module):
    """One projection of every expert: ``qweight`` [E, N, K] fp8/int8, ``scale`` [E, N]
    fp32; expert ``e``'s weight is ``qweight[e] * scale[e][:, None]``."""

    qweight: torch.Tensor
    scale: torch.Tensor

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scale", scale.float().contiguous())

    def project(self, e: int, rows: torch.Tensor) -> torch.Tensor:  # [n, K] -> [n, N]
        w = self.qweight[e]  # [N, K]
        if (rows.device.type == "cpu" and w.dtype == torch.int8 and rows.dtype == torch.float32
                and rows.shape[0] <= KERNEL_ROWS and native_kernel()):
            from kernels.quant.cpu_int8_linear import int8_linear

            return int8_linear(rows.contiguous(), w, self.scale[e])
        return F.linear(rows, w.to(rows.dtype)) * self.scale[e].to(rows.dtype)

    def dequantized(self) -> torch.Tensor:  # [E, N, K] fp32
        return self.qweight.float() * self.scale[..., None]


class Int4Experts(nn.Module):
    """One projection of every expert as int4 groups: one ``Int4Linear`` per expert."""

    def __init__(self, layers: list[Int4Linear]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def project(self, e: int, rows: torch.Tensor) -> torch.Tensor:  # [n, K] -> [n, N]
        layer: Int4Linear = self.layers[e]  # type: ignore[assignment]
        return layer(rows)  # type: ignore[no-any-return]

    def dequantized(self) -> torch.Tensor:  # [E, N, K] fp32
        return torch.stack([layer.dequantized() for layer in self.layers])  # type: ignore[operator]


Projection = ScaledExperts | Int4Experts


class QuantizedExperts(nn.Module):
    """The SiLU-gated experts of one MoE layer: ``w13`` [E, 2I, H], ``w2`` [E, H, I]."""

    def __init__(self, method: str, w13: Projection, w2: Projection, num_experts: int,
                 intermediate: int) -> None:
        super().__init__()
        self.method = method
        self.w13, self.w2 = w13, w2
        self.num_experts, self.intermediate = num_experts, intermediate

    def expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, H]
        gate_up = self.w13.project(e, rows)  # [n, 2I]
        act = F.silu(gate_up[:, :self.intermediate]) * gate_up[:, self.intermediate:]
        return self.w2.project(e, act.to(rows.dtype))

    def fused_weights(self) -> tuple[torch.Tensor, ...] | None:
        """(w13, w2, w13_scale, w2_scale) as the fused Triton kernel takes them, or None
        (int4: the grouped path)."""
        if isinstance(self.w13, ScaledExperts) and isinstance(self.w2, ScaledExperts):
            return self.w13.qweight, self.w2.qweight, self.w13.scale, self.w2.scale
        return None

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, H], w2 [E, H, I]) fp32: the reference weights."""
        return self.w13.dequantized(), self.w2.dequantized()

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, intermediate={self.intermediate}, {self.method}"


def quantize_projection(method: str, weight: torch.Tensor, group: int) -> Projection:
    """weight [E, N, K] float -> its quantized projection (``group``: int4's group size)."""
    experts, n, k = weight.shape
    flat = weight.detach().reshape(experts * n, k)  # one scale per (expert, feature)
    if method == "int4":
        q, scale, zero = quantize_groups(flat, group)
        return Int4Experts([
            Int4Linear(q[e * n:(e + 1) * n], scale[e * n:(e + 1) * n],
                       zero[e * n:(e + 1) * n], group, None) for e in range(experts)])
    if method == "int8":
        q8, scale8 = quantize_rows(flat)
        return ScaledExperts(q8.view(experts, n, k), scale8.view(experts, n))
    from worker.engine.runner.quant.fp8 import quantize_fp8_rows

    qf, scalef = quantize_fp8_rows(flat)
    return ScaledExperts(qf.view(experts, n, k), scalef.view(experts, n))


def attach(module: Any, quantized: QuantizedExperts) -> None:
    """Replace ``module``'s float expert parameters by ``quantized`` (``runner/moe.py``
    runs a module that has one through it)."""
    for name in ("gate_up_proj", "down_proj"):
        if name in module._parameters:
            del module._parameters[name]
    module.ferry_quantized = quantized


def experts_bytes(model: nn.Module) -> int:
    """Bytes of every MoE layer's expert weights (quantized or float)."""
    total = 0
    for module in model.modules():
        if isinstance(module, QuantizedExperts):
            total += sum(b.numel() * b.element_size() for b in module.buffers())
        elif hasattr(module, "gate_up_proj") and hasattr(module, "has_gate"):
            total += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
    return total
