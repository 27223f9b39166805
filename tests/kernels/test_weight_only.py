"""The Triton W8A16 and W4A16 kernels (interpreter on CPU, the GPU when present) against
dequantize-then-matmul in fp32, on ragged shapes: rows and output features not multiples
of the tile, K over several tiles and groups, bias or none, fp32 and bf16 activations;
and the layers' CUDA layouts they read (``Int4Linear``'s nibble packing)."""

from __future__ import annotations

import pytest
import torch

from kernels.quant.weight_only import w4a16_matmul, w8a16_matmul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}


def _dtypes() -> list[torch.dtype]:
    return [torch.bfloat16] if DEVICE == "cuda" else [torch.float32, torch.bfloat16]


@pytest.mark.parametrize(("m", "n", "k"), [(1, 64, 32), (3, 70, 96), (17, 130, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", _dtypes())
def test_w8a16_is_the_dequantized_product(m: int, n: int, k: int, with_bias: bool,
                                          dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, generator=gen) / 64
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    want = x.float() @ (q.float() * scale[:, None]).t()
    if bias is not None:
        want = want + bias.float()
    got = w8a16_matmul(x.to(DEVICE), q.to(DEVICE), scale.to(DEVICE),
                       None if bias is None else bias.to(DEVICE))
    assert got.dtype == dtype
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.float().cpu(), want, rtol=rtol, atol=atol * 10)


@pytest.mark.parametrize(("m", "n", "k", "group"), [(1, 64, 64, 32), (5, 70, 128, 64),
                                                    (17, 96, 256, 128)])
@pytest.mark.parametrize("dtype", _dtypes())
def test_w4a16_is_the_dequantized_product(m: int, n: int, k: int, group: int,
                                          dtype: torch.dtype) -> None:
    from worker.engine.runner.quant.int4 import quantize_groups

    gen = torch.Generator().manual_seed(m * n + group)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    q, scale, zero = quantize_groups(torch.randn(n, k, generator=gen), group)
    nibbles = q.to(torch.uint8)
    packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)  # Int4Linear's CUDA layout
    sz = torch.stack([scale, zero], dim=-1)  # [N, K/g, 2]
    w = ((q.view(n, k // group, group) - zero[..., None]) * scale[..., None]).view(n, k)
    want = x.float() @ w.t() + bias.float()
    got = w4a16_matmul(x.to(DEVICE), packed.to(DEVICE), sz.to(DEVICE), group,
                       bias.to(DEVICE))
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.float().cpu(), want, rtol=rtol, atol=atol * 10)


def test_w4a16_refuses_a_group_the_steps_straddle() -> None:
    x = torch.zeros(1, 48)
    with pytest.raises(ValueError, match="group"):
        w4a16_matmul(x, torch.zeros(64, 24, dtype=torch.uint8), torch.zeros(64, 3, 2), 16)
