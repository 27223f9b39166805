"""The inner loop shared by the paged decode and prefill kernels.

Both kernels hold a ``[BLOCK_M, HEAD_DIM_PAD]`` tile of query rows that all belong to
one KV head (decode: the GQA group of one token; prefill: several tokens times the
group) and stream that head's keys/values from the paged cache in ``BLOCK_N``-token
tiles, keeping a flash-attention online softmax in fp32:

    s     = (q . k) * scale            (optionally cap * tanh(s / cap))
    (keys hidden by causality, a sliding window or a local-attention chunk: s = -inf)
    m'    = max(m, rowmax(s))
    l     = l * 2^(m - m') + rowsum(2^(s - m'))
    acc   = acc * 2^(m - m') + 2^(s - m') @ v

Scores are kept in the log2 domain (multiplied by log2(e)) so the GPU uses ``exp2``.
Each key token's address is looked up through the block table one token at a time
(``page = table[n // PAGE_SIZE]``), so a tile may span several pages or part of one:
any block size works and BLOCK_N is chosen for the hardware, not for the page size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def dot_needs_upcast(dtype: torch.dtype) -> bool:
    """True when bf16 tiles must be widened to fp32 before ``tl.dot``.

    The Triton interpreter stores bf16 as uint16 in numpy and its ``dot`` multiplies
    those raw integers. Widening bf16 to fp32 is exact and the products are exact in
    fp32 either way, so this only changes *how* the interpreter computes, not what.
    On a GPU the flag is off and bf16 goes to the tensor cores as is.
    """
    return bool(triton.knobs.runtime.interpret) and dtype == torch.bfloat16


def pow2_at_least(n: int, floor: int) -> int:
    """Next power of two >= max(n, floor): Triton block shapes must be powers of two."""
    return max(floor, triton.next_power_of_2(max(1, n)))


def latent_pe_dim(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """The rope columns after V in each key row when V is the start of K (MLA's latent
    cache: same memory, same strides, narrower), else 0."""
    if v_cache.data_ptr() == k_cache.data_ptr() and v_cache.stride() == k_cache.stride():
        return int(k_cache.shape[3] - v_cache.shape[3])
    return 0


def block_n(dims_pad: int) -> int:
    """Keys per tile for K and V rows of ``dims_pad`` padded values together: 64 up to
    the usual 2 x 128, fewer for wider rows (MLA's latent keys are 576 wide)."""
    return 64 if dims_pad <= 256 else 32 if dims_pad <= 512 else 16


@triton.jit
def _tanh(x):
    # tanh via exp: portable (interpreter and GPU) and saturates cleanly to +-1.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    # "ieee" only affects fp32 x fp32 (no TF32 truncation); fp16/bf16 ignore it.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def attend_kv_range(
    q,  # [BLOCK_M, HEAD_DIM_PAD] query rows, all of one KV head, in the cache dtype
    q_pe,  # PE_DIM > 0: [BLOCK_M, PE_PAD] the rows' rope columns (q is then [M, V_DIM_PAD])
    q_pos,  # [BLOCK_M] absolute position of each row (used when CAUSAL)
    kv_lo,  # first key position to visit
    kv_hi,  # one past the last key position to visit (<= context length)
    window,  # sliding window (used when SLIDING)
    chunk,  # local-attention chunk size (used when CHUNKED): keys of the row's own chunk
    k_cache_ptr,  # [num_blocks, PAGE_SIZE, num_kv_heads, HEAD_DIM]
    v_cache_ptr,  # [num_blocks, PAGE_SIZE, num_kv_heads, V_DIM], K's strides
    block_table_ptr,  # this sequence's row of the block table
    kv_head,
    stride_kb,
    stride_kt,
    stride_kh,
    scale,
    soft_cap,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    UPCAST: tl.constexpr,
    CHUNKED: tl.constexpr = False,
    V_DIM: tl.constexpr = 1,  # the values' head size (MLA's differs from the keys')
    V_DIM_PAD: tl.constexpr = 16,
    PE_DIM: tl.constexpr = 0,  # > 0: V is K's first V_DIM columns, followed by PE_DIM more
    PE_PAD: tl.constexpr = 16,
):
    """Online softmax over keys [kv_lo, kv_hi); returns (acc [M, Dv] fp32, l [M], m [M]).

    With ``PE_DIM`` (MLA's latent cache: a latent vector, then a rope key), each key row
    is read once as two tiles of their own padded widths, the latent one serving as the
    value too: no lane is spent on padding a 576-wide key to 1,024 and V is not reread."""
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask_d = offs_d < HEAD_DIM
    offs_dv = tl.arange(0, V_DIM_PAD)
    mask_dv = offs_dv < V_DIM
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, V_DIM_PAD], tl.float32)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)  # [N] key positions
        mask_n = offs_n < kv_hi
        page = tl.load(block_table_ptr + offs_n // PAGE_SIZE, mask=mask_n, other=0)
        kv_off = page.to(tl.int64) * stride_kb + (offs_n % PAGE_SIZE) * stride_kt
        kv_off += kv_head * stride_kh  # [N]
        if PE_DIM > 0:
            v_mask = mask_n[:, None] & mask_dv[None, :]
            v = tl.load(v_cache_ptr + kv_off[:, None] + offs_dv[None, :], mask=v_mask,
                        other=0.0).to(q.dtype)  # [N, Dv], the keys' latent columns too
            offs_pe = tl.arange(0, PE_PAD)
            pe_mask = mask_n[:, None] & (offs_pe < PE_DIM)[None, :]
            k_pe = tl.load(k_cache_ptr + kv_off[:, None] + V_DIM + offs_pe[None, :],
                           mask=pe_mask, other=0.0).to(q.dtype)  # [N, PE]
            s = (_dot(q, tl.trans(v), UPCAST) + _dot(q_pe, tl.trans(k_pe), UPCAST)) * scale
        else:
            tile_off = kv_off[:, None] + offs_d[None, :]  # [N, D]
            tile_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(k_cache_ptr + tile_off, mask=tile_mask, other=0.0).to(q.dtype)  # [N, D]
            if V_DIM == HEAD_DIM:  # the usual case: V's tile has K's offsets
                v = tl.load(v_cache_ptr + tile_off, mask=tile_mask, other=0.0).to(q.dtype)
            else:
                v_mask = mask_n[:, None] & mask_dv[None, :]
                v = tl.load(v_cache_ptr + kv_off[:, None] + offs_dv[None, :], mask=v_mask,
                            other=0.0).to(q.dtype)  # [N, Dv]; FP8: widen
            s = _dot(q, tl.trans(k), UPCAST) * scale  # [M, N] fp32
        if SOFT_CAP:
            s = soft_cap * _tanh(s / soft_cap)
        s = s * 1.4426950408889634  # natural -> log2 domain
        allowed = mask_n[None, :]  # [1, N]
        if CAUSAL:
            allowed = allowed & (offs_n[None, :] <= q_pos[:, None])
        if SLIDING:
            allowed = allowed & (offs_n[None, :] > q_pos[:, None] - window)
        if CHUNKED:
            allowed = allowed & (offs_n[None, :] >= (q_pos // chunk * chunk)[:, None])
        s = tl.where(allowed, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))  # [M]
        # A row that has seen no allowed key yet keeps m = -inf; shift by 0 instead
        # so that 2^(-inf - -inf) never produces NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)  # [M]
        p = tl.exp2(s - m_shift[:, None])  # [M, N]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def normalise_rows(acc, l_i, m_i, sink):
    """acc / l with an attention sink (``sink`` [M], log2 domain) joining each row's
    denominator: a logit with no value. Rows that saw no key (m = -inf) give 0."""
    top = tl.maximum(m_i, sink)  # finite: the sink is
    alpha = tl.exp2(m_i - top)  # 0 for a row with no key
    total = l_i * alpha + tl.exp2(sink - top)
    return acc * (alpha / total)[:, None]
