"""Quantized weights under tensor parallelism: each rank quantizes its own shards at load,
to the very numbers one process computes for the same rows and columns.

- Column-parallel layers (q/k/v by heads, gate/up) and the vocabulary-split LM head and
  embedding keep whole rows: per-row scales (FP8, INT8) and INT4's groups along the input
  are computed from the shard's rows exactly as from the full weight's.
- Row-parallel layers (o, down) cut each row: a per-row scale is the row's absolute
  maximum over every rank (one max all-reduce at load), and an INT4 group must fall inside
  one rank's columns: the group size is chosen from the full input width as one process
  chooses it, and a group that does not divide the shard is refused by name. FP8's
  per-token activation scale over the cut input is likewise the maximum over the ranks
  (one small all-reduce per layer call); the partial products are then summed as usual.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from worker.engine.distributed.group import all_reduce_max, all_reduce_sum
from worker.engine.runner.quant.config import QuantizationError, QuantScheme
from worker.engine.runner.quant.fp8 import FP8_MAX, Fp8Linear, check_shape
from worker.engine.runner.quant.int4 import Int4Linear, quantize_groups
from worker.engine.runner.quant.int8 import INT8_MAX, KERNEL_ROWS, Int8Linear, native_kernel


def row_scale(weight: torch.Tensor, top: float, cut: bool) -> torch.Tensor:
    """weight [N, K/size or K] -> fp32 scale [N]: the row's |max| (over every rank's
    columns when ``cut``) over ``top``, the formula one process uses."""
    amax = weight.detach().float().abs().amax(dim=1)  # [N]
    if cut:
        amax = all_reduce_max(amax)
    return (amax / top).clamp(min=1e-12)


def quantize_rows_cut(method: str, weight: torch.Tensor, cut: bool,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K'] -> (int8 or fp8 [N, K'], fp32 scale [N]) with one process's per-row
    scales (``row_scale``)."""
    top = INT8_MAX if method == "int8" else FP8_MAX
    scale = row_scale(weight, top, cut)
    q = (weight.detach().float() / scale[:, None]).clamp(-top, top)
    return (torch.round(q).to(torch.int8) if method == "int8"
            else q.to(torch.float8_e4m3fn)), scale


class CutFp8Linear(Fp8Linear):
    """FP8 on a row-parallel shard: the per-token activation scale is the maximum over
    the ranks' input columns, so every rank quantizes its columns as one process does."""

    def _quantize_input(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = flat.float()  # [M, K/size]
        amax = all_reduce_max(x.abs().amax(dim=1, keepdim=True).contiguous())  # [M, 1]
        scale = (amax / FP8_MAX).clamp(min=1e-12)
        return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def _int4_group(scheme: QuantScheme, name: str, full_k: int, shard_k: int) -> int:
    group = next((g for g in (scheme.group_size, 64, 32) if full_k % g == 0), 0)
    if not group:
        raise QuantizationError(f"int4: layer {name} has {full_k} input features, not a "
                                "multiple of a group size the kernel takes (32)")
    if shard_k % group:
        raise QuantizationError(
            f"int4 under tensor parallelism: layer {name}'s group size {group} does not "
            f"divide its row-parallel shard of {shard_k} input features (of {full_k})")
    return group


def quantized_shard(scheme: QuantScheme, name: str, weight: torch.Tensor,
                    bias: torch.Tensor | None, size: int, cut: bool) -> nn.Module:
    """The quantized layer of a shard ``weight`` [N, K'] (``cut``: its input features are
    a 1/``size`` share of a row-parallel weight's, else whole rows)."""
    n, k = weight.shape
    full_k = k * size if cut else k
    if scheme.method == "int8":
        return Int8Linear(*quantize_rows_cut("int8", weight, cut), bias)
    if scheme.method == "fp8":
        check_shape(name, n, k)
        cls = CutFp8Linear if cut else Fp8Linear
        return cls(*quantize_rows_cut("fp8", weight, cut), None, bias)
    group = _int4_group(scheme, name, full_k, k)
    return Int4Linear(*quantize_groups(weight, group), group, bias)


def _rounds_to_bf16(inner: nn.Module, flat: torch.Tensor) -> bool:
    """Whether one process's CPU kernel for this layer returns ``flat``'s product rounded
    to bf16 (the packed INT4 kernel; INT8's bf16 GEMM above ``KERNEL_ROWS`` rows, or its
    packed kernel where the C++ one is not used); FP8 and CUDA return the input's dtype."""
    if flat.device.type != "cpu":
        return False
    rows = flat.shape[0]
    if isinstance(inner, Int4Linear):
        return rows <= KERNEL_ROWS
    if isinstance(inner, Int8Linear):
        return rows > KERNEL_ROWS or flat.dtype != torch.float32 or not native_kernel()
    return False


class ReducedQuant(nn.Module):
    """A row-parallel quantized shard: partial outputs summed over the ranks, bias once.

    Where one process's kernel rounds the whole product to bf16, each rank's partial is
    computed in fp32 from the same bf16 activations and dequantized weights (the kernel's
    own arithmetic), and the sum is rounded to bf16 once: rounding each partial instead
    would put one bf16 rounding per rank into every output. INT8 scales where its kernel
    does: after the rounding above ``KERNEL_ROWS`` rows (the bf16 GEMM), before it at or
    below (the torch fallback's ``_weight_int8pack_mm``, with its bf16 scale).
    """

    def __init__(self, inner: nn.Module, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.inner = inner
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K / size] -> [..., N]
        inner: Any = self.inner
        flat = x.reshape(-1, inner.in_features)
        if _rounds_to_bf16(inner, flat):
            xb = flat.to(torch.bfloat16).float()  # [M, K / size]
            if isinstance(inner, Int8Linear):
                part = all_reduce_sum(F.linear(xb, inner.qweight.float()))  # [M, N]
                if flat.shape[0] > KERNEL_ROWS:  # the GEMM: rounded, then scaled
                    y = part.to(torch.bfloat16).to(x.dtype) * inner.scale.to(x.dtype)
                else:  # _weight_int8pack_mm: scaled by the bf16 scale, then rounded
                    y = (part * inner.scale_bf16.float()).to(torch.bfloat16).to(x.dtype)
            else:
                part = all_reduce_sum(F.linear(xb, inner.dequantized()))
                y = part.to(torch.bfloat16).to(x.dtype)
        else:
            y = all_reduce_sum(inner(flat))  # [M, N]
        y = y.view(*x.shape[:-1], inner.out_features)
        return y if self.bias is None else y + self.bias
