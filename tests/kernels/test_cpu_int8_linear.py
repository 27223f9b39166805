"""The C++ INT8 weight-only linear kernel against the dequantized fp32 product, over the
shapes its blocking splits: row counts around the 4-row tile, output rows around the
4-row tile and the 64-row chunk, K not a multiple of the vector width, strided rows,
bias or none, and a product large enough to run on several threads."""

from __future__ import annotations

import pytest
import torch

from kernels.quant import cpu_int8_linear

pytestmark = pytest.mark.skipif(cpu_int8_linear.unavailable_reason() is not None,
                                reason="no C++ compiler for the kernel")


def _reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ (q.double() * scale.double()[:, None]).t()
    return (out if bias is None else out + bias.double()).float()


@pytest.mark.parametrize(("m", "n", "k"), [(1, 1, 1), (1, 5, 16), (3, 4, 17), (4, 67, 40),
                                           (5, 130, 256), (9, 64, 704), (32, 256, 33),
                                           (2, 8192, 256)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_linear_is_the_dequantized_product(m: int, n: int, k: int,
                                                with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, generator=gen) / 64
    bias = torch.randn(n, generator=gen) if with_bias else None
    got = cpu_int8_linear.int8_linear(x, q, scale, bias)
    torch.testing.assert_close(got, _reference(x, q, scale, bias), rtol=1e-5, atol=1e-5)


def test_strided_rows_and_threads() -> None:
    gen = torch.Generator().manual_seed(7)
    wide = torch.randn(24, 300, generator=gen)
    x = wide[:, :288]  # rows 300 apart
    q = torch.randint(-127, 128, (1024, 288), generator=gen, dtype=torch.int8)
    scale = torch.rand(1024, generator=gen) / 64
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # 24 x 1024 x 288 MACs: the parallel loop
        got = cpu_int8_linear.int8_linear(x, q, scale)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(got, _reference(x, q, scale, None), rtol=1e-5, atol=1e-5)


def test_bad_shapes_are_refused() -> None:
    q = torch.zeros(8, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="int8_linear"):
        cpu_int8_linear.int8_linear(torch.zeros(2, 15), q, torch.ones(8))
    with pytest.raises(ValueError, match="int8_linear"):
        cpu_int8_linear.int8_linear(torch.zeros(2, 16, dtype=torch.float64), q, torch.ones(8))
