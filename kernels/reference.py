"""Pure-torch paged attention: the test oracle for the Triton kernels and Ferry's CPU path.

Cache layout (shared with the Triton kernels):
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset_in_block

A sequence's context is the tokens whose K/V sit in the blocks listed, in order, by its
row of ``block_tables``; ``seq_lens`` counts them (the current query tokens included, as
their K/V are stored before attention runs).

Everything here is written for clarity first, but with the batch dimension vectorised
where that is free: the CPU engine calls these functions on every layer of every step.
"""

from __future__ import annotations

import math

import torch


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int, negative = skip
) -> None:
    """Write each token's K/V into its slot; tokens with a negative slot are skipped."""
    num_kv_heads = k_cache.shape[2]
    flat_k = k_cache.view(-1, num_kv_heads, k_cache.shape[3])  # [num_slots, Hkv, Dk]
    flat_v = v_cache.view(-1, num_kv_heads, v_cache.shape[3])  # [num_slots, Hkv, Dv]
    slots = slot_mapping.to(torch.long)
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    if flat_k.dtype == FP8_E4M3:
        flat_k, key = flat_k.view(torch.uint8), to_fp8_bytes(key)
        flat_v, value = flat_v.view(torch.uint8), to_fp8_bytes(value)
    flat_k.index_copy_(0, slots, key.to(flat_k.dtype))
    flat_v.index_copy_(0, slots, value.to(flat_v.dtype))


FP8_E4M3 = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0  # e4m3 has no infinity: values past the largest finite one saturate


def to_fp8_bytes(x: torch.Tensor) -> torch.Tensor:
    """``x`` as FP8 e4m3 (unit scale, saturated) viewed as bytes: CPU ``index_copy_`` has no
    FP8 kernel, so an FP8 cache is written through its ``uint8`` view. NaN stays NaN."""
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_E4M3).view(torch.uint8)


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq]
    num_blocks: int,
) -> torch.Tensor:
    """Contiguous copy of the first ``num_blocks`` blocks of every sequence.

    Returns [num_seqs, num_blocks * block_size, Hkv, D].
    """
    table = block_tables[:, :num_blocks].to(torch.long)  # [S, nb]
    gathered = cache[table]  # [S, nb, block_size, Hkv, D]
    return gathered.flatten(1, 2)


def decode_key_mask(
    num_keys: int, seq_lens: torch.Tensor, sliding_window: int | None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """[S, num_keys] True where key position is visible to the sequence's last token
    (``chunk_size``: chunked local attention, only keys of the query's own chunk)."""
    pos = torch.arange(num_keys, device=seq_lens.device).view(1, -1)
    lens = seq_lens.to(torch.long).view(-1, 1)
    allowed = pos < lens
    if sliding_window is not None and sliding_window > 0:
        allowed &= pos >= lens - sliding_window
    if chunk_size is not None and chunk_size > 0:
        allowed &= pos >= (lens - 1) // chunk_size * chunk_size
    return allowed


def chunk_start(pos: torch.Tensor, chunk_size: int | None) -> torch.Tensor | None:
    """First position of each position's attention chunk (None without chunking)."""
    if chunk_size is None or chunk_size <= 0:
        return None
    return pos // chunk_size * chunk_size


def _softcap(scores: torch.Tensor, logits_soft_cap: float | None) -> torch.Tensor:
    if logits_soft_cap is None or logits_soft_cap <= 0:
        return scores
    return logits_soft_cap * torch.tanh(scores / logits_soft_cap)


def _attend(
    q: torch.Tensor,  # [S, Hkv, G, Lq, D] fp32
    k: torch.Tensor,  # [S, Hkv, Lk, D] fp32
    v: torch.Tensor,  # [S, Hkv, Lk, D] fp32
    allowed: torch.Tensor,  # [S, 1, 1, Lq, Lk] bool
    scale: float,
    logits_soft_cap: float | None,
    sinks: torch.Tensor | None = None,  # [Hq] logits that join every row's softmax
) -> torch.Tensor:
    """Masked softmax attention with fp32 accumulation; returns [S, Hkv, G, Lq, D].

    A sink (gpt-oss) is one more logit per head in the softmax's denominator with no
    value: it only takes probability mass away from the keys."""
    scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale  # [S, Hkv, G, Lq, Lk]
    scores = _softcap(scores, logits_soft_cap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        s, hkv, g, lq, _ = scores.shape
        sink = sinks.float().view(1, hkv, g, 1, 1).expand(s, hkv, g, lq, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        return torch.matmul(torch.nan_to_num(probs, nan=0.0), v.unsqueeze(2))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with no allowed key (never in valid input)
    return torch.matmul(probs, v.unsqueeze(2))


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length incl. the current token
    scale: float,
    *,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_q_heads] attention-sink logits
    chunk_size: int | None = None,  # chunked local attention
) -> torch.Tensor:
    """One query token per sequence attending to its whole paged context.

    All sequences are handled at once: their blocks are gathered into a padded
    [S, L, Hkv, D] tensor (L = longest context rounded up to a block) and masked.
    """
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    max_len = int(seq_lens.max().item()) if num_seqs else 0
    nb = max(1, math.ceil(max_len / block_size))
    k = gather_kv(k_cache, block_tables, nb).float().transpose(1, 2)  # [S, Hkv, L, D]
    v = gather_kv(v_cache, block_tables, nb).float().transpose(1, 2)
    qg = q.float().view(num_seqs, num_kv_heads, group, 1, head_dim)  # [S, Hkv, G, 1, D]
    allowed = decode_key_mask(nb * block_size, seq_lens, sliding_window, chunk_size)  # [S, L]
    # hidden keys and values zeroed, not only masked: a freed block's leftovers past a
    # row's length may hold another request's NaN, and 0·NaN is NaN
    k.masked_fill_(~allowed.view(num_seqs, 1, -1, 1), 0.0)
    v.masked_fill_(~allowed.view(num_seqs, 1, -1, 1), 0.0)
    res = _attend(qg, k, v, allowed.view(num_seqs, 1, 1, 1, -1), scale, logits_soft_cap, sinks)
    res = res.view(num_seqs, num_q_heads, v_cache.shape[3]).to(q.dtype)
    if out is not None:
        out.copy_(res)
        return out
    return res


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, offsets into q
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length incl. the new tokens
    scale: float,
    *,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_q_heads] attention-sink logits
    chunk_size: int | None = None,  # chunked local attention
) -> torch.Tensor:
    """Ragged query tokens, each sequence attending causally to its paged context.

    Sequence i owns q rows [query_start_loc[i], query_start_loc[i+1]); those are the
    last ``q_len`` positions of its ``seq_lens[i]``-token context, so query j sits at
    absolute position ``seq_len - q_len + j`` and sees keys at positions <= that
    (and > position - sliding_window when a window is set; with ``chunk_size``, only
    keys of its own chunk: ``k // chunk_size == position // chunk_size``).
    """
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    v_dim = v_cache.shape[3]  # the values' head size may differ from the keys' (MLA)
    result = out if out is not None else q.new_empty(*q.shape[:2], v_dim)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, ctx_len in enumerate(lens):
        q_lo, q_hi = starts[i], starts[i + 1]
        q_len = q_hi - q_lo
        if q_len == 0:
            continue
        nb = max(1, math.ceil(ctx_len / block_size))
        k = gather_kv(k_cache, block_tables[i : i + 1], nb)[0, :ctx_len]  # [L, Hkv, D]
        v = gather_kv(v_cache, block_tables[i : i + 1], nb)[0, :ctx_len]
        k = k.float().transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
        v = v.float().transpose(0, 1).unsqueeze(0)
        qi = q[q_lo:q_hi].float().view(q_len, num_kv_heads, group, head_dim)
        qi = qi.permute(1, 2, 0, 3).unsqueeze(0)  # [1, Hkv, G, Lq, D]
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device).view(-1, 1)
        k_pos = torch.arange(ctx_len, device=q.device).view(1, -1)
        allowed = k_pos <= q_pos  # [Lq, L]
        if sliding_window is not None and sliding_window > 0:
            allowed &= k_pos > q_pos - sliding_window
        first = chunk_start(q_pos, chunk_size)
        if first is not None:
            allowed &= k_pos >= first
        res = _attend(qi, k, v, allowed.view(1, 1, 1, q_len, ctx_len), scale, logits_soft_cap,
                      sinks)
        # [1, Hkv, G, Lq, D] -> [Lq, Hq, D]
        result[q_lo:q_hi] = res[0].permute(2, 0, 1, 3).reshape(q_len, num_q_heads, v_dim).to(
            result.dtype
        )
    return result


def moe_experts(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H] gate rows then up rows (FP8 with w13_scale)
    w2: torch.Tensor,  # [E, H, I]
    topk_ids: torch.Tensor,  # [T, K]
    topk_weights: torch.Tensor,  # [T, K]
    w13_scale: torch.Tensor | None = None,  # [E, 2I] fp32
    w2_scale: torch.Tensor | None = None,  # [E, H] fp32
) -> torch.Tensor:
    """Mixture of SiLU-gated experts, one expert at a time: the fused MoE kernel's oracle.

    FP8 weights are dequantized (``w * scale`` per output feature); the product runs in
    fp32, with the SiLU-and-multiply result rounded to ``hidden``'s dtype as the kernel
    stores it. Returns [T, H] in ``hidden``'s dtype.
    """
    w13f = w13.float() * (w13_scale[..., None] if w13_scale is not None else 1.0)
    w2f = w2.float() * (w2_scale[..., None] if w2_scale is not None else 1.0)
    x = hidden.float()
    out = torch.zeros_like(x)  # [T, H]
    for expert in range(w13.shape[0]):
        tok, choice = torch.where(topk_ids == expert)
        if tok.numel() == 0:
            continue
        gate, up = (x[tok] @ w13f[expert].T).chunk(2, dim=-1)  # [n, I] each
        act = (torch.nn.functional.silu(gate) * up).to(hidden.dtype).float()
        y = act @ w2f[expert].T * topk_weights[tok, choice, None].float()  # [n, H]
        out.index_add_(0, tok, y)
    return out.to(hidden.dtype)
