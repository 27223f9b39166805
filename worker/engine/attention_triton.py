"""The CUDA attention backend: Triton kernels (also runnable under ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import torch


class TritonAttentionBackend:
    """Store K/V, then one decode launch for the single-token rows and one prefill launch
    for the chunks (the rows are ordered decodes first)."""

    name = "triton"

    def __init__(self) -> None:
        import kernels

        self._k = kernels

    def forward(self, q, k, v, cache, meta, scale, sliding_window, soft_cap):  # type: ignore[no-untyped-def]
        k_cache, v_cache = cache
        self._k.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes  # decodes are one token each, so they are rows [0, nd)
        if nd:
            self._k.paged_decode_attention(
                q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                out=out[:nd], sliding_window=sliding_window, logits_soft_cap=soft_cap,
                max_seq_len=meta.max_decode_seq_len,
            )
        if nd < meta.seq_lens.shape[0]:
            self._k.paged_prefill_attention(
                q[nd:], k_cache, v_cache, meta.block_tables[nd:],
                meta.query_start_loc[nd:] - nd, meta.seq_lens[nd:], scale, out=out[nd:],
                sliding_window=sliding_window, logits_soft_cap=soft_cap,
                max_query_len=meta.max_query_len,
            )
        return out
