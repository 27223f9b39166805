"""The CPU backend runs short chunks over a cached prefix (speculative verification rows)
as decode rows: the same attention as the torch backend's one SDPA per chunk."""

from __future__ import annotations

import pytest
import torch

from worker.engine.runner.attention.metadata import AttentionMetadata
from worker.engine.runner.attention.torch_backends import (
    KERNEL_ROWS_MAX,
    CpuAttentionBackend,
    TorchAttentionBackend,
    causal_sdpa,
    prefix_attention,
    short_chunks,
)

BLOCK, HQ, HKV, D = 4, 4, 2, 16
PAGES = 80  # blocks a sequence owns: contexts up to 320 tokens


def _meta(ctx: list[int], q_lens: list[int], num_decodes: int) -> AttentionMetadata:
    """Sequence i owns blocks [PAGES i, PAGES (i + 1)); its new tokens are its last q_lens[i]."""
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    tables = torch.tensor([[PAGES * i + b for b in range(PAGES)] for i in range(len(ctx))],
                          dtype=torch.int32)
    slots = [PAGES * i * BLOCK + p for i, (c, n) in enumerate(zip(ctx, q_lens, strict=True))
             for p in range(c - n, c)]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts,
                                                                       dtype=torch.int32),
        seq_lens=torch.tensor(ctx, dtype=torch.int32), block_tables=tables,
        num_decodes=num_decodes, max_decode_seq_len=max(ctx[:num_decodes], default=0),
        decode_buckets=[(0, num_decodes, max(ctx[:num_decodes]))] if num_decodes else [],
        max_query_len=max(q_lens), max_seq_len=max(ctx), query_start_host=starts,
        seq_lens_host=ctx)


def _backends_agree(meta: AttentionMetadata, tokens: int, window: int | None, seed: int) -> None:
    """The CPU backend's output equals the torch backend's on random q/k/v and cache."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(tokens, h, D, generator=g) for h in (HQ, HKV, HKV))
    cache = [torch.randn(5 * PAGES, BLOCK, HKV, D, generator=g) for _ in range(2)]
    want = TorchAttentionBackend().forward(q, k, v, [c.clone() for c in cache], meta, 0.25,
                                           window, None)
    got = CpuAttentionBackend().forward(q, k, v, [c.clone() for c in cache], meta, 0.25,
                                        window, None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 6])
def test_short_chunks_match_the_torch_backend(window: int | None) -> None:
    ctx, q_lens = [7, 10, 5, 30, 80], [1, 3, 5, 17, 66]  # decode, short, fresh, short, long
    meta = _meta(ctx, q_lens, num_decodes=1)
    tokens, seqs, lens = short_chunks(meta)
    assert seqs == [1] * 3 + [3] * 17 and lens[:3] == [8, 9, 10] and lens[-1] == 30
    assert tokens == list(range(1, 4)) + list(range(9, 26))
    _backends_agree(meta, sum(q_lens), window, seed=0)


@pytest.mark.parametrize(("q_len", "ctx", "heads", "window"),
                         [(64, 288, (8, 8), None), (17, 40, (4, 2), None), (30, 90, (6, 2), 20)])
def test_prefix_attention_matches_sdpa(q_len: int, ctx: int, heads: tuple[int, int],
                                       window: int | None) -> None:
    """The matmul path of a chunk over a cached prefix equals causal SDPA (GQA, window)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(q_len, heads[0], D, generator=g)
    k, v = (torch.randn(ctx, heads[1], D, generator=g) for _ in range(2))
    torch.testing.assert_close(prefix_attention(q, k, v, 0.3, window),
                               causal_sdpa(q, k, v, 0.3, window), atol=1e-5, rtol=1e-4)


def test_long_chunks_leave_the_kernel_rows() -> None:
    """A chunk whose tokens times its context pass KERNEL_ROWS_MAX runs as matmuls (one
    row per token would read the whole context for each), and both backends agree."""
    ctx, q_lens = [9, 300, 200], [1, 60, 40]  # decode, 18000 > max, 8000 <= max
    assert 60 * 300 > KERNEL_ROWS_MAX >= 40 * 200
    meta = _meta(ctx, q_lens, num_decodes=1)
    tokens, seqs, _ = short_chunks(meta)
    assert seqs == [2] * 40 and tokens == list(range(61, 101))
    _backends_agree(meta, sum(q_lens), None, seed=2)
