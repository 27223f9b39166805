"""The Triton kernels on an FP8 (e4m3) KV cache equal the pure-torch reference on it.

``store_kv`` writes the same bytes as ``reference.store_kv`` (values past e4m3's range
saturate at +-448); decode (split and not) and prefill read FP8 pages, widening each tile
to the query dtype, and match the reference, which reads the same pages as fp32.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.decode_attention import paged_decode_attention
from kernels.prefill_attention import paged_prefill_attention
from kernels.store_kv import store_kv

FP8 = torch.float8_e4m3fn


def _fp8_context(paged_context, seq_lens: list[int]):
    ctx = paged_context(seq_lens, num_kv_heads=2, head_dim=32, block_size=8,
                        dtype=torch.float32)
    ctx.k_cache, ctx.v_cache = ctx.k_cache.to(FP8), ctx.v_cache.to(FP8)
    return ctx


def test_store_kv_writes_the_reference_bytes(device, randn) -> None:
    # Values on e4m3's grid: the interpreter's float-to-fp8 rounding does not carry into the
    # exponent (1.97 becomes 1.0), so rounding itself is left to the GPU run of this test.
    on_grid = lambda t: t.to(FP8).float()  # noqa: E731
    key, value = on_grid(randn(5, 2, 32) * 3), on_grid(randn(5, 2, 32))
    key[0, 0, :2] = torch.tensor([900.0, -1e5])
    slots = torch.tensor([3, -1, 17, 8, 0], device=device)
    caches = [torch.zeros(4, 8, 2, 32, dtype=FP8, device=device) for _ in range(4)]
    store_kv(key, value, caches[0], caches[1], slots)
    want_k, want_v = caches[2].cpu(), caches[3].cpu()
    reference.store_kv(key.cpu(), value.cpu(), want_k, want_v, slots.cpu())
    assert torch.equal(caches[0].cpu().view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(caches[1].cpu().view(torch.uint8), want_v.view(torch.uint8))
    assert caches[0].view(-1, 2, 32)[3, 0, :2].float().tolist() == [448.0, -448.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_reads_fp8_pages(paged_context, randn, close, dtype, splits) -> None:
    ctx = _fp8_context(paged_context, [1, 9, 40])
    q = randn(3, 4, 32, dtype=dtype)
    got = paged_decode_attention(q, ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens,
                                 32 ** -0.5, num_kv_splits=splits)
    want = reference.paged_decode_attention(q.cpu(), ctx.k_cache.cpu(), ctx.v_cache.cpu(),
                                            ctx.block_tables.cpu(), ctx.seq_lens.cpu(),
                                            32 ** -0.5)
    close(got.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_reads_fp8_pages(device, paged_context, randn, close, dtype) -> None:
    ctx = _fp8_context(paged_context, [5, 30])
    q_lens = [5, 12]  # a fresh prompt, a chunk over a cached prefix of 18
    q = randn(sum(q_lens), 4, 32, dtype=dtype)
    starts = torch.tensor([0, 5, 17], dtype=torch.int32, device=device)
    got = paged_prefill_attention(q, ctx.k_cache, ctx.v_cache, ctx.block_tables, starts,
                                  ctx.seq_lens, 32 ** -0.5)
    want = reference.paged_prefill_attention(
        q.cpu(), ctx.k_cache.cpu(), ctx.v_cache.cpu(), ctx.block_tables.cpu(), starts.cpu(),
        ctx.seq_lens.cpu(), 32 ** -0.5)
    close(got.cpu(), want)


@pytest.mark.parametrize("head_dim", [32, 24])  # the AVX2 path (8 x 4) and the generic loops
def test_cpu_kernel_reads_fp8_pages(paged_context, head_dim) -> None:
    from kernels import cpu_decode_attention

    if cpu_decode_attention.unavailable_reason() is not None:
        pytest.skip(cpu_decode_attention.unavailable_reason())
    ctx = paged_context([1, 9, 40, 17], num_kv_heads=2, head_dim=head_dim, block_size=8,
                        dtype=torch.float32)
    k8, v8 = ctx.k_cache.cpu().to(FP8), ctx.v_cache.cpu().to(FP8)
    every = torch.arange(256, dtype=torch.uint8).view(FP8)  # every byte pattern but NaN
    finite = every[~every.float().isnan()]
    k8.view(-1)[: finite.numel()] = finite  # the whole e4m3 table is read somewhere
    q = torch.randn(4, 4, head_dim, generator=torch.Generator().manual_seed(0))
    tables, lens = ctx.block_tables.cpu(), ctx.seq_lens.cpu()
    got = cpu_decode_attention.paged_decode_attention(q, k8, v8, tables, lens, 0.05)
    want = reference.paged_decode_attention(q, k8, v8, tables, lens, 0.05)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    call = cpu_decode_attention.DecodeCall(tables, lens, 0.05)
    torch.testing.assert_close(call(q, k8, v8), want, atol=1e-4, rtol=1e-4)
