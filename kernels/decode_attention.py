"""Paged decode attention: one new query token per sequence, split-KV (flash-decoding).

Algorithm
    Stage 1 runs one program per (sequence, KV head, split). The program loads the
    queries of the whole GQA group of that KV head as one ``[GROUP_PAD, HEAD_DIM_PAD]``
    tile, so each K/V byte is read from HBM once per group rather than once per query
    head, and walks its share of the context in BLOCK_N-token tiles with an online
    softmax (``attend_kv_range``). The key range [max(0, len - window), len) is cut into
    ``num_splits`` chunks (rounded up to BLOCK_N) so that a small batch with a long
    context still spreads over every SM.
    Stage 2 (only when num_splits > 1) merges the splits of each (sequence, query
    head): with per-split output o_i and log-sum-exp lse_i (log2 domain),
    ``out = sum_i 2^(lse_i - M) o_i / sum_i 2^(lse_i - M)``, ``M = max_i lse_i``.
    With a single split, stage 1 normalises and writes the output directly.

How many splits: ``kernels/decode_splits.py``.
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
from kernels.decode_splits import choose_num_kv_splits, device_sms

MAX_FORCED_SPLITS = 1024  # callers may force more than the heuristic ever picks
# Query heads one program holds over MLA's latent cache (rows 512 + 64 wide at full size,
# every query head on one KV head): DeepSeek-V3's 128 heads in one tile spill ~17 KB per
# thread on sm_90; 16 rows spill none (``tests/kernels/test_compile_sm90.py``)
LATENT_ROWS = 16


_WORKSPACE: dict[torch.device, torch.Tensor] = {}


def _partials(q: torch.Tensor, splits: int, reuse: bool,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1's partial outputs [S, Hq, splits, Dv] and LSEs [S, Hq, splits], fp32: one
    reused buffer per device when launched eagerly (``reuse``: an allocation per call was
    part of the measured eager cost), fresh (from the graph's pool) for a CUDA graph."""
    num_seqs, num_q_heads = q.shape[:2]
    rows = num_seqs * num_q_heads * splits
    size = rows * (head_dim + 1)
    cached = _WORKSPACE.get(q.device) if reuse else None
    if cached is not None and cached.numel() >= size:
        flat = cached
    else:
        flat = q.new_empty(size, dtype=torch.float32)
        if reuse:
            _WORKSPACE[q.device] = flat
    dest = flat[: rows * head_dim].view(num_seqs, num_q_heads, splits, head_dim)
    lse = flat[rows * head_dim: rows * (head_dim + 1)].view(num_seqs, num_q_heads, splits)
    return dest, lse


# num_splits changes with the batch: left unspecialized (Triton would otherwise compile a
# variant for 1 and for multiples of 16), so WRITE_PARTIAL alone separates the variants.
@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(
    q_ptr,  # [S, Hq, D]
    k_cache_ptr,  # [num_blocks, PAGE_SIZE, Hkv, D]
    v_cache_ptr,  # [num_blocks, PAGE_SIZE, Hkv, Dv], K's strides
    block_tables_ptr,  # [S, max_blocks] int32
    seq_lens_ptr,  # [S] int32
    out_ptr,  # WRITE_PARTIAL: [S, Hq, num_splits, Dv] fp32; else [S, Hq, Dv]
    lse_ptr,  # WRITE_PARTIAL: [S, Hq, num_splits] fp32 (log2 domain); else unused
    sinks_ptr,  # HAS_SINKS: [Hq] fp32 attention-sink logits (added by stage 2 when split)
    scale,
    soft_cap,
    window,
    chunk,
    num_splits,
    stride_qs,
    stride_qh,
    stride_os,
    stride_oh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr,
    UPCAST: tl.constexpr,
    CHUNKED: tl.constexpr = False,
    HAS_SINKS: tl.constexpr = False,
    V_DIM: tl.constexpr = 1,
    V_DIM_PAD: tl.constexpr = 16,
    PE_DIM: tl.constexpr = 0,  # V inside K: the rope columns after it (attend_kv_range)
    PE_PAD: tl.constexpr = 16,
    HEAD_BLOCKS: tl.constexpr = 1,  # programs per KV head, GROUP_PAD query heads each
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    first_head = tl.program_id(1) % HEAD_BLOCKS * GROUP_PAD  # within the KV head's group
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_lo = 0
    if SLIDING:
        kv_lo = tl.maximum(seq_len - window, 0)
    if CHUNKED:  # the last token's own chunk only
        kv_lo = tl.maximum(kv_lo, (seq_len - 1) // chunk * chunk)
    per_split = tl.cdiv(tl.cdiv(seq_len - kv_lo, num_splits), BLOCK_N) * BLOCK_N
    lo = kv_lo + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    offs_g = first_head + tl.arange(0, GROUP_PAD)  # [G] within the group
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_v = tl.arange(0, V_DIM_PAD)
    heads = kv_head * GROUP + offs_g  # [G] query heads of this KV head
    mask_v = (offs_g < GROUP)[:, None] & (offs_v < V_DIM)[None, :]  # [G, Dv]
    q_row = q_ptr + seq * stride_qs + heads[:, None] * stride_qh  # [G, 1]
    if PE_DIM > 0:  # the latent columns, then the rope ones
        q = tl.load(q_row + offs_v[None, :], mask=mask_v, other=0.0)  # [G, Dv]
        offs_pe = tl.arange(0, PE_PAD)
        q_pe = tl.load(q_row + V_DIM + offs_pe[None, :],
                       mask=(offs_g < GROUP)[:, None] & (offs_pe < PE_DIM)[None, :], other=0.0)
    else:
        mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]  # [G, D]
        q = tl.load(q_row + offs_d[None, :], mask=mask, other=0.0)  # [G, D]
        q_pe = q

    acc, l_i, m_i = attend_kv_range(
        q, q_pe, lo, lo, hi, window, chunk, k_cache_ptr, v_cache_ptr,
        block_tables_ptr + seq * stride_bt, kv_head, stride_kb, stride_kt, stride_kh,
        scale, soft_cap,
        BLOCK_M=GROUP_PAD, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM_PAD,
        PAGE_SIZE=PAGE_SIZE, CAUSAL=False, SLIDING=False, SOFT_CAP=SOFT_CAP, UPCAST=UPCAST,
        V_DIM=V_DIM, V_DIM_PAD=V_DIM_PAD, PE_DIM=PE_DIM, PE_PAD=PE_PAD,
    )  # fmt: skip
    l_safe = tl.where(l_i > 0, l_i, 1.0)  # an empty split has l = 0 and acc = 0
    o = acc / l_safe[:, None]  # [G, Dv]
    if HAS_SINKS and not WRITE_PARTIAL:
        sink = tl.load(sinks_ptr + heads, mask=offs_g < GROUP, other=0.0).to(tl.float32)
        sink = sink * 1.4426950408889634  # log2 domain
        o = normalise_rows(acc, l_i, m_i, sink)
    if WRITE_PARTIAL:
        num_q_heads = tl.num_programs(1) // HEAD_BLOCKS * GROUP
        row = (seq * num_q_heads + heads) * num_splits + split  # [G]
        tl.store(out_ptr + row[:, None] * V_DIM + offs_v[None, :], o, mask=mask_v)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=offs_g < GROUP)
    else:
        o_off = seq * stride_os + heads[:, None] * stride_oh + offs_v[None, :]
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=mask_v)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    part_ptr,  # [S, Hq, num_splits, D] fp32, each split's normalised output
    lse_ptr,  # [S, Hq, num_splits] fp32, each split's log2-sum-exp (-inf if empty)
    out_ptr,  # [S, Hq, D]
    sinks_ptr,  # HAS_SINKS: [Hq] fp32 attention-sink logits
    num_splits,
    stride_os,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HAS_SINKS: tl.constexpr = False,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row0 = (seq * tl.num_programs(1) + head) * num_splits
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_s = offs_s < num_splits
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(lse_ptr + row0 + offs_s, mask=mask_s, other=float("-inf"))  # [P]
    m = tl.max(lse, 0)
    sink = float("-inf")
    if HAS_SINKS:  # one more term in the denominator, with no value
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m_shift = tl.where(m == float("-inf"), 0.0, m)
    weight = tl.exp2(lse - m_shift)  # [P], 0 for empty splits
    part_off = (row0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :]
    parts = tl.load(part_ptr + part_off, mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    total = tl.sum(weight, 0) + tl.exp2(sink - m_shift)
    o = tl.sum(weight[:, None] * parts, 0) / tl.where(total > 0, total, 1.0)  # [D]
    o_off = seq * stride_os + head * stride_oh + offs_d
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=mask_d)


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, v_head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length incl. the current token
    scale: float,
    *,
    out: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    max_seq_len: int | None = None,
    cuda_graph: bool = False,
    sinks: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Triton version of ``kernels.reference.paged_decode_attention`` (same semantics).

    ``num_kv_splits`` forces the split count (1 disables split-KV); ``max_seq_len`` is an
    optional upper bound on ``seq_lens`` that sharpens the split heuristic without a sync.
    ``cuda_graph``: the launch belongs to a CUDA graph (its capture, or the warm-up that
    must compile exactly what the capture launches): splits fill the SMs and the partial
    buffers are fresh allocations; otherwise the eager rule and a reused workspace.
    """
    q = chk.check_tensor("q", q, ndim=3, dtypes=chk.FLOAT_DTYPES)
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = chk.check_kv_cache(k_cache, v_cache, q.dtype)
    chk.check_heads(num_q_heads, num_kv_heads, head_dim, k_cache.shape[3])
    chk.check_block_tables(block_tables, seq_lens, num_seqs)
    out_shape = (num_seqs, num_q_heads, v_cache.shape[3])
    out = q.new_empty(out_shape) if out is None else chk.check_out(out, q, out_shape)
    chk.check_same_device(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
        seq_lens=seq_lens, out=out,
    )  # fmt: skip
    window = chk.window_arg(sliding_window)
    soft_cap = chk.soft_cap_arg(logits_soft_cap)
    chunk = chk.window_arg(chunk_size)
    sinks = chk.sinks_arg(sinks, num_q_heads, q.device)
    if num_kv_splits is None:
        context = max_seq_len or block_tables.shape[1] * block_size
        context = min(context, window) if window else context
        context = min(context, chunk) if chunk else context
        num_kv_splits = choose_num_kv_splits(num_seqs, num_kv_heads, context, device_sms(q.device),
                                             eager=not cuda_graph)
    if not (isinstance(num_kv_splits, int) and 1 <= num_kv_splits <= MAX_FORCED_SPLITS):
        raise ValueError(f"num_kv_splits must be an int in [1, {MAX_FORCED_SPLITS}], "
                         f"got {num_kv_splits!r}")  # fmt: skip
    if num_seqs > 0:
        _launch(q, k_cache, v_cache, block_tables, seq_lens, out, float(scale), window,
                soft_cap, num_kv_splits, reuse_workspace=not cuda_graph, chunk=chunk,
                sinks=sinks)  # fmt: skip
    return out


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    window: int,
    soft_cap: float,
    num_kv_splits: int,
    reuse_workspace: bool,
    chunk: int = 0,
    sinks: torch.Tensor | None = None,
) -> None:
    """Stage 1, then (with more than one split) the stage-2 merge, on validated inputs."""
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    head_dim_pad = pow2_at_least(head_dim, 16)
    v_dim = v_cache.shape[3]
    v_dim_pad = pow2_at_least(v_dim, 16)
    pe_dim = latent_pe_dim(k_cache, v_cache)
    pe_pad = pow2_at_least(pe_dim, 16)
    partial = num_kv_splits > 1
    if partial:
        dest, lse = _partials(q, num_kv_splits, reuse_workspace, v_dim)
    else:
        dest, lse = out, out  # lse is unused without splits
    group_pad = pow2_at_least(group, 16)
    rows = min(group_pad, LATENT_ROWS) if pe_dim else group_pad
    head_blocks = triton.cdiv(group, rows)
    _decode_split_kernel[(num_seqs, num_kv_heads * head_blocks, num_kv_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, dest, lse,
        q if sinks is None else sinks, scale, soft_cap, window, chunk, num_kv_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_PAD=rows, HEAD_BLOCKS=head_blocks,
        BLOCK_N=block_n(v_dim_pad + pe_pad if pe_dim else head_dim_pad + v_dim_pad),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, PAGE_SIZE=block_size,
        SLIDING=window > 0, SOFT_CAP=soft_cap > 0, WRITE_PARTIAL=partial,
        UPCAST=dot_needs_upcast(q.dtype), CHUNKED=chunk > 0, HAS_SINKS=sinks is not None,
        V_DIM=v_dim, V_DIM_PAD=v_dim_pad, PE_DIM=pe_dim, PE_PAD=pe_pad, num_warps=4,
    )  # fmt: skip
    if partial:
        _decode_reduce_kernel[(num_seqs, num_q_heads)](
            dest, lse, out, q if sinks is None else sinks, num_kv_splits,
            out.stride(0), out.stride(1), HEAD_DIM=v_dim, HEAD_DIM_PAD=v_dim_pad,
            SPLITS_PAD=pow2_at_least(num_kv_splits, 2), HAS_SINKS=sinks is not None,
            num_warps=4,
        )  # fmt: skip
