"""INT4 weight-only linear layers: groups of input columns with a scale and a zero point.

Every source (quantized here, AWQ, GPTQ) is unpacked at load to one canonical form, q
[N, K] with values 0..15 and per-group fp32 ``scale``/``zero`` [N, K/g] (weight =
(q - zero) * scale), then repacked for the kernel. CPU: ``torch._weight_int4pack_mm_for_cpu``
with bf16 activations (its fp32 path measured ~45x slower), whose dequantization is
``(q - 8) * s + z'``, so ``z' = (8 - zero) * scale``. CUDA: the Triton W4A16 kernel
(``kernels/quant/weight_only.py``) on nibbles packed along K with fp32 (scale, zero) per
group. The CPU above ``KERNEL_ROWS`` rows (a prefill chunk): the weight unpacked straight
from the kernel's layout for MKL's sgemm, which beats the packed kernel there.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from worker.engine.runner.quant.int8 import KERNEL_ROWS

_BLOCK_N = 64  # the CPU packing's row block: byte k * 32 + j holds rows j (low), 32 + j


def quantize_groups(weight: torch.Tensor, group: int,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (q [N, K] int32 in 0..15, scale [N, K/g], zero [N, K/g]): asymmetric
    min/max per group (AWQ's recipe without its activation-aware search)."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // group, group)
    lo = w.amin(-1).clamp(max=0.0)
    hi = w.amax(-1).clamp(min=0.0)
    scale = ((hi - lo) / 15.0).clamp(min=1e-8)  # [N, K/g]
    zero = torch.round(-lo / scale).clamp(0, 15)
    q = torch.round(w / scale[..., None] + zero[..., None]).clamp(0, 15)
    return q.view(n, k).to(torch.int32), scale, zero


class Int4Linear(nn.Module):
    """``y = x W^T + b`` with W = (q - zero) * scale per group of ``group`` input columns."""

    weight = None
    packed: torch.Tensor
    scales_zeros: torch.Tensor

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 group: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.group = group
        scale, zero = scale.float(), zero.float()  # [N, K/g]
        if q.device.type == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                q.to(torch.int32).contiguous(), 1)  # [N, K/2] uint8
            sz = torch.stack([scale, (8.0 - zero) * scale], dim=-1)  # [N, K/g, 2]
            self.register_buffer("packed", packed)
            self.register_buffer("scales_zeros", sz.transpose(0, 1).contiguous()
                                 .to(torch.bfloat16))  # [K/g, N, 2]
        else:
            nibbles = q.to(torch.uint8)
            self.register_buffer("packed", nibbles[:, 0::2] | (nibbles[:, 1::2] << 4))
            self.register_buffer("scales_zeros", torch.stack([scale, zero], dim=-1))
        self.bias = None if bias is None else bias.detach().clone()

    def _unpacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [N, K] fp32, scale, zero [N, K/g]) from the device layout (CUDA path)."""
        lo, hi = self.packed & 0xF, self.packed >> 4
        q = torch.stack([lo, hi], dim=-1).view(self.out_features, self.in_features)
        return q.float(), self.scales_zeros[..., 0], self.scales_zeros[..., 1]

    def _nibbles_cpu(self) -> torch.Tensor:
        """[N, K] uint8 values 0..15 from the CPU kernel's packing: each whole block of 64
        rows is K x 32 bytes, row j in the low nibble and row 32 + j in the high one; the
        last N % 64 rows (N is a multiple of 16) are K x (N % 64) / 2 bytes, rows 2j (low)
        and 2j + 1 (high) sharing byte j."""
        n, k = self.out_features, self.in_features
        whole = n - n % _BLOCK_N
        flat = self.packed.view(-1)
        parts = []
        if whole:
            blocks = flat[: whole * k // 2].view(whole // _BLOCK_N, k, 32)
            q = torch.cat([blocks & 0xF, blocks >> 4], dim=2)  # [N/64, K, 64]
            parts.append(q.permute(0, 2, 1).reshape(whole, k))
        if n > whole:
            tail = flat[whole * k // 2:].view(k, (n - whole) // 2)
            pairs = torch.stack([tail & 0xF, tail >> 4], dim=2)  # [K, t/2, 2]
            parts.append(pairs.view(k, n - whole).t())
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _unpacked_cpu(self) -> torch.Tensor:
        """[N, K] fp32 weights straight from the CPU kernel's packing, then (q - 8) * s + z'
        per group: the kernel's own dequantization."""
        n, k, g = self.out_features, self.in_features, self.group
        q = self._nibbles_cpu().reshape(n, k // g, g).float()
        sz = self.scales_zeros.float()  # [K/g, N, 2]
        scale, zero = sz[..., 0].t()[..., None], sz[..., 1].t()[..., None]  # [N, K/g, 1]
        return ((q - 8.0) * scale + zero).view(n, k)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, K] fp32
        """Weight rows ``ids``, dequantized from the device layout (an embedding lookup):
        on the CPU, row r lives in block r // 64, byte column r % 32, the high nibble when
        r % 64 >= 32; its group scales and z' are column r of ``scales_zeros``."""
        k, g = self.in_features, self.group
        if self.packed.device.type != "cpu" or self.out_features % _BLOCK_N:
            return self.dequantized()[ids]
        blocks = self.packed.view(self.out_features // _BLOCK_N, k, 32)
        lane = ids % _BLOCK_N  # [T]
        raw = blocks[ids // _BLOCK_N, :, lane % 32]  # [T, K] uint8
        q = (raw >> (4 * (lane >= 32).to(torch.uint8))[:, None]) & 0xF
        sz = self.scales_zeros[:, ids].float()  # [K/g, T, 2]
        scale, zero = sz[..., 0].t()[..., None], sz[..., 1].t()[..., None]  # [T, K/g, 1]
        return ((q.view(-1, k // g, g).float() - 8.0) * scale + zero).view(-1, k)

    def dequantized(self) -> torch.Tensor:  # [N, K] fp32: the reference weight
        if self.packed.device.type == "cpu":
            return self._unpacked_cpu()
        q, scale, zero = self._unpacked()
        n, k = q.shape
        w = (q.view(n, k // self.group, self.group) - zero[..., None]) * scale[..., None]
        return w.view(n, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        flat = x.reshape(-1, self.in_features)
        if flat.device.type == "cpu" and flat.shape[0] <= KERNEL_ROWS:
            out = torch._weight_int4pack_mm_for_cpu(
                flat.to(torch.bfloat16), self.packed, self.group, self.scales_zeros,
            ).to(x.dtype)
        elif flat.device.type == "cuda":  # the Triton W4A16 kernel
            from kernels.quant.weight_only import w4a16_matmul

            out = w4a16_matmul(flat.contiguous(), self.packed, self.scales_zeros, self.group)
        else:
            out = F.linear(flat, self.dequantized().to(x.dtype))
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int4 group={self.group}")


class Int4Embedding(nn.Module):
    """An embedding whose table is an ``Int4Linear``'s packed rows (the tied LM head's, when
    the checkpoint ties them: one copy serves both); a lookup dequantizes only its rows."""

    weight = None

    def __init__(self, table: Int4Linear, dtype: torch.dtype,
                 padding_idx: int | None = None) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype
        self.padding_idx = padding_idx
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., H]
        flat = ids.reshape(-1)
        return self.table.rows(flat).to(self.dtype).view(*ids.shape, self.embedding_dim)
