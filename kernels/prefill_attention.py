"""Paged prefill attention: ragged query chunks attending causally to paged contexts.

Serves chunked prefill and prefix reuse. Sequence i owns query rows
``query_start_loc[i]:query_start_loc[i+1]``; they are the last ``q_len`` positions of a
``seq_lens[i]``-token context whose K/V (cached prefix and the new tokens) already sit
in the paged cache. Query j of the chunk is at absolute position
``p = seq_len - q_len + j`` and sees keys k with ``k <= p`` (and ``k > p - window``).

Algorithm
    One program per (query tile, KV head). A query tile is BLOCK_Q consecutive tokens
    of one sequence; with the GQA group folded in, the program holds
    ``BLOCK_Q * GROUP_PAD`` query rows (token-major), so each K/V tile it loads is
    shared by the whole group. Keys are streamed from the paged cache in BLOCK_N
    tiles with the online softmax of ``attend_kv_range``, visiting only
    [first visible key, last query position]: the causal bound stops the loop early and
    the sliding window starts it late.

Grid without a host sync: the number of tiles a batch needs depends on every
sequence's query length, which lives on the device. Instead the grid has
``cdiv(num_tokens, BLOCK_Q) + num_seqs`` programs and sequence i owns tiles starting at
``query_start_loc[i] // BLOCK_Q + i`` (enough for its ``cdiv(q_len, BLOCK_Q)`` tiles);
each program binary-searches ``query_start_loc`` for its sequence, and surplus
programs exit at once. ``max_query_len``, when the caller knows it, only shrinks
BLOCK_Q for decode-like batches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _checks as chk
from kernels._attention_core import (
    attend_kv_range,
    block_n,
    dot_needs_upcast,
    latent_pe_dim,
    normalise_rows,
    pow2_at_least,
)

BLOCK_M_ROWS = 64  # query rows (tokens x group) per program; not yet tuned on a GPU
LATENT_ROWS = 16  # over MLA's latent cache (576-wide rows at full size): none spill on sm_90


def warmup_query_lens() -> list[int]:
    """Query lengths whose launches compile every query-tile size (BLOCK_Q) a step can
    pick: the tile follows the longest query by powers of two up to BLOCK_M_ROWS."""
    return [1 << i for i in range(BLOCK_M_ROWS.bit_length())]


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """Last sequence i whose first tile, query_start_loc[i] // BLOCK_Q + i, is <= tile."""
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        ok = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo


# The sequence count and the metadata pointers change from step to step without changing
# the code that helps: specializing them (num_seqs == 1 as a constant, 16-byte alignment of
# ``seq_lens[num_decodes:]``) only multiplied the variants compiled while serving.
@triton.jit(do_not_specialize=["num_seqs"],
            do_not_specialize_on_alignment=["block_tables_ptr", "query_start_loc_ptr",
                                            "seq_lens_ptr"])
def _prefill_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, PAGE_SIZE, Hkv, D]
    v_cache_ptr,  # [num_blocks, PAGE_SIZE, Hkv, Dv], K's strides
    out_ptr,  # [T, Hq, Dv]
    block_tables_ptr,  # [S, max_blocks] int32
    query_start_loc_ptr,  # [S + 1] int32
    seq_lens_ptr,  # [S] int32
    sinks_ptr,  # HAS_SINKS: [Hq] fp32 attention-sink logits
    scale,
    soft_cap,
    window,
    chunk,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    UPCAST: tl.constexpr,
    CHUNKED: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False,
    V_DIM: tl.constexpr = 1,
    V_DIM_PAD: tl.constexpr = 16,
    PE_DIM: tl.constexpr = 0,  # V inside K: the rope columns after it (attend_kv_range)
    PE_PAD: tl.constexpr = 16,
    HEAD_BLOCKS: tl.constexpr = 1,  # programs per KV head, GROUP_PAD query heads each
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    first_head = tl.program_id(1) % HEAD_BLOCKS * GROUP_PAD  # within the KV head's group
    seq = _find_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    row_start = q_start + (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if row_start >= q_end:
        return  # surplus program: this sequence has fewer tiles than it was given
    first_pos = tl.load(seq_lens_ptr + seq) - (q_end - q_start)  # position of row q_start

    offs_m = tl.arange(0, BLOCK_Q * GROUP_PAD)  # rows, token-major
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    tok = row_start + offs_m // GROUP_PAD  # [M] query token index into q
    in_group = first_head + offs_m % GROUP_PAD  # [M] query head within the group
    heads = kv_head * GROUP + in_group  # [M] query head
    rows = (tok < q_end) & (in_group < GROUP)  # [M]
    q_row = q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh  # [M, 1]
    offs_v = tl.arange(0, V_DIM_PAD)
    mask_v = rows[:, None] & (offs_v < V_DIM)[None, :]  # [M, Dv]
    if PE_DIM > 0:  # the latent columns, then the rope ones
        q = tl.load(q_row + offs_v[None, :], mask=mask_v, other=0.0)  # [M, Dv]
        offs_pe = tl.arange(0, PE_PAD)
        q_pe = tl.load(q_row + V_DIM + offs_pe[None, :],
                       mask=rows[:, None] & (offs_pe < PE_DIM)[None, :], other=0.0)
    else:
        q = tl.load(q_row + offs_d[None, :], mask=rows[:, None] & (offs_d < HEAD_DIM)[None, :],
                    other=0.0)  # [M, D]
        q_pe = q
    q_pos = first_pos + (tok - q_start)  # [M] absolute positions

    tile_first = first_pos + (row_start - q_start)  # position of the tile's first token
    kv_hi = tile_first + tl.minimum(BLOCK_Q, q_end - row_start)  # causal: past the last row
    kv_lo = 0
    if SLIDING:
        kv_lo = tl.maximum(tile_first - window + 1, 0)
    if CHUNKED:  # the chunk of the tile's first token; later rows mask further
        kv_lo = tl.maximum(kv_lo, tile_first // chunk * chunk)
    acc, l_i, m_i = attend_kv_range(
        q, q_pe, q_pos, kv_lo, kv_hi, window, chunk, k_cache_ptr, v_cache_ptr,
        block_tables_ptr + seq * stride_bt, kv_head, stride_kb, stride_kt, stride_kh,
        scale, soft_cap,
        BLOCK_M=BLOCK_Q * GROUP_PAD, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM,
        HEAD_DIM_PAD=HEAD_DIM_PAD, PAGE_SIZE=PAGE_SIZE, CAUSAL=True, SLIDING=SLIDING,
        SOFT_CAP=SOFT_CAP, UPCAST=UPCAST, CHUNKED=CHUNKED, V_DIM=V_DIM, V_DIM_PAD=V_DIM_PAD,
        PE_DIM=PE_DIM, PE_PAD=PE_PAD,
    )  # fmt: skip
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=in_group < GROUP, other=0.0).to(tl.float32)
        o = normalise_rows(acc, l_i, m_i, sink * 1.4426950408889634)  # [M, Dv]
    else:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # [M, Dv]
    o_off = tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_v[None, :]
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=mask_v)


def _check_prefill_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
) -> tuple[int, int]:
    """Validate shapes/dtypes/strides; return (block_size, num_kv_heads)."""
    chk.check_tensor("q", q, ndim=3, dtypes=chk.FLOAT_DTYPES)
    block_size, num_kv_heads = chk.check_kv_cache(k_cache, v_cache, q.dtype)
    chk.check_heads(q.shape[1], num_kv_heads, q.shape[2], k_cache.shape[3])
    chk.check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,))
    num_seqs = seq_lens.shape[0]
    chk.check_block_tables(block_tables, seq_lens, num_seqs)
    chk.check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=(torch.int32,))
    if query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start_loc must have num_seqs + 1 = {num_seqs + 1} entries, "
                         f"got {query_start_loc.shape[0]}")  # fmt: skip
    return block_size, num_kv_heads


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, v_head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, offsets into q
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length incl. the new tokens
    scale: float,
    *,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    max_query_len: int | None = None,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Triton version of ``kernels.reference.paged_prefill_attention`` (same semantics).

    Rows of ``q`` past ``query_start_loc[-1]`` (padding) are left untouched in ``out``.
    """
    block_size, num_kv_heads = _check_prefill_args(
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens
    )
    out_shape = (*q.shape[:2], v_cache.shape[3])  # [T, Hq, Dv]
    out = q.new_empty(out_shape) if out is None else chk.check_out(out, q, out_shape)
    chk.check_same_device(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
        query_start_loc=query_start_loc, seq_lens=seq_lens, out=out,
    )  # fmt: skip
    window = chk.window_arg(sliding_window)
    soft_cap = chk.soft_cap_arg(logits_soft_cap)
    chunk = chk.window_arg(chunk_size)
    num_tokens, num_q_heads, head_dim = q.shape
    sinks = chk.sinks_arg(sinks, num_q_heads, q.device)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_q_heads // num_kv_heads
    pe_dim = latent_pe_dim(k_cache, v_cache)
    group_pad = pow2_at_least(group, 1)
    rows = BLOCK_M_ROWS
    if pe_dim:  # MLA's latent rows: fewer query rows a program (decode_attention.LATENT_ROWS)
        rows = LATENT_ROWS
        group_pad = min(group_pad, rows)
    head_blocks = triton.cdiv(group, group_pad)
    block_q = max(1, rows // group_pad)
    if max_query_len is not None:  # decode-like batches: don't pad 1 token to 64 rows
        block_q = min(block_q, pow2_at_least(max_query_len, triton.cdiv(16, group_pad)))
    head_dim_pad = pow2_at_least(head_dim, 16)
    v_dim = v_cache.shape[3]
    v_dim_pad = pow2_at_least(v_dim, 16)
    pe_pad = pow2_at_least(pe_dim, 16)
    grid = (triton.cdiv(num_tokens, block_q) + num_seqs, num_kv_heads * head_blocks)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens,
        q if sinks is None else sinks, float(scale), soft_cap, window, chunk, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q,
        BLOCK_N=block_n(v_dim_pad + pe_pad if pe_dim else head_dim_pad + v_dim_pad),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, PAGE_SIZE=block_size,
        SLIDING=window > 0, SOFT_CAP=soft_cap > 0, UPCAST=dot_needs_upcast(q.dtype),
        CHUNKED=chunk > 0, HAS_SINKS=sinks is not None, V_DIM=v_dim, V_DIM_PAD=v_dim_pad,
        PE_DIM=pe_dim, PE_PAD=pe_pad, HEAD_BLOCKS=head_blocks, num_warps=4,
    )  # fmt: skip
    return out
