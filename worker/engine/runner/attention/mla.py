"""Multi-head latent attention (MLA: DeepSeek-V2/V3/R1, Kimi K2) in the paged cache.

MLA compresses each token's keys and values into one ``kv_lora_rank`` vector ``c``
(after ``kv_a_layernorm``) plus one rope key ``k_pe`` of ``qk_rope_head_dim`` shared by
every head; per head, ``k_nope = W_UK c`` and ``v = W_UV c`` (``kv_b_proj``). Two ways to
serve it:

* **Latent** (the default, ``mla_latent_cache=True``): the cache holds ``[c, k_pe]`` per
  token and layer, one "head" shared by every query head, and V is its first
  ``kv_lora_rank`` columns (``kv/pool.py``'s third layout). ``W_UK`` is folded into the
  query (``q_nope W_UK`` per head; its dot with ``c`` is exactly ``q_nope . k_nope``) and
  ``W_UV`` is applied after attention (attention is linear in V), as vLLM and SGLang do:
  what is left is an MQA over ``kv_lora_rank + qk_rope_head_dim`` wide keys, which every
  attention backend (Triton, torch, CPU) runs as it is. Prefill chunks take the same
  absorbed form. The module's forward is replaced by ``latent_forward``.
* **Expanded** (``mla_latent_cache=False``): transformers' own module expands K and V
  per head and calls the attention function; the cache holds keys of
  ``qk_nope + qk_rope`` and values of ``v_head_dim`` per head (the pool's second layout).
"""

from __future__ import annotations

import sys
import types
from dataclasses import replace
from typing import Any

import torch

from worker.engine.distributed.shard_model import HeadLinear
from worker.engine.runner.attention.interface import IGNORED_KWARGS, check_kwargs
from worker.engine.runner.attention.layer_features import attention_modules, text_config

# The MLA configs whose modules ``latent_forward`` reads (their attribute names and rope
# functions), proven against transformers in ``tests/worker/engine/test_families.py``;
# MLA in any other config is refused at load (``model_check.check_config``).
SERVED_MLA_CONFIGS = frozenset({"DeepseekV3Config"})
_PROJECTIONS = (torch.nn.Linear, HeadLinear)
W_UK_ATTR, W_UV_ATTR = "ferry_w_uk", "ferry_w_uv"


def is_mla(hf_config: Any) -> bool:
    cfg = text_config(hf_config)
    return bool(getattr(cfg, "kv_lora_rank", None) or getattr(cfg, "q_lora_rank", None))


def mla_shape(shape: Any, hf_config: Any, *, latent: bool, ranks: int = 1) -> Any:
    """The cache's shape for an MLA model (a ``ModelShape``): per token and layer, the
    latent vector and rope key (``latent``: one head, V inside K, whole on each of
    ``ranks`` tensor-parallel ranks), or the expanded per-head K and V (a rank's heads)."""
    cfg = text_config(hf_config)
    rope = int(cfg.qk_rope_head_dim)
    if latent:
        rank = int(cfg.kv_lora_rank)
        return replace(shape, num_kv_heads=1, head_dim=rank + rope, v_head_dim=rank,
                       v_in_k=True)
    return replace(shape, num_kv_heads=int(cfg.num_attention_heads) // ranks,
                   head_dim=int(cfg.qk_nope_head_dim) + rope, v_head_dim=int(cfg.v_head_dim))


def use_latent_attention(model: torch.nn.Module) -> int:
    """Give every MLA module the absorbed weights and ``latent_forward``; returns how many.
    ``kv_b_proj`` is split into ``W_UK`` and ``W_UV`` and dropped (no weight is held
    twice). Runs before the CPU packs the linear layers."""
    count = 0
    for module in attention_modules(model).values():
        attn: Any = module
        proj = getattr(attn, "kv_b_proj", None)  # whole, or a rank's heads under TP
        weight = getattr(proj, "weight", None) if isinstance(proj, _PROJECTIONS) else None
        if weight is None or not weight.is_floating_point() or weight.element_size() < 2:
            raise ValueError(f"{type(attn).__name__} (layer {attn.layer_idx}): the latent "
                             "MLA cache needs kv_b_proj as a 16/32-bit linear layer; load "
                             "the model unquantized or set mla_latent_cache=False")
        heads, nope, v_dim = attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim
        w = weight.detach().view(heads, nope + v_dim, attn.kv_lora_rank)  # [H, n+v, L]
        setattr(attn, W_UK_ATTR, w[:, :nope].contiguous())  # [H, nope, L]
        setattr(attn, W_UV_ATTR, w[:, nope:].transpose(1, 2).contiguous())  # [H, L, v]
        attn.kv_b_proj = None  # its two halves now live above, in the layouts bmm reads
        attn.forward = types.MethodType(latent_forward, attn)
        count += 1
    return count


def _rope(attn: Any, q_rot: torch.Tensor, k_rot: torch.Tensor,
          position_embeddings: tuple[torch.Tensor, torch.Tensor]
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's own rope (interleaved pairs or halves) on q [1, H, T, R], k [1, 1, T, R]."""
    family = sys.modules[type(attn).__module__]
    cos, sin = position_embeddings
    if attn.config.rope_interleave:
        return family.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)  # type: ignore[no-any-return]
    return family.apply_rotary_pos_emb(q_rot, k_rot, cos, sin)  # type: ignore[no-any-return]


def latent_forward(
    self: Any,
    hidden_states: torch.Tensor,  # [1, T, hidden]
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The MLA module's forward over the latent cache, weights absorbed; [1, T, hidden].
    Every token, prefill or decode, takes the absorbed form (one code path). For a long
    prefill chunk the expanded form needs fewer FLOPs (per query head and key, ``qk_nope
    + qk_rope + v`` against ``2 kv_lora_rank + qk_rope``), which is why vLLM expands there;
    decode, bound by reading the cache, is where the latent form wins."""
    ctx = kwargs.get("ferry_ctx")
    if ctx is None:
        raise RuntimeError("MLA attention called without a ForwardContext")
    kwargs.pop("cache", None)  # transformers' cache: Ferry's is in ctx
    if attention_mask is not None or not IGNORED_KWARGS.issuperset(kwargs):
        check_kwargs(self, attention_mask, kwargs)
    x = hidden_states[0]  # [T, hidden]
    t, heads, nope = x.shape[0], self.num_heads, self.qk_nope_head_dim
    rank = self.kv_lora_rank
    q = self.q_proj(x) if self.q_lora_rank is None else \
        self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
    q = q.view(t, heads, nope + self.qk_rope_head_dim)  # [T, H, nope + R]
    latent, k_rot = self.kv_a_proj_with_mqa(x).split([rank, self.qk_rope_head_dim], -1)
    latent = self.kv_a_layernorm(latent)  # [T, L]
    q_rot, k_rot = _rope(self, q[..., nope:].transpose(0, 1)[None], k_rot[None, None],
                         position_embeddings)  # [1, H, T, R], [1, 1, T, R]
    w_uk, w_uv = getattr(self, W_UK_ATTR), getattr(self, W_UV_ATTR)
    q_latent = torch.bmm(q[..., :nope].transpose(0, 1), w_uk)  # [H, T, L]
    query = torch.cat([q_latent, q_rot[0]], -1).transpose(0, 1)  # [T, H, L + R]
    key = torch.cat([latent, k_rot[0, 0]], -1)[:, None]  # [T, 1, L + R]
    out = ctx.backend.forward(query, key, key[..., :rank], ctx.kv_caches[self.layer_idx],
                              ctx.meta, self.scaling, None, None)  # [T, H, L]
    out = torch.bmm(out.transpose(0, 1), w_uv)  # [H, T, v]
    return self.o_proj(out.transpose(0, 1).reshape(1, t, heads * self.v_head_dim)), None
