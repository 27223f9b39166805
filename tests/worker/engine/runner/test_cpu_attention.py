"""The CPU decode path (gather + one SDPA) equals the reference on ragged, shuffled pages."""

import pytest
import torch

from kernels import reference
from kernels.cpu_attention import paged_decode_sdpa


@pytest.mark.parametrize("group,window", [(1, None), (4, None), (2, 7)])
def test_sdpa_decode_matches_reference(group, window):
    torch.manual_seed(0)
    bs, hkv, d, nblocks = 8, 2, 32, 40
    k_cache, v_cache = torch.randn(2, nblocks, bs, hkv, d).unbind(0)
    lens = torch.tensor([1, 9, 23, 16, 31], dtype=torch.int32)
    width = -(-int(lens.max()) // bs)
    tables = torch.stack([torch.randperm(nblocks)[:width] for _ in lens]).int()
    q = torch.randn(len(lens), hkv * group, d)
    want = reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.2,
                                            sliding_window=window)
    got = paged_decode_sdpa(q, k_cache, v_cache, tables, lens, 0.2, int(lens.max()), window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
