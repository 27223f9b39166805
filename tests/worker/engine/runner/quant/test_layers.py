"""Each quantized layer against its dequantized weight, on each of its CPU paths (a kernel
up to ``KERNEL_ROWS`` rows: int8's own C++ one for fp32 activations, torch's packed one for
bf16; a GEMM on the widened weight above), and the FP8 layer's
fused and rescaled ``_scaled_mm`` calls against the same product in fp32 torch."""

from __future__ import annotations

import pytest
import torch

from tests.worker.engine.runner.quant.agreement import fp8_reference_forward
from worker.engine.runner.quant.fp8 import Fp8Linear, quantize_fp8_rows
from worker.engine.runner.quant.int4 import Int4Linear, quantize_groups
from worker.engine.runner.quant.int8 import (
    KERNEL_ROWS,
    Int8Linear,
    native_kernel,
    quantize_rows,
)


@pytest.mark.parametrize("rows", [1, 5, KERNEL_ROWS, KERNEL_ROWS + 1, 100])
def test_int8_both_paths_multiply_the_dequantized_weight(rows: int) -> None:
    torch.manual_seed(0)
    weight, x, bias = torch.randn(96, 64), torch.randn(rows, 64), torch.randn(96)
    layer = Int8Linear(*quantize_rows(weight), bias)
    want = x @ layer.dequantized().t() + bias
    torch.testing.assert_close(layer(x), want, rtol=2e-2, atol=5e-2)  # bf16 activations
    if rows <= KERNEL_ROWS and native_kernel():  # fp32 activations: the C++ kernel
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    layer = Int8Linear(*quantize_rows(weight), bias.bfloat16())  # a bf16 model's layer
    got = layer(x.bfloat16())  # torch's packed kernel / the bf16 GEMM
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=1e-1)


@pytest.mark.parametrize(("out", "group"), [(128, 32), (64, 64), (96, 32)])
@pytest.mark.parametrize("rows", [1, KERNEL_ROWS + 8])
def test_int4_both_paths_multiply_the_dequantized_weight(out: int, group: int,
                                                         rows: int) -> None:
    torch.manual_seed(1)
    weight, x = torch.randn(out, 128), torch.randn(rows, 128)
    q, scale, zero = quantize_groups(weight, group)
    layer = Int4Linear(q, scale, zero, group, None)
    eye = torch.eye(128)  # the kernel's own dequantization, row by row
    kernel_w = torch._weight_int4pack_mm_for_cpu(eye, layer.packed, group,
                                                 layer.scales_zeros.float()).t()
    torch.testing.assert_close(layer.dequantized(), kernel_w, rtol=0, atol=0)
    torch.testing.assert_close(layer(x), x @ kernel_w.t(), rtol=2e-2, atol=1e-1)


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("static", [True, False])
def test_fp8_scaled_mm_equals_the_fp32_product(per_channel: bool, static: bool) -> None:
    torch.manual_seed(2)
    weight, x = torch.randn(48, 32), torch.randn(7, 32)
    q, scale = quantize_fp8_rows(weight)
    if not per_channel:
        scale = scale.max().reshape(1)
        q = (weight / scale).to(torch.float8_e4m3fn)
    layer = Fp8Linear(q, scale, torch.tensor([0.02]) if static else None, None)
    torch.testing.assert_close(layer(x), fp8_reference_forward(layer, x), rtol=1e-5,
                               atol=1e-5)
