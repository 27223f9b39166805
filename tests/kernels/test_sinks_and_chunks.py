"""Attention sinks (gpt-oss) and chunked local attention (Llama 4) in every kernel.

The reference is checked against the dense formula transformers uses (a sink column
concatenated to the scores, then dropped; a chunk mask ``k // C == q // C``), and the
Triton decode/prefill kernels and the CPU C++ kernel against the reference.
"""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_decode_attention, reference
from kernels.decode_attention import paged_decode_attention
from kernels.prefill_attention import paged_prefill_attention
from tests.kernels.conftest import build_paged_context

F32, F16 = torch.float32, torch.float16


def _sinks(num_heads: int, device: torch.device) -> torch.Tensor:
    return torch.randn(num_heads, generator=torch.Generator().manual_seed(7)).to(device) * 2


def _dense(q, k, v, scale, sinks, chunk):  # type: ignore[no-untyped-def]
    """One sequence's causal attention with all keys at hand: q [Lq, Hq, D] are the last
    Lq of k/v's [L, Hkv, D] positions; what transformers' eager gpt-oss/Llama 4 compute."""
    q_len, hq, _ = q.shape
    ctx, hkv, _ = k.shape
    kk = k.repeat_interleave(hq // hkv, 1).transpose(0, 1)  # [Hq, L, D]
    vv = v.repeat_interleave(hq // hkv, 1).transpose(0, 1)
    scores = q.transpose(0, 1) @ kk.transpose(1, 2) * scale  # [Hq, Lq, L]
    qp = torch.arange(ctx - q_len, ctx).view(-1, 1)
    kp = torch.arange(ctx).view(1, -1)
    mask = kp <= qp
    if chunk:
        mask &= kp // chunk == qp // chunk
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        col = sinks.view(-1, 1, 1).expand(hq, q_len, 1)
        probs = torch.softmax(torch.cat([scores, col], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    return (probs @ vv).transpose(0, 1)


OPTIONS = [{"sinks": True}, {"chunk_size": 16}, {"sinks": True, "chunk_size": 8},
           {"sinks": True, "sliding_window": 12}]
IDS = ["sinks", "chunk16", "sinks+chunk8", "sinks+window"]


def _opts(options: dict, num_heads: int, device: torch.device) -> dict:
    out = dict(options)
    if out.pop("sinks", False):
        out["sinks"] = _sinks(num_heads, device)
    return out


@pytest.mark.parametrize("options", OPTIONS[:3], ids=IDS[:3])
def test_reference_equals_the_dense_formula(options):
    """Prefill chunks over a prefix, and decode rows, against the dense formula."""
    cpu = torch.device("cpu")
    seq_lens, q_lens = [40, 23], [9, 23]
    ctx = build_paged_context(seq_lens, num_kv_heads=2, head_dim=16, block_size=8,
                              dtype=F32, device=cpu)
    q = torch.randn(sum(q_lens), 4, 16, generator=torch.Generator().manual_seed(3))
    opts = _opts(options, 4, cpu)
    qsl = torch.tensor([0, 9, 32], dtype=torch.int32)
    got = reference.paged_prefill_attention(q, ctx.k_cache, ctx.v_cache, ctx.block_tables,
                                            qsl, ctx.seq_lens, 0.25, **opts)
    lo = 0
    for i, (n, ql) in enumerate(zip(seq_lens, q_lens, strict=True)):
        nb = -(-n // 8)
        k = reference.gather_kv(ctx.k_cache, ctx.block_tables[i:i + 1], nb)[0, :n]
        v = reference.gather_kv(ctx.v_cache, ctx.block_tables[i:i + 1], nb)[0, :n]
        want = _dense(q[lo:lo + ql], k, v, 0.25, opts.get("sinks"), opts.get("chunk_size"))
        torch.testing.assert_close(got[lo:lo + ql], want, atol=1e-5, rtol=1e-5)
        dec = reference.paged_decode_attention(q[lo + ql - 1:lo + ql], ctx.k_cache, ctx.v_cache,
                                               ctx.block_tables[i:i + 1], ctx.seq_lens[i:i + 1],
                                               0.25, **opts)
        torch.testing.assert_close(dec[0], want[-1], atol=1e-5, rtol=1e-5)
        lo += ql


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("options", OPTIONS, ids=IDS)
def test_triton_decode(paged_context, randn, close, splits, dtype, options):
    seq_lens = [5, 64, 150]
    ctx = paged_context(seq_lens, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype)
    q = randn(3, 8, 64, dtype=dtype) * 3
    opts = _opts(options, 8, q.device)
    args = (q, ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens, 0.125)
    got = paged_decode_attention(*args, num_kv_splits=splits, **opts)
    close(got, reference.paged_decode_attention(*args, **opts))


@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("options", OPTIONS, ids=IDS)
def test_triton_prefill(paged_context, randn, close, dtype, options):
    q_lens, prefixes = [9, 1, 21], [0, 30, 12]
    seq_lens = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
    ctx = paged_context(seq_lens, num_kv_heads=2, head_dim=64, block_size=8, dtype=dtype)
    q = randn(sum(q_lens), 4, 64, dtype=dtype) * 3
    qsl = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32).to(q.device)
    opts = _opts(options, 4, q.device)
    args = (q, ctx.k_cache, ctx.v_cache, ctx.block_tables, qsl, ctx.seq_lens, 0.125)
    close(paged_prefill_attention(*args, **opts), reference.paged_prefill_attention(*args, **opts))


@pytest.mark.skipif(cpu_decode_attention.unavailable_reason() is not None,
                    reason="no C++ compiler")
@pytest.mark.parametrize("head_dim", [32, 80])  # the vectorised and the generic code
@pytest.mark.parametrize("options", OPTIONS, ids=IDS)
def test_cpu_kernel(options, head_dim):
    cpu = torch.device("cpu")
    ctx = build_paged_context([5, 64, 150, 16, 17], num_kv_heads=2, head_dim=head_dim,
                              block_size=16, dtype=F32, device=cpu)
    q = torch.randn(5, 8, head_dim, generator=torch.Generator().manual_seed(5)) * 3
    opts = _opts(options, 8, cpu)
    args = (q, ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens, head_dim ** -0.5)
    torch.testing.assert_close(cpu_decode_attention.paged_decode_attention(*args, **opts),
                               reference.paged_decode_attention(*args, **opts),
                               atol=1e-5, rtol=1e-5)


def test_bad_sinks_are_refused(paged_context, randn):
    ctx = paged_context([5], num_kv_heads=2, head_dim=64, block_size=16, dtype=F32)
    q = randn(1, 8, 64)
    with pytest.raises(ValueError, match="sinks must be a \\[8\\] tensor"):
        paged_decode_attention(q, ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens,
                               0.1, sinks=torch.zeros(4, device=q.device))
