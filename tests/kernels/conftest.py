"""Fixtures for the Triton kernel tests: device choice and paged-cache builders.

The kernels run under the Triton interpreter on CPU (``TRITON_INTERPRET=1``), and on
the GPU when one is present. Triton decides interpreted-or-compiled when a kernel is
*defined*, so the variable must be set before ``kernels`` is first imported: here, at
the top of this conftest (``ops/test.sh`` also exports it for the whole suite).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from kernels import reference  # noqa: E402

# Value of padding and unused cache slots: large enough that reading one by mistake
# moves the output far outside any tolerance, small enough not to overflow fp16 dots.
TRASH = 8.0

# (atol, rtol) against the fp32-accumulating reference. fp16/bf16 differ from it mainly
# by rounding the softmax probabilities to the input dtype before the P @ V product.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (4e-2, 2e-2),
}


@pytest.fixture(scope="session")
def device() -> torch.device:
    """CUDA when present, else CPU; the interpreter must be on when there is no GPU."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    from kernels.decode_attention import _decode_split_kernel

    if type(_decode_split_kernel).__name__ != "InterpretedFunction":
        pytest.fail(
            "no CUDA device and the kernels were compiled-mode: `kernels` was imported "
            "before TRITON_INTERPRET=1 was set; export it before running pytest"
        )
    return torch.device("cpu")


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    atol, rtol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


@pytest.fixture
def close() -> Callable[[torch.Tensor, torch.Tensor], None]:
    """``close(actual, expected)``: assert_close with the tolerance of expected's dtype."""
    return assert_close


@dataclass
class PagedContext:
    """A batch of contexts stored in a shuffled paged cache."""

    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D], unused slots = TRASH
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [S, max_blocks + 1] int32; padding -> a TRASH block
    seq_lens: torch.Tensor  # [S] int32


def _logical_kv(seq_lens: list[int], num_kv_heads: int, head_dim: int, seed: int):
    """Per-sequence K/V [L, Hkv, D] in fp32, independent of the block size."""
    gen = torch.Generator().manual_seed(seed)
    shape = (sum(seq_lens), num_kv_heads, head_dim)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def build_paged_context(
    seq_lens: list[int],
    *,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> PagedContext:
    """Scatter random contexts into a cache through a shuffled, non-contiguous table.

    Two never-referenced blocks and one spare table column exist so that a kernel
    reading past a sequence's length (or through a padding entry) picks up TRASH.
    """
    blocks = [max(1, math.ceil(n / block_size)) for n in seq_lens]
    num_blocks = sum(blocks) + 2
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed + 1))
    trash_block = int(perm[-1])
    tables = torch.full((len(seq_lens), max(blocks) + 1), trash_block, dtype=torch.int32)
    slots, used = [], 0
    for i, (n, nb) in enumerate(zip(seq_lens, blocks, strict=True)):
        tables[i, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
        pos = torch.arange(n)
        slots.append(tables[i, pos // block_size].long() * block_size + pos % block_size)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, TRASH, dtype=dtype)
    v_cache = torch.full(shape, TRASH, dtype=dtype)
    keys, values = _logical_kv(seq_lens, num_kv_heads, head_dim, seed)
    slot_mapping = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.long)
    reference.store_kv(keys, values, k_cache, v_cache, slot_mapping)
    return PagedContext(
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )


@pytest.fixture
def paged_context(device: torch.device) -> Callable[..., PagedContext]:
    """``paged_context(seq_lens, num_kv_heads=, head_dim=, block_size=, dtype=)``."""

    def make(seq_lens: list[int], **kwargs) -> PagedContext:
        return build_paged_context(seq_lens, device=device, **kwargs)

    return make


@pytest.fixture
def randn(device: torch.device) -> Callable[..., torch.Tensor]:
    """Seeded ``randn(*shape, dtype=)`` on the test device."""
    gen = torch.Generator().manual_seed(1234)

    def make(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype=dtype, device=device)

    return make
