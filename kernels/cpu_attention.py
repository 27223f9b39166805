"""Pure-torch paged decode attention for the CPU engine's ``torch`` backend.

The fallback where the C++ kernel (``kernels/cpu_decode_attention.py``) cannot be built:
gather every sequence's blocks, then one masked ``scaled_dot_product_attention`` call
over the batch. About 4x faster than the reference on CPU, 3-6x slower than the kernel.
Equal to ``kernels.reference.paged_decode_attention``. The keys and values a row may not
see are set to 0 in the gathered copy, not only masked: past a row's length lie a freed
block's leftovers (another request's, which may hold a NaN or an Inf), and a masked
score still multiplies its value by 0 (0·NaN is NaN).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.reference import decode_key_mask, gather_kv


def paged_decode_sdpa(
    q: torch.Tensor,  # [S, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32
    scale: float,
    max_seq_len: int,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Gather each sequence's blocks, then one masked SDPA over the batch; [S, Hq, D]."""
    num_seqs, num_q_heads, head_dim = q.shape
    block_size = k_cache.shape[1]
    nb = max(1, -(-max_seq_len // block_size))
    mask = decode_key_mask(nb * block_size, seq_lens, sliding_window, chunk_size)  # [S, L]
    hidden = (~mask).view(-1).nonzero().squeeze(1)  # flat [S*L] positions
    k = _zeroed(gather_kv(k_cache, block_tables, nb), hidden).transpose(1, 2)  # [S, Hkv, L, D]
    v = _zeroed(gather_kv(v_cache, block_tables, nb), hidden).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k.to(q.dtype), v.to(q.dtype), attn_mask=mask.view(num_seqs, 1, 1, -1),
        scale=scale, enable_gqa=k.shape[1] != num_q_heads,
    )  # [S, Hq, 1, D]
    return out.view(num_seqs, num_q_heads, v_cache.shape[3])  # [S, Hq, Dv]


def _zeroed(gathered: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """``gathered`` [S, L, Hkv, D] (a copy) with its ``hidden`` flat positions set to 0
    (module docstring); ``index_fill_`` is ~10x faster than a broadcast ``masked_fill_``."""
    flat = gathered.view(-1, gathered.shape[2] * gathered.shape[3])
    if flat.dtype == torch.float8_e4m3fn:  # no FP8 index_fill_ on CPU; byte 0 is +0.0
        flat = flat.view(torch.uint8)
    flat.index_fill_(0, hidden, 0)
    return gathered
