"""Triton paged prefill attention against ``kernels.reference`` (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.decode_attention import paged_decode_attention
from kernels.prefill_attention import paged_prefill_attention

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (num_kv_heads, group, head_dim, block_size, dtype, q_lens, cached prefix lens, hint)
# Mixed query lengths including 1 and 0, prefixes 0 and > 0, several sequences per call.
CASES = [
    (2, 4, 80, 16, F32, [1, 7, 20], [0, 9, 30], None),
    (1, 8, 64, 8, F16, [3, 1, 12], [5, 0, 17], 12),
    (2, 1, 96, 32, BF16, [16, 1], [40, 3], None),
    (1, 4, 64, 16, F32, [4, 0, 2], [0, 10, 1], 4),
    (2, 2, 128, 8, F16, [70], [0], None),  # several query tiles and key tiles
    (1, 4, 64, 16, BF16, [33, 18, 1, 40], [0, 50, 7, 3], None),  # many tiles per sequence
]


def _case_id(case: tuple) -> str:
    hkv, group, dim, bs, dtype, q_lens, prefixes, hint = case
    return f"hkv{hkv}-g{group}-d{dim}-bs{bs}-{str(dtype)[6:]}-q{q_lens}-p{prefixes}-hint{hint}"


def _prefill_inputs(paged_context, randn, q_lens, prefixes, *, hkv, group, dim, bs, dtype):
    seq_lens = [p + n for p, n in zip(prefixes, q_lens, strict=True)]
    ctx = paged_context(seq_lens, num_kv_heads=hkv, head_dim=dim, block_size=bs, dtype=dtype)
    offsets = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    q = randn(sum(q_lens), hkv * group, dim, dtype=dtype)
    return ctx, q, offsets.to(q.device)


def _run(ctx, q, query_start_loc, **kwargs):
    args = (q, ctx.k_cache, ctx.v_cache, ctx.block_tables, query_start_loc, ctx.seq_lens)
    scale = q.shape[-1] ** -0.5
    hint = kwargs.pop("max_query_len", None)
    got = paged_prefill_attention(*args, scale, max_query_len=hint, **kwargs)
    return got, reference.paged_prefill_attention(*args, scale, **kwargs)


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_matches_reference(paged_context, randn, close, case):
    hkv, group, dim, bs, dtype, q_lens, prefixes, hint = case
    ctx, q, qsl = _prefill_inputs(
        paged_context, randn, q_lens, prefixes, hkv=hkv, group=group, dim=dim, bs=bs, dtype=dtype
    )
    got, want = _run(ctx, q, qsl, max_query_len=hint)
    assert got.dtype == dtype and got.shape == q.shape
    close(got, want)


@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "options",
    [
        {"sliding_window": 6},
        {"logits_soft_cap": 2.0},
        {"sliding_window": 1, "logits_soft_cap": 5.0},
    ],
    ids=["window", "softcap", "window1+softcap"],
)
def test_window_and_soft_cap(paged_context, randn, close, dtype, options):
    ctx, q, qsl = _prefill_inputs(
        paged_context, randn, [9, 1, 21], [0, 30, 12], hkv=2, group=2, dim=64, bs=8, dtype=dtype
    )
    got, want = _run(ctx, q * 3, qsl, **options)
    close(got, want)


def test_single_token_queries_match_decode(paged_context, randn, close):
    """A prefill batch of 1-token chunks is a decode batch: both kernels must agree."""
    ctx, q, qsl = _prefill_inputs(
        paged_context, randn, [1, 1, 1], [0, 17, 40], hkv=2, group=4, dim=80, bs=16, dtype=F32
    )
    got, _ = _run(ctx, q, qsl, max_query_len=1, sliding_window=10)
    decode = paged_decode_attention(
        q, ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens, 80**-0.5,
        num_kv_splits=2, sliding_window=10,
    )  # fmt: skip
    close(got, decode)


def test_padding_rows_untouched(paged_context, randn, close):
    """Rows of q past query_start_loc[-1] (CUDA-graph padding) are not written."""
    ctx, q, qsl = _prefill_inputs(
        paged_context, randn, [3, 2], [4, 0], hkv=1, group=2, dim=64, bs=8, dtype=F16
    )
    padded = torch.cat([q, randn(4, 2, 64, dtype=F16)])
    out = torch.full_like(padded, 7.0)
    paged_prefill_attention(
        padded, ctx.k_cache, ctx.v_cache, ctx.block_tables, qsl, ctx.seq_lens, 0.125, out=out
    )
    want = reference.paged_prefill_attention(
        q, ctx.k_cache, ctx.v_cache, ctx.block_tables, qsl, ctx.seq_lens, 0.125
    )
    close(out[:5], want)
    assert bool((out[5:] == 7.0).all())


def _good_args(device: torch.device) -> dict:
    i32 = torch.int32
    return {
        "q": torch.zeros(5, 4, 64, device=device),
        "k_cache": torch.zeros(6, 8, 2, 64, device=device),
        "v_cache": torch.zeros(6, 8, 2, 64, device=device),
        "block_tables": torch.zeros(2, 3, dtype=i32, device=device),
        "query_start_loc": torch.tensor([0, 2, 5], dtype=i32, device=device),
        "seq_lens": torch.tensor([2, 3], dtype=i32, device=device),
        "scale": 1.0,
    }


# name -> (argument overrides built from the good arguments, expected message fragment)
BAD_INPUTS = {
    "q 4-D": (lambda a: {"q": a["q"][None]}, "q must be 3-D"),
    "cache dtype": (lambda a: {"v_cache": a["v_cache"].half()}, "dtype"),
    "heads": (lambda a: {"q": a["q"].new_zeros(5, 3, 64)}, "multiple of num_kv_heads"),
    "qsl length": (lambda a: {"query_start_loc": a["query_start_loc"][:2]}, "num_seqs \\+ 1"),
    "qsl dtype": (lambda a: {"query_start_loc": a["query_start_loc"].long()}, "query_start_loc"),
    "seq_lens vs tables": (lambda a: {"seq_lens": a["seq_lens"][:1]}, "block_tables has 2 rows"),
    "strided q": (lambda a: {"q": a["q"].new_zeros(5, 4, 64, 2)[..., 0]}, "q must be contiguous"),
    "out dtype": (lambda a: {"out": a["q"].half()}, "out must have dtype"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_raises_value_error(device, name):
    args = _good_args(device)
    overrides, message = BAD_INPUTS[name]
    with pytest.raises(ValueError, match=message):
        paged_prefill_attention(**(args | overrides(args)))
