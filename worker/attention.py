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

import structlog
import torch

from kernels import cpu_decode_attention

_log = structlog.get_logger("ferry.worker.attention")
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
    # Host copies of query_start_loc and seq_lens, for backends that loop over
    # sequences on the host (reading the tensors would sync a GPU).
    query_start_host: list[int]
    seq_lens_host: list[int]


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


def make_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto`` is Triton on CUDA; on CPU the C++ decode kernel (``cpu``) when it builds
    here, else pure ``torch`` (with a warning: decode is several times slower)."""
    from worker import attention_torch

    if name == "auto" and device.type == "cuda":
        name = "triton"
    elif name == "auto":
        reason = cpu_decode_attention.unavailable_reason()
        if reason is not None:
            _log.warning("cpu_attention_kernel_unavailable", reason=reason, fallback="torch")
        name = "cpu" if reason is None else "torch"
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend 'cpu' runs on the CPU, not on {device}")
        reason = cpu_decode_attention.unavailable_reason()
        if reason is not None:
            raise ValueError(f"attention_backend 'cpu' is unavailable: {reason}")
        return attention_torch.CpuAttentionBackend()
    if name == "torch":
        return attention_torch.TorchAttentionBackend()
    if name == "triton":
        return TritonAttentionBackend()
    raise ValueError(f"attention_backend must be auto, cpu, torch or triton, not {name!r}")


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
