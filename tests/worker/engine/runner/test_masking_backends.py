"""Attention sinks and chunked local attention through the CPU backends: the C++ kernel's
rows (decodes and short chunks over a prefix), SDPA and the prefix matmuls (chunks) and
the reference (sinks), each against ``kernels.reference`` over the whole step."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from tests.worker.engine.runner.test_short_chunk_attention import BLOCK, HKV, HQ, PAGES, D, _meta
from worker.engine.runner.attention.torch_backends import (
    CpuAttentionBackend,
    TorchAttentionBackend,
)


@pytest.mark.parametrize("backend", [TorchAttentionBackend, CpuAttentionBackend])
@pytest.mark.parametrize(("sinks", "chunk"), [(True, None), (False, 8), (True, 8)],
                         ids=["sinks", "chunk8", "sinks+chunk8"])
def test_backend_matches_reference(backend, sinks: bool, chunk: int | None) -> None:
    # a decode, a short chunk over a prefix (kernel rows), a fresh prompt, a long chunk
    ctx, q_lens = [27, 10, 21, 80], [1, 3, 21, 66]
    meta = _meta(ctx, q_lens, num_decodes=1)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(sum(q_lens), h, D, generator=g) for h in (HQ, HKV, HKV))
    cache = [torch.randn(5 * PAGES, BLOCK, HKV, D, generator=g) for _ in range(2)]
    sink = torch.randn(HQ, generator=g) if sinks else None
    got = backend().forward(q, k, v, cache, meta, 0.25, None, None, sinks=sink, chunk=chunk)
    # the cache now holds the step's K/V: the reference reads the same pages
    want = reference.paged_prefill_attention(
        q, cache[0], cache[1], meta.block_tables, meta.query_start_loc, meta.seq_lens, 0.25,
        sinks=sink, chunk_size=chunk)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
