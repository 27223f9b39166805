"""Load a Hugging Face checkpoint for paged serving, with clear errors up front.

Any architecture whose transformers implementation routes attention through
``AttentionInterface`` works: we load it with ``attn_implementation="ferry_paged"``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from worker.engine import attention
from worker.engine.config import ModelConfig
from worker.engine.packed_linear import pack_linears

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelShape:
    """What the KV cache and scheduler need to know about the model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel
    tokenizer: Any
    shape: ModelShape
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: frozenset[int]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: Any) -> torch.dtype:
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"dtype must be auto, {', '.join(_DTYPES)}; got {name!r}")
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # CPU matmuls are fastest and exact in fp32
    if checkpoint_dtype in (torch.float16, torch.bfloat16):
        return checkpoint_dtype  # type: ignore[no-any-return]
    return torch.bfloat16


def load_model(cfg: ModelConfig) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # workers log structured lines, not progress bars
    path = cfg.model
    if os.path.sep in path and not os.path.exists(path):
        raise ValueError(f"model path {path!r} does not exist")
    try:
        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except Exception as exc:  # transformers raises OSError/ValueError/KeyError variants
        raise ValueError(f"cannot load model config from {path!r}: {exc}") from exc
    _check_servable(hf_config)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device, getattr(hf_config, "dtype", None))
    attention.register()
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=attention.ATTENTION_NAME,
            trust_remote_code=cfg.trust_remote_code,
        )
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except OSError as exc:
        raise ValueError(f"cannot load model weights or tokenizer from {path!r}: {exc}") from exc
    model = model.to(device).eval()  # type: ignore[arg-type]
    if device.type == "cpu" and cfg.pack_weights:
        pack_linears(model)
    shape = model_shape(hf_config, cfg.max_model_len)
    return LoadedModel(model, tokenizer, shape, device, dtype, _eos_ids(model, tokenizer))


def _check_servable(hf_config: Any) -> None:
    from transformers import AutoModelForCausalLM

    try:
        model_cls: Any = AutoModelForCausalLM._model_mapping[type(hf_config)]
    except KeyError as exc:
        raise ValueError(
            f"architecture {type(hf_config).__name__} has no causal-LM model in transformers"
        ) from exc
    if not getattr(model_cls, "_supports_attention_backend", False):
        raise ValueError(
            f"architecture {model_cls.__name__} cannot be served: its transformers "
            "implementation does not route attention through AttentionInterface"
        )


def model_shape(hf_config: Any, max_model_len: int | None) -> ModelShape:
    text_cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = text_cfg.num_attention_heads
    head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // heads
    limit = getattr(text_cfg, "max_position_embeddings", None) or 2048
    if max_model_len is not None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        limit = min(limit, max_model_len)
    return ModelShape(
        num_layers=text_cfg.num_hidden_layers,
        num_kv_heads=getattr(text_cfg, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab_size=text_cfg.vocab_size,
        max_model_len=limit,
    )


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for value in (getattr(gen, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)
