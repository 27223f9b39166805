"""FP8 W8A8 linear layers on ``torch._scaled_mm`` (cuBLASLt on CUDA; it runs on CPU too, so
the CPU tests exercise the op the GPU runs).

Weights are float8_e4m3fn [N, K] with one scale per tensor or per output channel;
activations are quantized per step, with one scale per token computed from the row's
absolute maximum (dynamic), or one static scale per tensor from the checkpoint. Where both
scales are single numbers the fused op takes them. Where either is a vector (per-channel
weights, per-token activations), the product runs with unit scales into an fp32 output and
is rescaled by the outer product of the two scale vectors afterwards: what vLLM does where
cuBLASLt's row-wise scaling is not available; exact up to fp32 rounding, since a scale
that is constant along K factors out of the dot product.
"""

from __future__ import annotations

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_ALIGN = 16  # cuBLASLt: both K and N multiples of 16


def quantize_fp8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (fp8 [N, K], fp32 scale [N]): one scale per output channel."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def check_shape(name: str, n: int, k: int) -> None:
    """``_scaled_mm`` takes only K and N that are multiples of 16: refuse others by name."""
    if n % _ALIGN or k % _ALIGN:
        from worker.engine.runner.quant.config import QuantizationError

        raise QuantizationError(
            f"fp8: layer {name} has shape [{n}, {k}]; torch._scaled_mm needs both "
            f"dimensions to be multiples of {_ALIGN}")


class Fp8Linear(nn.Module):
    """``y = (x_q * s_x) (w_q * s_w)^T + b`` on ``torch._scaled_mm``."""

    weight = None
    qweight_t: torch.Tensor
    weight_scale: torch.Tensor
    input_scale: torch.Tensor | None
    one: torch.Tensor

    def __init__(self, qweight: torch.Tensor, weight_scale: torch.Tensor,
                 input_scale: torch.Tensor | None, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight_t", qweight.to(FP8).t())  # [K, N], column-major
        scale = weight_scale.float().reshape(-1)
        self.per_tensor_weight = scale.numel() == 1
        self.register_buffer("weight_scale", scale[0] if self.per_tensor_weight
                             else scale.view(1, -1))  # [] or [1, N]
        self.register_buffer("input_scale", None if input_scale is None
                             else input_scale.float().reshape(-1)[0])  # [] or None
        self.register_buffer("one", torch.ones((), dtype=torch.float32))
        self.bias = None if bias is None else bias.detach().clone()

    def dequantized(self) -> torch.Tensor:  # [N, K] fp32: the reference weight
        w = self.qweight_t.t().float()
        return w * (self.weight_scale if self.per_tensor_weight else self.weight_scale.t())

    def _quantize_input(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """flat [M, K] -> (fp8 [M, K], scale [] static or [M, 1] per token)."""
        x = flat.float()
        if self.input_scale is not None:
            scale = self.input_scale
        else:
            scale = (x.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        flat = x.reshape(-1, self.in_features)
        xq, x_scale = self._quantize_input(flat)
        if x_scale.dim() == 0 and self.per_tensor_weight:  # the fused op takes both
            out = torch._scaled_mm(xq, self.qweight_t, scale_a=x_scale,
                                   scale_b=self.weight_scale, out_dtype=torch.float32)
        else:  # fp32 output, rescaled: [M, 1] x [1, N] scales
            out = torch._scaled_mm(xq, self.qweight_t, scale_a=self.one, scale_b=self.one,
                                   out_dtype=torch.float32)
            out = out * x_scale * self.weight_scale
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        acts = "static" if self.input_scale is not None else "dynamic per-token"
        return (f"in_features={self.in_features}, out_features={self.out_features}, fp8, "
                f"weight scale per {'tensor' if self.per_tensor_weight else 'channel'}, "
                f"activations {acts}")
