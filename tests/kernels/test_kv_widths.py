"""K and V of different head sizes in one paged pool (MLA), in every kernel.

The pool's two MLA layouts (``worker/engine/kv/pool.py``): per-head keys and values side
by side in one row (keys 24 wide, values 12), and the latent cache (one head whose 28
values are a latent vector of 20 and a rope key of 8, with V its first 20 columns). The
reference is checked against the dense formula, and the Triton store, decode and prefill
kernels against the reference (the latent layout through their split path: the latent
columns read once as keys and values, the rope columns beside), over a shuffled block
table with trash in the free slots.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels._attention_core import latent_pe_dim
from kernels.decode_attention import paged_decode_attention
from kernels.prefill_attention import paged_prefill_attention
from kernels.store_kv import store_kv
from tests.kernels.conftest import TRASH
from worker.engine.kv.pool import PoolLayout

BLOCK = 8
SEQ_LENS = [21, 9, 40]
Q_LENS = [21, 4, 11]  # a fresh prompt, then chunks over a cached prefix
LAYOUTS = {"split": PoolLayout(1, 2, 24, 12), "latent": PoolLayout(1, 1, 28, 20, v_in_k=True)}


def _context(layout: PoolLayout, device: torch.device, triton_store: bool):  # type: ignore[no-untyped-def]
    """(k_cache, v_cache, block_tables, seq_lens, keys, values) with every token stored."""
    gen = torch.Generator().manual_seed(0)
    blocks = [-(-n // BLOCK) for n in SEQ_LENS]
    num_blocks = sum(blocks) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    pool, caches = layout.allocate(num_blocks, BLOCK, torch.float32, device)
    pool.fill_(TRASH)
    k_cache, v_cache = caches[0]
    tables = torch.full((len(SEQ_LENS), max(blocks)), int(perm[-1]), dtype=torch.int32)
    slots, used = [], 0
    for i, (n, nb) in enumerate(zip(SEQ_LENS, blocks, strict=True)):
        tables[i, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
        pos = torch.arange(n)
        slots.append(tables[i, pos // BLOCK].long() * BLOCK + pos % BLOCK)
    total, heads = sum(SEQ_LENS), layout.num_kv_heads
    keys = torch.randn(total, heads, layout.k_dim, generator=gen).to(device)
    values = keys[..., :layout.v_dim] if layout.v_in_k else \
        torch.randn(total, heads, layout.v_dim, generator=gen).to(device)
    store = store_kv if triton_store else reference.store_kv
    store(keys, values, k_cache, v_cache, torch.cat(slots).to(device))
    lens = torch.tensor(SEQ_LENS, dtype=torch.int32, device=device)
    return k_cache, v_cache, tables.to(device), lens, keys, values


def _dense(q, k, v, scale):  # type: ignore[no-untyped-def]
    """q [Lq, Hq, Dk] the last Lq positions of k [L, Hkv, Dk], v [L, Hkv, Dv]."""
    q_len, hq, _ = q.shape
    ctx, hkv, _ = k.shape
    kk = k.repeat_interleave(hq // hkv, 1).transpose(0, 1)  # [Hq, L, Dk]
    vv = v.repeat_interleave(hq // hkv, 1).transpose(0, 1)  # [Hq, L, Dv]
    scores = q.transpose(0, 1) @ kk.transpose(1, 2) * scale  # [Hq, Lq, L]
    hidden = torch.arange(ctx).view(1, -1) > torch.arange(ctx - q_len, ctx).view(-1, 1)
    probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), -1)
    return (probs @ vv).transpose(0, 1)  # [Lq, Hq, Dv]


def _queries(layout: PoolLayout, device: torch.device, heads: int = 4) -> torch.Tensor:
    return torch.randn(sum(Q_LENS), heads, layout.k_dim,
                       generator=torch.Generator().manual_seed(5)).to(device)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_reference_equals_the_dense_formula(name):
    layout, cpu = LAYOUTS[name], torch.device("cpu")
    k_cache, v_cache, tables, lens, keys, values = _context(layout, cpu, False)
    q = _queries(layout, cpu)
    starts = torch.tensor([0, *torch.tensor(Q_LENS).cumsum(0).tolist()], dtype=torch.int32)
    got = reference.paged_prefill_attention(q, k_cache, v_cache, tables, starts, lens, 0.3)
    assert got.shape == (sum(Q_LENS), 4, layout.v_dim)
    first = 0
    for i, (n, ql) in enumerate(zip(SEQ_LENS, Q_LENS, strict=True)):
        lo = sum(SEQ_LENS[:i])
        want = _dense(q[first:first + ql], keys[lo:lo + n], values[lo:lo + n], 0.3)
        torch.testing.assert_close(got[first:first + ql], want, atol=1e-5, rtol=1e-5)
        first += ql


@pytest.mark.parametrize(("name", "heads"), [("split", 4), ("latent", 4), ("latent", 40)])
def test_triton_kernels_equal_the_reference(name, heads, device, close):
    """40 query heads over the latent cache's one: more than one program per KV head
    (``LATENT_ROWS`` heads each), the last one part empty."""
    layout = LAYOUTS[name]
    k_cache, v_cache, tables, lens, _, _ = _context(layout, device, True)
    k_ref, v_ref, *_ = _context(layout, device, False)
    # the latent layout takes the kernels' split path: latent tile read once as K and V
    assert latent_pe_dim(k_cache, v_cache) == (8 if layout.v_in_k else 0)
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0)  # the Triton store
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0)
    q = _queries(layout, device, heads)
    starts = torch.tensor([0, *torch.tensor(Q_LENS).cumsum(0).tolist()], dtype=torch.int32,
                          device=device)
    want = reference.paged_prefill_attention(q, k_cache, v_cache, tables, starts, lens, 0.3)
    got = paged_prefill_attention(q, k_cache, v_cache, tables, starts, lens, 0.3,
                                  max_query_len=max(Q_LENS))
    close(got, want)
    last = q[starts[1:].long() - 1]  # [S, Hq, Dk] each sequence's last token
    want = reference.paged_decode_attention(last, k_cache, v_cache, tables, lens, 0.3)
    for splits in (1, 3):
        got = paged_decode_attention(last, k_cache, v_cache, tables, lens, 0.3,
                                     num_kv_splits=splits)
        assert got.shape == (len(SEQ_LENS), heads, layout.v_dim)
        close(got, want)


def test_absorbed_latent_attention_equals_expanded_mla():
    """MLA's weight absorption over the latent layout: scores of ``[q_nope W_UK, q_pe]``
    over ``[c, k_pe]`` and the output times ``W_UV`` are the expanded per-head attention
    (keys ``[W_UK c, k_pe]``, values ``W_UV c``), through the paged reference."""
    gen = torch.Generator().manual_seed(11)
    heads, nope, rope, rank, v_dim, scale = 4, 16, 8, 20, 12, 0.2
    layout = LAYOUTS["latent"]
    cpu = torch.device("cpu")
    k_cache, v_cache, tables, lens, keys, _ = _context(layout, cpu, False)
    latent, k_pe = keys[:, 0, :rank], keys[:, 0, rank:]  # [N, L], [N, R]
    w_uk = torch.randn(heads, nope, rank, generator=gen) / rank ** 0.5
    w_uv = torch.randn(heads, rank, v_dim, generator=gen) / rank ** 0.5
    q = torch.randn(sum(Q_LENS), heads, nope + rope, generator=gen)
    q_abs = torch.cat([torch.einsum("thn,hnl->thl", q[..., :nope], w_uk), q[..., nope:]], -1)
    starts = torch.tensor([0, *torch.tensor(Q_LENS).cumsum(0).tolist()], dtype=torch.int32)
    out = reference.paged_prefill_attention(q_abs, k_cache, v_cache, tables, starts, lens,
                                            scale)  # [T, H, L]
    got = torch.einsum("thl,hlv->thv", out, w_uv)
    first = 0
    for i, (n, ql) in enumerate(zip(SEQ_LENS, Q_LENS, strict=True)):
        lo = sum(SEQ_LENS[:i])
        c, pe = latent[lo:lo + n], k_pe[lo:lo + n]
        k_full = torch.cat([torch.einsum("hnl,sl->shn", w_uk, c),
                            pe[:, None].expand(n, heads, rope)], -1)  # [L, H, nope + R]
        v_full = torch.einsum("hlv,sl->shv", w_uv, c)  # [L, H, v]
        want = _dense(q[first:first + ql], k_full, v_full, scale)
        torch.testing.assert_close(got[first:first + ql], want, atol=1e-5, rtol=1e-5)
        first += ql
