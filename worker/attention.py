"""Paged attention behind transformers' ``AttentionInterface``.

The model runner loads any transformers architecture with
``attn_implementation="ferry_paged"``; its attention layers then call
:func:`ferry_paged_attention` with the step's :class:`ForwardContext` passed explicitly
as a forward keyword argument (no globals). The batch is one flattened ragged sequence
(``[1, num_tokens]``): the decodes first, then the prefill chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from kernels import cpu_attention, reference

ATTENTION_NAME = "ferry_paged"
KVCache = tuple[torch.Tensor, torch.Tensor]  # k, v: [num_blocks, block_size, Hkv, D]


@dataclass
class AttentionMetadata:
    """Where every token of the step lives in the paged cache, built once per step."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context incl. this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    num_decodes: int  # sequences [0, num_decodes) have exactly one query token
    max_decode_seq_len: int  # longest context among the decodes (0 if none)
    # Decode rows split into (start, end, longest context) slices of similar length, so
    # the CPU path pads each slice only to its own longest sequence.
    decode_buckets: list[tuple[int, int, int]]
    max_query_len: int
    max_seq_len: int
    # True when no prefill sequence has cached context: attention then runs on the new
    # K/V directly (dense causal), with no read back from the paged cache.
    prefills_are_fresh: bool


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        soft_cap: float | None,
    ) -> torch.Tensor: ...  # [T, Hq, D]


@dataclass
class ForwardContext:
    """Everything the attention layers need for one forward pass."""

    meta: AttentionMetadata
    kv_caches: list[KVCache]  # one per layer
    backend: AttentionBackend


class TorchAttentionBackend:
    """CPU path: all decodes in one batched call, fresh prefills as dense causal SDPA.

    With ``compiled`` the decode runs ``kernels.cpu_attention``'s fused formulation under
    ``torch.compile`` (gather fused into the dot products); otherwise gather + SDPA.
    """

    name = "torch"

    def __init__(self, compiled: bool = False) -> None:
        self.compiled = compiled

    def forward(self, q, k, v, cache, meta, scale, sliding_window, soft_cap):  # type: ignore[no-untyped-def]
        k_cache, v_cache = cache
        reference.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale, sliding_window, soft_cap)
        if nd == meta.seq_lens.shape[0]:
            return out
        starts = meta.query_start_loc
        if meta.prefills_are_fresh and not soft_cap:
            _dense_causal(q, k, v, out, starts.tolist()[nd:], scale, sliding_window)
        else:
            out[starts[nd]:] = reference.paged_prefill_attention(
                q[starts[nd]:], k_cache, v_cache, meta.block_tables[nd:],
                starts[nd:] - starts[nd], meta.seq_lens[nd:], scale,
                sliding_window=sliding_window, logits_soft_cap=soft_cap,
            )
        return out

    def _decode(self, q, k_cache, v_cache, meta, scale, sliding_window, soft_cap):  # type: ignore[no-untyped-def]
        out = torch.empty_like(q)
        for lo, hi, max_len in meta.decode_buckets:
            tables, lens = meta.block_tables[lo:hi], meta.seq_lens[lo:hi]
            if self.compiled:
                out[lo:hi] = self._decode_compiled(
                    q[lo:hi], k_cache, v_cache, tables, lens, max_len, scale, sliding_window,
                    soft_cap,
                )
            elif soft_cap:
                out[lo:hi] = reference.paged_decode_attention(
                    q[lo:hi], k_cache, v_cache, tables, lens, scale,
                    sliding_window=sliding_window, logits_soft_cap=soft_cap,
                )
            else:
                out[lo:hi] = cpu_attention.paged_decode_sdpa(
                    q[lo:hi], k_cache, v_cache, tables, lens, scale, max_len, sliding_window
                )
        return out

    @staticmethod
    def _decode_compiled(q, k_cache, v_cache, tables, lens, max_len, scale, window, soft_cap):  # type: ignore[no-untyped-def]
        n = q.shape[0]
        tables = _pad_columns(tables, max(2, -(-max_len // k_cache.shape[1])))
        if n == 1:  # keep batch >= 2 so the compiled graph never specialises on 1
            q, tables, lens = q.expand(2, -1, -1), tables.expand(2, -1), lens.expand(2)
        # contiguous inputs: stride guards would otherwise trigger recompiles
        res = cpu_attention.compiled_paged_decode()(
            q.contiguous(), k_cache, v_cache, tables.contiguous(), lens.contiguous(),
            scale, window, soft_cap,
        )
        return res[:n]


def _pad_columns(tables: torch.Tensor, width: int) -> torch.Tensor:
    """First ``width`` columns of a block table, zero-padded (masked out by seq_lens)."""
    if tables.shape[1] >= width:
        return tables[:, :width]
    pad = tables.new_zeros(tables.shape[0], width - tables.shape[1])
    return torch.cat([tables, pad], dim=1)


def _dense_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    starts: list[int], scale: float, sliding_window: int | None,
) -> None:
    """Causal SDPA per sequence over its own new tokens (no cached prefix)."""
    for lo, hi in zip(starts[:-1], starts[1:], strict=True):
        qi, ki, vi = (t[lo:hi].transpose(0, 1) for t in (q, k, v))  # [H, L, D]
        mask = None
        if sliding_window is not None and sliding_window > 0:
            pos = torch.arange(hi - lo, device=q.device)
            diff = pos.view(-1, 1) - pos.view(1, -1)
            mask = (diff >= 0) & (diff < sliding_window)
        res = F.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=mask, is_causal=mask is None, scale=scale,
            enable_gqa=qi.shape[0] != ki.shape[0],
        )
        out[lo:hi] = res.transpose(0, 1)


class TritonAttentionBackend:
    """CUDA path: the Triton kernels (also runnable under ``TRITON_INTERPRET=1``)."""

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


def make_backend(
    name: str, device: torch.device, compile_attention: bool | None = None
) -> AttentionBackend:
    """``auto`` is Triton on CUDA, torch elsewhere; torch compiles its decode on CPU
    unless ``compile_attention`` is False."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        compiled = device.type == "cpu" if compile_attention is None else compile_attention
        return TorchAttentionBackend(compiled=compiled)
    if name == "triton":
        return TritonAttentionBackend()
    raise ValueError(f"attention_backend must be auto, torch or triton, not {name!r}")


def ferry_paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, Hq, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The function transformers calls in every attention layer; returns [1, T, Hq, D]."""
    ctx: ForwardContext | None = kwargs.get("ferry_ctx")
    if ctx is None:
        raise RuntimeError("ferry_paged attention called without a ForwardContext")
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    out = ctx.backend.forward(
        q, k, v, ctx.kv_caches[layer], ctx.meta, scale, sliding_window, softcap
    )
    return out.unsqueeze(0), None


def register() -> None:
    """Make ``attn_implementation="ferry_paged"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, ferry_paged_attention)
