"""Per-layer attention features that reach Ferry's attention function by another road
than its keyword arguments, found once at load and set on the attention modules.

* **Chunked local attention** (Llama 4): transformers builds a chunked *mask* for the
  layers whose ``config.layer_types`` entry is ``chunked_attention``; Ferry builds no
  masks, so those modules carry their chunk size (``ferry_chunk``) and the kernels mask.
* **NoPE temperature tuning** (Llama 4): transformers scales the queries of its NoPE
  layers by ``log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1`` with positions it
  counts from the cache (an index into Ferry's flattened step, wrong once a step holds
  more than one sequence). The module's own scaling is switched off and the attention
  function applies it with the step's real positions (``ferry_temperature``).
"""

from __future__ import annotations

from typing import Any

import torch

CHUNK_ATTR = "ferry_chunk"
TEMPERATURE_ATTR = "ferry_temperature"


def text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def chunked_layers(config: Any) -> dict[int, int]:
    """{layer index: chunk size} of the layers that attend within local chunks."""
    cfg = text_config(config)
    chunk = getattr(cfg, "attention_chunk_size", None)
    types = getattr(cfg, "layer_types", None) or []
    if not chunk:
        return {}
    return {i: int(chunk) for i, kind in enumerate(types) if kind == "chunked_attention"}


def attention_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """{layer index: module} of the modules that call the attention function."""
    found: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and hasattr(module, "o_proj") and idx not in found:
            found[idx] = module
    return found


def prepare_layers(model: torch.nn.Module) -> None:
    """Set each attention module's chunk size and NoPE temperature (idempotent)."""
    chunks = chunked_layers(model.config)
    for idx, module in attention_modules(model).items():
        setattr(module, CHUNK_ATTR, chunks.get(idx))
        attn: Any = module
        if getattr(attn, "attn_temperature_tuning", False) and not getattr(
                attn, "use_rope", True):
            setattr(attn, TEMPERATURE_ATTR, (float(attn.floor_scale), float(attn.attn_scale)))
            attn.attn_temperature_tuning = False  # Ferry scales, with real positions


def temperature_scales(positions: torch.Tensor, floor_scale: float,
                       attn_scale: float) -> torch.Tensor:
    """[T] fp32 query scales of the NoPE layers at absolute ``positions`` [T]."""
    pos = positions.to(torch.float32)
    return torch.log1p(torch.floor((pos + 1.0) / floor_scale)) * attn_scale + 1.0


def model_body(model: Any) -> Any:
    """The decoder stack under the LM head (its forward returns hidden states). Most
    causal LMs name it ``base_model``; Llama 4's text model names itself."""
    body = model.base_model
    if body is model:
        body = getattr(model, "model", None)
    if body is None or body is model:
        raise ValueError(f"{type(model).__name__}: no decoder body under its LM head")
    return body
