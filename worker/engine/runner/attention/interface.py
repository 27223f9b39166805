"""Paged attention behind transformers' ``AttentionInterface``.

The model runner loads any transformers architecture with
``attn_implementation="ferry_paged"``; its attention layers then call
:func:`ferry_paged_attention` with the step's :class:`ForwardContext` passed explicitly
as a forward keyword argument (no globals). The batch is one flattened ragged sequence
(``[1, num_tokens]``): the decodes first, then the prefill chunks.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kernels import cpu_decode_attention
from worker.engine.health import EngineHealth
from worker.engine.runner.attention import torch_backends as attention_torch
from worker.engine.runner.attention.kv_scales import scale_qkv
from worker.engine.runner.attention.layer_features import (
    CHUNK_ATTR,
    TEMPERATURE_ATTR,
    temperature_scales,
)
from worker.engine.runner.attention.metadata import AttentionBackend, ForwardContext

ATTENTION_NAME = "ferry_paged"
# Keyword arguments transformers' layers pass along that carry nothing attention needs
# (bookkeeping for other parts of the forward). Any other keyword with a value is a
# feature Ferry does not implement, and the call is refused (``check_kwargs``).
IGNORED_KWARGS = frozenset({"ferry_ctx", "position_ids", "use_cache", "output_attentions",
                            "output_router_logits", "cache_position", "position_embeddings"})


class UnsupportedAttention(ValueError):
    """A layer asked the attention function for a feature Ferry does not implement."""


def check_kwargs(module: torch.nn.Module, attention_mask: torch.Tensor | None,
                 kwargs: dict[str, Any]) -> None:
    """Refuse a mask tensor (Ferry's masks are causal, windowed or chunked, built from
    the metadata) and keyword arguments it would silently drop."""
    where = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    if attention_mask is not None:
        raise UnsupportedAttention(f"{where} passes an attention mask tensor; Ferry builds "
                                   "its own causal masks")
    if kwargs.get("is_causal") is False:
        raise UnsupportedAttention(f"{where} asks for non-causal (bidirectional) attention")
    unknown = sorted(k for k, v in kwargs.items() if k not in IGNORED_KWARGS
                     and k != "is_causal" and v is not None and v is not False)
    if unknown:
        raise UnsupportedAttention(f"{where} passes attention keyword arguments Ferry does "
                                   f"not implement: {', '.join(unknown)}")


def make_backend(
    name: str, device: torch.device, health: EngineHealth | None = None
) -> AttentionBackend:
    """``auto`` is Triton on CUDA; on CPU the C++ decode kernel (``cpu``) when it builds
    here, else pure ``torch`` (a degraded worker: decode is several times slower)."""
    if name == "auto" and device.type == "cuda":
        name = "triton"
    elif name == "auto":
        reason = cpu_decode_attention.unavailable_reason()
        if reason is not None:
            (health or EngineHealth()).degrade("cpu_attention_fallback", reason,
                                               fallback="torch")
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
        if device.type != "cuda" and not triton_interpreting():
            raise ValueError(
                f"attention_backend 'triton' runs on a CUDA device, not on {device}; on the "
                "CPU use 'cpu' or 'torch' (or set TRITON_INTERPRET=1 to run the Triton "
                "kernels in Triton's slow interpreter, as the tests do)")
        try:
            from worker.engine.runner.attention.triton_backend import TritonAttentionBackend
        except ImportError as exc:  # the CPU image leaves triton out
            raise ValueError(
                f"attention_backend 'triton' needs the triton package ({exc}); torch's CUDA "
                "wheels bring it, or install ferry[gpu]") from exc
        return TritonAttentionBackend()
    raise ValueError(f"attention_backend must be auto, cpu, torch or triton, not {name!r}")


def triton_interpreting() -> bool:
    """Whether Triton kernels run in its interpreter (on the CPU) in this process."""
    return os.environ.get("TRITON_INTERPRET", "").strip() not in ("", "0")


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
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The function transformers calls in every attention layer; returns [1, T, Hq, D].
    ``s_aux``: gpt-oss's attention sinks, one logit per query head. The module may carry
    a chunk size and a NoPE temperature (``layer_features.prepare_layers``)."""
    ctx: ForwardContext | None = kwargs.get("ferry_ctx")
    if ctx is None:
        raise RuntimeError("ferry_paged attention called without a ForwardContext")
    if attention_mask is not None or not IGNORED_KWARGS.issuperset(kwargs):
        check_kwargs(module, attention_mask, kwargs)
    if dropout:
        raise UnsupportedAttention(f"attention dropout {dropout} (a model in training mode)")
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    temperature = getattr(module, TEMPERATURE_ATTR, None)
    if temperature is not None:
        if ctx.positions is None:
            raise RuntimeError("a layer scales queries by position, and the step has none")
        scales = temperature_scales(ctx.positions, *temperature).view(1, 1, -1, 1)
        query = (query * scales).to(query.dtype)  # [1, Hq, T, D]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    q, k, v, v_scale = scale_qkv(module, q, k, v)  # an FP8 cache's layer scales, if any
    out = ctx.backend.forward(
        q, k, v, ctx.kv_caches[layer], ctx.meta, scale, sliding_window, softcap,
        sinks=s_aux, chunk=getattr(module, CHUNK_ATTR, None),
    )
    if v_scale is not None:
        out = out * v_scale
    return out.unsqueeze(0), None


def register() -> None:
    """Make ``attn_implementation="ferry_paged"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, ferry_paged_attention)
