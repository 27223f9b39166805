"""The C++ CPU decode kernel against ``kernels.reference`` (shuffled pages, TRASH padding)."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_decode_attention, reference
from tests.kernels.conftest import build_paged_context

F32, BF16 = torch.float32, torch.bfloat16
CPU = torch.device("cpu")

# (num_kv_heads, group, head_dim, block_size, cache dtype, seq_lens)
CASES = [
    (2, 1, 64, 16, F32, [1, 17, 40]),
    (2, 4, 80, 8, F32, [5, 33, 16]),
    (1, 8, 96, 32, BF16, [70, 1]),
    (4, 2, 64, 16, BF16, [300, 2, 129]),
    (2, 4, 128, 1, F32, [9, 3]),
    (1, 2, 256, 16, F32, [50, 3]),
    # head dims the vectorised code takes (32, 64, 128): partial 8-key blocks, one-token
    # pages, bf16 pages
    (8, 1, 32, 16, F32, [200, 7, 33, 1]),
    (4, 2, 32, 8, BF16, [45, 9, 3]),
    (2, 1, 128, 16, F32, [37, 130]),
    (2, 2, 32, 1, F32, [11, 4]),
]


def _inputs(case, seed=0):
    hkv, group, head_dim, block_size, dtype, seq_lens = case
    ctx = build_paged_context(seq_lens, num_kv_heads=hkv, head_dim=head_dim,
                              block_size=block_size, dtype=dtype, device=CPU, seed=seed)
    q = torch.randn(len(seq_lens), hkv * group, head_dim,
                    generator=torch.Generator().manual_seed(seed))
    return ctx, q


def _both(ctx, q, **kwargs):
    args = (q, ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens, q.shape[-1] ** -0.5)
    return (cpu_decode_attention.paged_decode_attention(*args, **kwargs),
            reference.paged_decode_attention(*args, **kwargs))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"hkv{c[0]}-g{c[1]}-d{c[2]}-bs{c[3]}"
                         f"-{str(c[4])[6:]}-len{c[5]}")
def test_matches_reference(case):
    ctx, q = _inputs(case)
    got, want = _both(ctx, q)
    assert got.shape == q.shape and got.dtype == q.dtype
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("options", [{"sliding_window": 20}, {"logits_soft_cap": 2.0},
                                     {"sliding_window": 9, "logits_soft_cap": 5.0}],
                         ids=["window", "softcap", "both"])
def test_window_and_soft_cap(options):
    ctx, q = _inputs((2, 4, 64, 16, F32, [5, 64, 150]))
    got, want = _both(ctx, q * 3, **options)  # sharper scores so the cap matters
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [32, 80])
def test_a_row_is_the_same_alone_or_in_any_batch(head_dim):
    """A row's result depends on its own query, table and length only, bit for bit: a
    verification row's query token attends exactly as the decode it stands for."""
    ctx, _ = _inputs((4, 1, head_dim, 16, F32, [40, 3, 29]))
    seqs, lens = [0, 2, 2, 2, 1, 0], [40, 27, 28, 29, 3, 17]
    tables = ctx.block_tables[torch.tensor(seqs)]
    q = torch.randn(len(seqs), 4, head_dim, generator=torch.Generator().manual_seed(1))
    lens_t = torch.tensor(lens, dtype=torch.int32)
    got = cpu_decode_attention.paged_decode_attention(q, ctx.k_cache, ctx.v_cache, tables,
                                                      lens_t, 0.125)
    for r in range(len(seqs)):
        alone = cpu_decode_attention.paged_decode_attention(
            q[r:r + 1], ctx.k_cache, ctx.v_cache, tables[r:r + 1], lens_t[r:r + 1], 0.125)
        assert torch.equal(got[r:r + 1], alone), f"row {r}"


def test_low_precision_queries_and_out():
    ctx, q = _inputs((2, 2, 64, 16, F32, [20, 7]))
    q16 = q.to(torch.bfloat16)
    out = torch.empty_like(q16)
    got = cpu_decode_attention.paged_decode_attention(
        q16, ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens, 0.125, out=out)
    want = reference.paged_decode_attention(
        q16.float(), ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens, 0.125)
    assert got is out and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


def test_threads_do_not_change_the_result():
    ctx, q = _inputs((4, 2, 64, 16, F32, [300, 2, 129, 64, 90]))
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append(_both(ctx, q)[0])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1])  # one sequence never spans two threads


def test_a_strided_block_table_view():
    ctx, q = _inputs((2, 2, 64, 8, F32, [12, 30, 5]))
    wide = torch.zeros(3, ctx.block_tables.shape[1] + 5, dtype=torch.int32)
    wide[:, :ctx.block_tables.shape[1]] = ctx.block_tables
    view = wide[:, :ctx.block_tables.shape[1]]  # row stride != width
    got = cpu_decode_attention.paged_decode_attention(
        q, ctx.k_cache, ctx.v_cache, view, ctx.seq_lens, 0.125)
    want = reference.paged_decode_attention(
        q, ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens, 0.125)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _bad(ctx, query, **overrides):
    args = dict(q=query, k_cache=ctx.k_cache, v_cache=ctx.v_cache,
                block_tables=ctx.block_tables, seq_lens=ctx.seq_lens, scale=0.125)
    args.update(overrides)
    return cpu_decode_attention.paged_decode_attention(**args)


@pytest.mark.parametrize("change,match", [
    (lambda c, q: dict(seq_lens=c.seq_lens + 100), "longer than its block table row"),
    (lambda c, q: dict(seq_lens=c.seq_lens * 0), "seq_len is < 1"),
    (lambda c, q: dict(block_tables=c.block_tables + 1000), "not a block of the cache"),
    (lambda c, q: dict(block_tables=c.block_tables.long()), "block_tables must have dtype"),
    (lambda c, q: dict(q=q[:, :3]), "multiple of num_kv_heads"),
    (lambda c, q: dict(k_cache=c.k_cache.half(), v_cache=c.v_cache.half()), "k_cache must"),
    (lambda c, q: dict(v_cache=c.v_cache.to(BF16)), "k_cache and v_cache differ"),
    (lambda c, q: dict(k_cache=c.k_cache.transpose(1, 2).contiguous().transpose(1, 2)),
     "contiguous"),
    (lambda c, q: dict(seq_lens=c.seq_lens[:1]), "seq_lens has 1 entries"),
])
def test_bad_inputs_raise_before_reading_memory(change, match):
    ctx, q = _inputs((2, 2, 32, 8, F32, [12, 30]))
    with pytest.raises(ValueError, match=match):
        _bad(ctx, q, **change(ctx, q))


@pytest.mark.parametrize("change,match", [
    (lambda c: dict(block_tables=c.block_tables.long()), "block_tables must have dtype"),
    (lambda c: dict(seq_lens=c.seq_lens.long()), "seq_lens must have dtype"),
    (lambda c: dict(block_tables=c.block_tables[0]), "block_tables must be 2-D"),
    (lambda c: dict(block_tables=c.block_tables[:, :0]), "at least one column"),
    (lambda c: dict(seq_lens=c.seq_lens[:1]), "seq_lens has 1 entries"),
    (lambda c: dict(block_tables=c.block_tables.t().contiguous().t()), "contiguous"),
    (lambda c: dict(block_tables=c.block_tables.tolist()), "must be a torch.Tensor"),
])
def test_a_decode_call_names_bad_tables(change, match):
    """The step's call checks its tables in line; what fails gets ``_checks``' message."""
    ctx, _ = _inputs((2, 2, 32, 8, F32, [12, 30]))
    args = dict(block_tables=ctx.block_tables, seq_lens=ctx.seq_lens) | change(ctx)
    with pytest.raises(ValueError, match=match):
        cpu_decode_attention.DecodeCall(args["block_tables"], args["seq_lens"], 0.125)


def test_a_decode_call_equals_the_checked_kernel():
    ctx, q = _inputs((2, 2, 32, 8, F32, [12, 30, 1]))
    call = cpu_decode_attention.DecodeCall(ctx.block_tables, ctx.seq_lens, 0.125)
    want = cpu_decode_attention.paged_decode_attention(
        q, ctx.k_cache, ctx.v_cache, ctx.block_tables, ctx.seq_lens, 0.125)
    assert torch.equal(call(q, ctx.k_cache, ctx.v_cache), want)


def test_loading_the_kernel_keeps_subnormal_floats():
    """-ffast-math at link time would switch the whole process to flush-to-zero."""
    ctx, q = _inputs((1, 1, 32, 8, F32, [3]))
    _both(ctx, q)  # the library is loaded and has run
    tiny = torch.tensor([1e-39], dtype=torch.float32)
    assert float(tiny * 1.0) > 0.0
    assert 5e-324 * 1.0 > 0.0
