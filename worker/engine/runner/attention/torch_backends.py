"""The CPU attention backends: the C++ decode kernel (``cpu``) and pure torch (``torch``).

Both store the step's K/V into the paged cache and run prefill chunks one sequence at a
time: one causal SDPA call over its new K/V when it has no cached prefix (a fresh prompt),
else two matmuls over its gathered context with a causal mask (``prefix_attention``: a
later chunk of a long prompt, a prefix-cache hit, a request resumed after preemption).
They differ only in the decode rows:

* ``cpu`` (the default on CPU): ``kernels/cpu_decode_attention.py`` reads each
  sequence's pages in place, exactly up to its length.
* ``torch`` (no compiler needed; the fallback): gather + one masked SDPA per bucket of
  length-sorted rows, each bucket padded only to its own longest sequence.

Soft caps and attention sinks, which SDPA has no argument for, run on the reference
(``kernels/reference.py``); chunked local attention is one more mask term everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kernels import cpu_attention, cpu_decode_attention, reference
from worker.engine.runner.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class Masking:
    """What one layer's attention hides or adds besides causality."""

    sliding_window: int | None = None
    soft_cap: float | None = None
    sinks: torch.Tensor | None = None  # [Hq]
    chunk: int | None = None

    @property
    def sdpa_unfit(self) -> bool:
        """SDPA has no soft cap and no sink: the reference computes those layers."""
        return bool(self.soft_cap) or self.sinks is not None

    def reference_kwargs(self) -> dict[str, Any]:
        return dict(sliding_window=self.sliding_window, logits_soft_cap=self.soft_cap,
                    sinks=self.sinks, chunk_size=self.chunk)


class TorchAttentionBackend:
    name = "torch"

    def forward(self, q, k, v, cache, meta, scale, sliding_window, soft_cap,  # type: ignore[no-untyped-def]
                sinks=None, chunk=None):
        mask = Masking(sliding_window, soft_cap, sinks, chunk)
        k_cache, v_cache = cache
        reference.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = q.new_empty(*q.shape[:2], v_cache.shape[-1])  # [T, Hq, Dv]
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale, mask)
        for i in range(nd, len(meta.seq_lens_host)):
            lo, hi = meta.query_start_host[i], meta.query_start_host[i + 1]
            out[lo:hi] = _prefill_one(q[lo:hi], k[lo:hi], v[lo:hi], k_cache, v_cache, meta, i,
                                      scale, mask)
        return out

    def _decode(self, q, k_cache, v_cache, meta, scale, mask):  # type: ignore[no-untyped-def]
        out = q.new_empty(*q.shape[:2], v_cache.shape[-1])  # [S, Hq, Dv]
        for lo, hi, max_len in meta.decode_buckets:
            tables, lens = meta.block_tables[lo:hi], meta.seq_lens[lo:hi]
            if mask.sdpa_unfit:
                out[lo:hi] = reference.paged_decode_attention(
                    q[lo:hi], k_cache, v_cache, tables, lens, scale, **mask.reference_kwargs())
            else:
                out[lo:hi] = cpu_attention.paged_decode_sdpa(
                    q[lo:hi], k_cache, v_cache, tables, lens, scale, max_len,
                    mask.sliding_window, chunk_size=mask.chunk,
                )
        return out


# A chunk over a cached prefix with at most this many query tokens (a speculative row's
# last token and its drafts, a short resumed chunk) runs as decode rows, one per token...
SHORT_QUERY = 65  # 1 + the most draft tokens (num_speculative_tokens <= 64)
# ... while its query tokens times its context stay under this. A kernel row reads the whole
# context for one token, so past some size the chunk's own matmuls (``prefix_attention``)
# attend faster; but a step whose every row is a decode or such a chunk also takes the lean
# decode path (``lean_decode.py``), several ms a step less than the modules' path, and one
# longer chunk (a 33-token verification over 125+ tokens) sends the whole step back.
# Measured with the vectorised kernel (default model, one thread, one layer): 33 tokens
# over 192 0.46 ms as rows, 0.50 as matmuls; over 256 0.77 vs 0.72; 65 over 256 1.34 vs
# 1.07; 33 over 400 1.16 vs 1.03: at most ~1.6 ms a step more for rows over 6 layers.
KERNEL_ROWS_MAX = 16384
# prefix_attention's fp32 scores ([Hq, Lq, L]) up to this many values; beyond, SDPA.
MATMUL_SCORES_MAX = 1 << 22


def short_chunks(meta: AttentionMetadata) -> tuple[list[int], list[int], list[int]]:
    """The chunks after the decodes that ``SHORT_QUERY`` covers, as one decode row per
    query token: (token index, sequence, context length up to and including the token).
    Query token j of a chunk of Lq over a context of L attends to the first L - Lq + 1 + j
    tokens: exactly causal attention, and what a plain decode of that token would read."""
    tokens: list[int] = []
    seqs: list[int] = []
    lens: list[int] = []
    starts, ctxs = meta.query_start_host, meta.seq_lens_host
    for i in range(meta.num_decodes, len(ctxs)):
        lo, hi = starts[i], starts[i + 1]
        if hi - lo > SHORT_QUERY or ctxs[i] <= hi - lo or (hi - lo) * ctxs[i] > KERNEL_ROWS_MAX:
            continue
        first = ctxs[i] - (hi - lo) + 1
        tokens.extend(range(lo, hi))
        seqs.extend([i] * (hi - lo))
        lens.extend(range(first, first + hi - lo))
    return tokens, seqs, lens


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def forward(self, q, k, v, cache, meta, scale, sliding_window, soft_cap,  # type: ignore[no-untyped-def]
                sinks=None, chunk=None):
        """As the torch backend, but short chunks over a cached prefix (verification rows
        of speculative decoding) join the decodes in one kernel call instead of one SDPA
        each (a per-sequence loop that costs more than the rows' arithmetic)."""
        k_cache, v_cache = cache
        tokens, seqs, lens = short_chunks(meta)
        if not tokens or soft_cap or not _native_fits(k_cache, v_cache):
            return super().forward(q, k, v, cache, meta, scale, sliding_window, soft_cap,
                                   sinks, chunk)
        mask = Masking(sliding_window, soft_cap, sinks, chunk)
        reference.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        rows = torch.tensor(list(range(nd)) + tokens, device=q.device)  # [R]
        tables = torch.cat([meta.block_tables[:nd],
                            meta.block_tables[torch.tensor(seqs, device=q.device)]])
        seq_lens = torch.cat([meta.seq_lens[:nd],
                              meta.seq_lens.new_tensor(lens)])  # [R]
        out[rows] = cpu_decode_attention.paged_decode_attention(
            q[rows], k_cache, v_cache, tables, seq_lens, scale, **mask.reference_kwargs())
        done = set(seqs)
        for i in range(nd, len(meta.seq_lens_host)):
            if i in done:
                continue
            lo, hi = meta.query_start_host[i], meta.query_start_host[i + 1]
            out[lo:hi] = _prefill_one(q[lo:hi], k[lo:hi], v[lo:hi], k_cache, v_cache, meta, i,
                                      scale, mask)
        return out

    def _decode(self, q, k_cache, v_cache, meta, scale, mask):  # type: ignore[no-untyped-def]
        if not _native_fits(k_cache, v_cache):  # a float16 cache, or K and V differ
            return super()._decode(q, k_cache, v_cache, meta, scale, mask)
        nd = meta.num_decodes
        return cpu_decode_attention.paged_decode_attention(
            q, k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
            **mask.reference_kwargs())


def _native_fits(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the C++ kernel reads this cache: its dtype, and K and V of one width."""
    return k_cache.dtype in cpu_decode_attention.CACHE_DTYPES and \
        k_cache.shape[-1] == v_cache.shape[-1]


def _prefill_one(
    q: torch.Tensor,  # [Lq, Hq, D] this sequence's new tokens
    k: torch.Tensor,  # [Lq, Hkv, D]
    v: torch.Tensor,  # [Lq, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    seq: int,
    scale: float,
    mask: Masking,
) -> torch.Tensor:
    """Attention for one sequence's prefill chunk; returns [Lq, Hq, D]."""
    ctx = meta.seq_lens_host[seq]
    if mask.sdpa_unfit:  # soft caps (Gemma 2), sinks (gpt-oss): the reference
        return reference.paged_prefill_attention(
            q, k_cache, v_cache, meta.block_tables[seq:seq + 1],
            meta.query_start_loc.new_tensor([0, q.shape[0]]), meta.seq_lens[seq:seq + 1],
            scale, **mask.reference_kwargs())
    if ctx > q.shape[0]:  # a cached prefix: attend to the whole context from the pages
        nb = -(-ctx // k_cache.shape[1])
        pages = meta.block_tables[seq, :nb].to(torch.long)  # [nb]
        # index_select of whole pages: a few times faster than advanced indexing
        k = k_cache.index_select(0, pages).flatten(0, 1)[:ctx].to(q.dtype)  # [L, Hkv, D]
        v = v_cache.index_select(0, pages).flatten(0, 1)[:ctx].to(q.dtype)
        if q.dtype == torch.float32 and q.shape[0] * q.shape[1] * ctx <= MATMUL_SCORES_MAX:
            return prefix_attention(q, k, v, scale, mask.sliding_window, mask.chunk)
    return causal_sdpa(q, k, v, scale, mask.sliding_window, mask.chunk)


def prefix_attention(
    q: torch.Tensor,  # [Lq, Hq, D], the last Lq positions of the context, float32
    k: torch.Tensor,  # [L, Hkv, D], the whole context
    v: torch.Tensor,  # [L, Hkv, D]
    scale: float,
    sliding_window: int | None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Causal attention of a chunk over a cached prefix as two batched matmuls and a
    masked softmax; [Lq, Hq, D]. Why not SDPA: with the explicit mask a chunk over a prefix
    needs, CPU SDPA took about twice as long (64 tokens over 288: ~1.0 against ~0.5 ms per
    layer, default model, one thread); this is the path of every prefix-cache hit, device
    or host tier. Queries are grouped per KV head, so K and V are read as they are (GQA)."""
    q_len, num_heads, dim = q.shape
    ctx, num_kv, v_dim = v.shape
    group = num_heads // num_kv
    qh = q.transpose(0, 1).reshape(num_kv, group * q_len, dim)  # [Hkv, G*Lq, D]
    scores = torch.bmm(qh, k.permute(1, 2, 0)).mul_(scale)  # [Hkv, G*Lq, L]
    q_pos = torch.arange(ctx - q_len, ctx, device=q.device).view(-1, 1)
    k_pos = torch.arange(ctx, device=q.device).view(1, -1)
    hidden = k_pos > q_pos  # [Lq, L]: the future
    if sliding_window is not None and sliding_window > 0:
        hidden |= k_pos <= q_pos - sliding_window
    if chunk:
        hidden |= k_pos < q_pos // chunk * chunk
    scores.view(num_kv, group, q_len, ctx).masked_fill_(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # every row keeps its own token: no empty row
    out = torch.bmm(probs, v.transpose(0, 1))  # [Hkv, G*Lq, Dv]
    return out.view(num_heads, q_len, v_dim).transpose(0, 1)


def causal_sdpa(
    q: torch.Tensor,  # [Lq, Hq, D], the last Lq positions of the context
    k: torch.Tensor,  # [L, Hkv, D], the whole context
    v: torch.Tensor,  # [L, Hkv, D]
    scale: float,
    sliding_window: int | None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Causal (optionally windowed or chunked) SDPA with queries aligned to the end;
    [Lq, Hq, D]."""
    q_len, ctx = q.shape[0], k.shape[0]
    mask = None
    windowed = sliding_window is not None and sliding_window > 0
    if q_len != ctx or windowed or chunk:  # SDPA's is_causal aligns queries to the start
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device).view(-1, 1)
        k_pos = torch.arange(ctx, device=q.device).view(1, -1)
        mask = k_pos <= q_pos
        if windowed:
            mask &= k_pos > q_pos - sliding_window  # type: ignore[operator]
        if chunk:
            mask &= k_pos >= q_pos // chunk * chunk  # type: ignore[operator]
    res = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
        is_causal=mask is None, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
    )  # [Hq, Lq, D]
    return res.transpose(0, 1)
