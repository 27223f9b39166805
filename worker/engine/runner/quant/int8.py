"""INT8 weight-only linear layers and embeddings (per output channel / per row, symmetric).

CPU: ``torch._weight_int8pack_mm`` with bf16 activations. Measured on the 2-core dev
machine for a 4096x1024 weight at one row: 76 us, against 1,411 us for the same op with
fp32 activations and 269 us for fp32 ``F.linear`` (``ops/bench/techniques/quant.py``
prints the model-level numbers), so an fp32 model's activations are cast to bf16 for the
product and back. Above ``KERNEL_ROWS`` rows, and on CUDA: the weight is widened to the
activations' dtype per call and the scale applied to the output, the same arithmetic.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

INT8_MAX = 127.0
# CPU: above this many rows (prefill chunks, large batches) the weight is widened to the
# activations' dtype for MKL's sgemm: the packed int8 kernel is a matrix-vector kernel at
# heart, several times slower than sgemm at 128+ rows (ops/bench/techniques/quant.py)
KERNEL_ROWS = 32


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
        if flat.device.type == "cpu" and flat.shape[0] <= KERNEL_ROWS:
            out = torch._weight_int8pack_mm(flat.to(torch.bfloat16), self.qweight,
                                            self.scale_bf16).to(x.dtype)
        else:
            out = F.linear(flat, self.qweight.to(x.dtype)) * self.scale.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

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
