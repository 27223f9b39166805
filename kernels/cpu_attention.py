"""Fast pure-torch paged decode attention for the CPU engine path.

Paged decode on a CPU is bound by moving K/V: the eager reference first gathers every
sequence's blocks into a padded copy and then attends, touching the bytes twice. Two
faster formulations, both equal to ``kernels.reference.paged_decode_attention``:

* :func:`paged_decode_sdpa` — gather, then one masked ``scaled_dot_product_attention``
  call over the whole batch (eager; about 4x faster than the reference on CPU).
* :func:`paged_decode_fused` — written as broadcasted multiply-reduce so that
  ``torch.compile`` (Inductor's C++ backend) fuses the block gather into the dot
  products and never materialises the gathered copy (another ~2x on CPU). Run eagerly it
  would build a huge intermediate, so only ever call it compiled: see
  :func:`compiled_paged_decode`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

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
) -> torch.Tensor:
    """Gather each sequence's blocks, then one masked SDPA over the batch; [S, Hq, D]."""
    num_seqs, num_q_heads, head_dim = q.shape
    block_size = k_cache.shape[1]
    nb = max(1, -(-max_seq_len // block_size))
    k = gather_kv(k_cache, block_tables, nb).transpose(1, 2)  # [S, Hkv, L, D]
    v = gather_kv(v_cache, block_tables, nb).transpose(1, 2)
    mask = decode_key_mask(nb * block_size, seq_lens, sliding_window)  # [S, L]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k.to(q.dtype), v.to(q.dtype), attn_mask=mask.view(num_seqs, 1, 1, -1),
        scale=scale, enable_gqa=k.shape[1] != num_q_heads,
    )  # [S, Hq, 1, D]
    return out.view(num_seqs, num_q_heads, head_dim)


def paged_decode_fused(
    q: torch.Tensor,  # [S, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, nb] int32, exactly the blocks to read
    seq_lens: torch.Tensor,  # [S] int32
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Compile-only formulation (see module docstring); returns [S, Hq, D]."""
    num_seqs, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    nb = block_tables.shape[1]
    idx = block_tables.to(torch.long)
    k = k_cache[idx].view(num_seqs, nb * block_size, num_kv_heads, 1, head_dim)
    v = v_cache[idx].view(num_seqs, nb * block_size, num_kv_heads, 1, head_dim)
    qg = q.float().view(num_seqs, 1, num_kv_heads, group, head_dim)
    scores = (qg * k.float()).sum(-1) * scale  # [S, L, Hkv, G]
    if logits_soft_cap is not None and logits_soft_cap > 0:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    allowed = decode_key_mask(nb * block_size, seq_lens, sliding_window)
    scores = scores.masked_fill(~allowed.view(num_seqs, -1, 1, 1), float("-inf"))
    probs = torch.softmax(scores, dim=1).unsqueeze(-1)  # [S, L, Hkv, G, 1]
    out = (probs * v.float()).sum(1)  # [S, Hkv, G, D]
    return out.reshape(num_seqs, num_q_heads, head_dim).to(q.dtype)


@functools.cache
def compiled_paged_decode() -> Callable[..., torch.Tensor]:
    """``paged_decode_fused`` compiled once per process, with dynamic batch and length."""
    return torch.compile(paged_decode_fused, dynamic=True)  # type: ignore[return-value]
