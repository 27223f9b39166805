"""Multi-head latent attention (MLA: DeepSeek-V2/V3/R1, Kimi K2) in the paged cache.

MLA compresses each token's keys and values into one ``kv_lora_rank`` vector ``c``
(after ``kv_a_layernorm``) plus one rope key ``k_pe`` of ``qk_rope_head_dim`` shared by
every head; per head, ``k_nope = W_UK c`` and ``v = W_UV c`` (``kv_b_proj``).
transformers' module expands K and V per head and calls the attention function; the
cache holds keys of ``qk_nope + qk_rope`` and values of ``v_head_dim`` per head
(``kv/pool.py``'s second layout).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from worker.engine.runner.attention.layer_features import text_config

# The MLA configs whose modules Ferry's latent forward reads (attribute names and rope
# layout checked by ``tests/worker/engine/test_families.py``); other MLA configs are refused.
SERVED_MLA_CONFIGS = frozenset({"DeepseekV3Config"})


def is_mla(hf_config: Any) -> bool:
    cfg = text_config(hf_config)
    return bool(getattr(cfg, "kv_lora_rank", None) or getattr(cfg, "q_lora_rank", None))


def mla_shape(shape: Any, hf_config: Any, *, latent: bool) -> Any:
    """The cache's shape for an MLA model (a ``ModelShape``): per token and layer, the
    latent vector and rope key (``latent``: one head, V inside K), or the expanded
    per-head K and V."""
    cfg = text_config(hf_config)
    rope = int(cfg.qk_rope_head_dim)
    if latent:
        rank = int(cfg.kv_lora_rank)
        return replace(shape, num_kv_heads=1, head_dim=rank + rope, v_head_dim=rank,
                       v_in_k=True)
    return replace(shape, num_kv_heads=int(cfg.num_attention_heads),
                   head_dim=int(cfg.qk_nope_head_dim) + rope, v_head_dim=int(cfg.v_head_dim))
