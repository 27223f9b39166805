"""Triton paged decode attention against ``kernels.reference`` (interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.decode_attention import paged_decode_attention
from kernels.decode_splits import choose_num_kv_splits

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# A representative slice of the cross product (the interpreter is slow): every value of
# each axis appears at least once. Contexts include 1, non-multiples of the block size
# and several blocks; num_splits None means "use the heuristic".
# (num_kv_heads, group, head_dim, block_size, dtype, num_splits, seq_lens)
CASES = [
    (2, 1, 64, 16, F32, 1, [1, 17, 40]),
    (2, 4, 80, 8, F16, 1, [5, 33]),
    (1, 8, 96, 32, BF16, 1, [70, 1]),
    (2, 4, 64, 32, F32, 3, [100, 1, 257]),
    (2, 1, 80, 16, F16, 4, [130, 9]),
    (1, 8, 64, 8, BF16, 2, [90]),
    (2, 4, 128, 16, F32, None, [60, 200]),
    (1, 2, 256, 16, F16, 2, [50, 3]),
]


def _case_id(case: tuple) -> str:
    hkv, group, dim, bs, dtype, splits, seq_lens = case
    return f"hkv{hkv}-g{group}-d{dim}-bs{bs}-{str(dtype)[6:]}-splits{splits}-len{seq_lens}"


def _run(ctx, q, splits, **kwargs):
    scale = q.shape[-1] ** -0.5
    args = (q, ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens, scale)
    got = paged_decode_attention(*args, num_kv_splits=splits, **kwargs)
    return got, reference.paged_decode_attention(*args, **kwargs)


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_matches_reference(paged_context, randn, close, case):
    hkv, group, head_dim, block_size, dtype, splits, seq_lens = case
    ctx = paged_context(
        seq_lens, num_kv_heads=hkv, head_dim=head_dim, block_size=block_size, dtype=dtype
    )
    q = randn(len(seq_lens), hkv * group, head_dim, dtype=dtype)
    got, want = _run(ctx, q, splits)
    assert got.dtype == dtype and got.shape == q.shape
    close(got, want)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", [F32, F16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(
    "options",
    [
        {"sliding_window": 20},
        {"logits_soft_cap": 2.0},
        {"sliding_window": 9, "logits_soft_cap": 5.0},
    ],
    ids=["window", "softcap", "both"],
)
def test_window_and_soft_cap(paged_context, randn, close, splits, dtype, options):
    seq_lens = [5, 64, 150]
    ctx = paged_context(seq_lens, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype)
    q = randn(3, 8, 64, dtype=dtype) * 3  # sharper scores so the cap matters
    got, want = _run(ctx, q, splits, **options)
    close(got, want)


@pytest.mark.parametrize("splits", [1, 2])
def test_block_size_does_not_change_the_result(paged_context, randn, close, splits):
    """The same logical context paged with 1-token and 16-token blocks: bitwise equal."""
    seq_lens = [1, 23, 70]
    q = randn(3, 4, 80)
    outs = []
    for block_size in (1, 16):
        ctx = paged_context(
            seq_lens, num_kv_heads=1, head_dim=80, block_size=block_size, dtype=F32
        )
        got, want = _run(ctx, q, splits)
        close(got, want)
        outs.append(got)
    assert torch.equal(outs[0], outs[1])


def test_strided_q_and_out(paged_context, randn, close):
    """q sliced out of a fused QKV tensor and out a view with padded rows still work."""
    ctx = paged_context([12, 40], num_kv_heads=2, head_dim=64, block_size=8, dtype=F16)
    qkv = randn(2, 12, 64, dtype=F16)  # [S, Hq + 2 * Hkv, D]
    q = qkv[:, :8]
    backing = torch.zeros(2, 8, 80, dtype=F16, device=q.device)
    out = backing[..., :64]
    got = paged_decode_attention(
        q, ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens, 0.125, out=out,
        num_kv_splits=2,
    )  # fmt: skip
    assert got is out
    want = reference.paged_decode_attention(
        q.contiguous(), ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens, 0.125
    )
    close(out, want)
    assert bool((backing[..., 64:] == 0).all())


@pytest.mark.parametrize("splits", [1, 3])
def test_zero_length_context_gives_zeros(paged_context, randn, splits):
    """Padding sequences (seq_len 0, as in a CUDA-graph batch) give 0, never NaN."""
    ctx = paged_context([0, 20], num_kv_heads=1, head_dim=64, block_size=8, dtype=F32)
    q = randn(2, 2, 64)
    got, want = _run(ctx, q, splits)
    assert bool((got[0] == 0).all()) and bool(got.isfinite().all())
    torch.testing.assert_close(got, want)


def test_empty_batch(paged_context, device):
    ctx = paged_context([4], num_kv_heads=1, head_dim=64, block_size=8, dtype=F32)
    q = torch.zeros(0, 2, 64, device=device)
    tables, lens = ctx.block_tables[:0], ctx.seq_lens[:0]
    got = paged_decode_attention(q, ctx.k_cache, ctx.v_cache, tables, lens, 1.0)
    assert got.shape == (0, 2, 64)


@pytest.mark.parametrize(
    "num_seqs,num_kv_heads,context,expected",
    [
        (1, 8, 32768, 33),  # tiny batch, long context: fill ~2 programs per SM
        (8, 8, 4096, 5),
        (64, 8, 4096, 1),  # 512 programs already fill the GPU
        (1, 8, 300, 2),  # short context: splits of >= 256 tokens only
        (1, 1, 1 << 20, 64),  # capped
    ],
)
def test_split_heuristic(num_seqs, num_kv_heads, context, expected):
    assert choose_num_kv_splits(num_seqs, num_kv_heads, context, num_sms=132) == expected


@pytest.mark.parametrize(
    "num_seqs,num_kv_heads,context,expected",
    [
        (8, 8, 512, 1),  # measured on the H100, eager: 1 split 0.023 ms, 2 splits 0.147 ms
        (1, 8, 4096, 1),  # 1 split 0.110 ms, 16 splits 0.269 ms
        (1, 8, 32768, 4),  # long enough that splits pay for their launch
        (32, 8, 32768, 1),  # 256 programs fill the GPU already
    ],
)
def test_eager_split_heuristic_pays_for_the_second_launch(num_seqs, num_kv_heads, context,
                                                          expected):
    assert choose_num_kv_splits(num_seqs, num_kv_heads, context, num_sms=132,
                                eager=True) == expected


def _good_args(device: torch.device) -> dict:
    return {
        "q": torch.zeros(2, 4, 64, device=device),
        "k_cache": torch.zeros(6, 8, 2, 64, device=device),
        "v_cache": torch.zeros(6, 8, 2, 64, device=device),
        "block_tables": torch.zeros(2, 3, dtype=torch.int32, device=device),
        "seq_lens": torch.ones(2, dtype=torch.int32, device=device),
        "scale": 1.0,
    }


def _both_caches(cache: torch.Tensor) -> dict:
    return {"k_cache": cache, "v_cache": cache.clone()}


# name -> (argument overrides built from the good arguments, expected message fragment)
BAD_INPUTS = {
    "q 2-D": (lambda a: {"q": a["q"][0]}, "q must be 3-D"),
    "q int": (lambda a: {"q": a["q"].long()}, "q must have dtype"),
    "cache dtype": (lambda a: _both_caches(a["k_cache"].half()), "kv cache dtype"),
    "k/v shapes": (lambda a: {"v_cache": a["v_cache"][:5]}, "shapes differ"),
    "strided head_dim": (
        lambda a: _both_caches(torch.zeros(6, 8, 2, 64, 2, device=a["q"].device)[..., 0]),
        "contiguous in its last dim",
    ),
    "heads": (lambda a: {"q": a["q"].new_zeros(2, 3, 64)}, "multiple of num_kv_heads"),
    "head_dim": (lambda a: {"q": a["q"].new_zeros(2, 4, 32)}, "head_dim"),
    "table rows": (lambda a: {"block_tables": a["block_tables"][:1]}, "block_tables has 1 rows"),
    "table dtype": (lambda a: {"block_tables": a["block_tables"].long()}, "block_tables must"),
    "seq_lens len": (lambda a: {"seq_lens": a["seq_lens"][:1]}, "seq_lens has 1 entries"),
    "seq_lens dtype": (lambda a: {"seq_lens": a["seq_lens"].long()}, "seq_lens must have"),
    "out shape": (lambda a: {"out": a["q"][:1]}, "out shape"),
    "out dtype": (lambda a: {"out": a["q"].half()}, "out must have dtype"),
    "block size": (lambda a: _both_caches(a["k_cache"].new_zeros(1, 512, 2, 64)), "block_size"),
    "splits": (lambda a: {"num_kv_splits": 0}, "num_kv_splits"),
    "window type": (lambda a: {"sliding_window": 2.5}, "sliding_window must be an int"),
    "device": (lambda a: {"seq_lens": a["seq_lens"].to("meta")}, "one device"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_input_raises_value_error(device, name):
    args = _good_args(device)
    overrides, message = BAD_INPUTS[name]
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**(args | overrides(args)))
