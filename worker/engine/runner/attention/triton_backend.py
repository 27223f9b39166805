"""The CUDA attention backend: Triton kernels (also runnable under ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

from kernels.decode_attention import paged_decode_attention
from kernels.prefill_attention import paged_prefill_attention
from kernels.store_kv import store_kv


class TritonAttentionBackend:
    """Store K/V, then one decode launch for the single-token rows and one prefill launch
    for the chunks (the rows are ordered decodes first)."""

    name = "triton"

    def forward(self, q, k, v, cache, meta, scale, sliding_window, soft_cap,  # type: ignore[no-untyped-def]
                sinks=None, chunk=None):
        k_cache, v_cache = cache
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = q.new_empty(*q.shape[:2], v_cache.shape[-1])  # [T, Hq, Dv]
        nd = meta.num_decodes  # decodes are one token each, so they are rows [0, nd)
        if nd:
            paged_decode_attention(
                q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                out=out[:nd], sliding_window=sliding_window, logits_soft_cap=soft_cap,
                max_seq_len=meta.max_decode_seq_len, cuda_graph=meta.cuda_graph,
                sinks=sinks, chunk_size=chunk,
            )
        if nd < meta.seq_lens.shape[0]:
            paged_prefill_attention(
                q[nd:], k_cache, v_cache, meta.block_tables[nd:],
                meta.query_start_loc[nd:] - nd, meta.seq_lens[nd:], scale, out=out[nd:],
                sliding_window=sliding_window, logits_soft_cap=soft_cap,
                max_query_len=meta.max_query_len, sinks=sinks, chunk_size=chunk,
            )
        return out
