"""Load a Hugging Face checkpoint for paged serving, with clear errors up front.

Any architecture whose transformers implementation routes attention through
``AttentionInterface`` works: we load it with ``attn_implementation="ferry_paged"``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from worker.engine.config import ModelConfig
from worker.engine.distributed.sharding import kv_head_range
from worker.engine.distributed.tp_config import TPConfig
from worker.engine.runner import model_check, quant
from worker.engine.runner.attention import interface as attention
from worker.engine.runner.attention import mla
from worker.engine.runner.attention.layer_features import prepare_layers
from worker.engine.runner.cpu.gemv_calibration import set_gemv_rows
from worker.engine.runner.cpu.packed_linear import PackedLinear, pack_linears
from worker.engine.runner.cpu.step_threads import serial_tokens
from worker.engine.runner.moe import use_ferry_experts

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelShape:
    """What the KV cache and scheduler need to know about the model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int  # of the queries and keys the cache holds
    vocab_size: int
    max_model_len: int
    hidden_size: int = 0  # the width of the last hidden state (the LM head's input)
    v_head_dim: int = 0  # of the values, where it differs from head_dim (MLA); 0: head_dim
    # the values are the first v_head_dim columns of each key (MLA's latent cache): the
    # cache stores keys only
    v_in_k: bool = False

    @property
    def value_dim(self) -> int:
        return self.v_head_dim or self.head_dim


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel
    tokenizer: Any
    shape: ModelShape
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: frozenset[int]
    # CPU, packed weights: the rows each weight group leaves to F.linear (gemv_calibration)
    packed_gemv_rows: dict[str, int] = field(default_factory=dict)


def resolve_device(name: str) -> torch.device:
    """The device to load on; a CUDA device comes back with its index, made current.

    Made current once, here, because much follows the *current* device rather than a
    tensor's: Triton launches on it (with another device's pointers, on ``cuda:1`` that
    is a fault), and streams and events default to it. Every later CUDA call then names
    this index (``torch.cuda.current_stream(device)``).
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r} requested but there are only "
                         f"{torch.cuda.device_count()} CUDA devices")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


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


def load_model(cfg: ModelConfig, tp: TPConfig | None = None) -> LoadedModel:
    """``cfg``'s model on its device; with ``tp`` of size > 1, rank ``tp.rank``'s shards
    only (``distributed/sharded_load.py``), its shape naming this rank's KV heads."""
    tp = tp or TPConfig()
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
    model_check.check_config(hf_config, path)
    model_check.check_weights(path, path)
    scheme = quant.prepare(cfg.quantization, hf_config, path)  # refuses what is not served
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device, getattr(hf_config, "dtype", None))
    attention.register()
    try:
        if tp.enabled:  # a checkpoint's quantized layers cut here; at-load quant below
            model = _load_sharded(path, tp, dtype, scheme, device)
        else:
            with quant.loading(scheme):  # a quantized checkpoint's tensors: quant.apply's
                model = AutoModelForCausalLM.from_pretrained(
                    path, dtype=dtype, attn_implementation=attention.ATTENTION_NAME,
                    trust_remote_code=cfg.trust_remote_code,
                    **({"config": hf_config} if scheme is not None else {}),
                )
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except OSError as exc:
        raise ValueError(f"cannot load model weights or tokenizer from {path!r}: {exc}") from exc
    model = model.to(device).eval()  # type: ignore[arg-type]
    use_ferry_experts(model)  # MoE layers: fused kernel on CUDA, grouped path on CPU
    if scheme is not None:
        with torch.no_grad():
            if not tp.enabled:
                quant.apply(model, scheme, path)
            elif scheme.source == "load":  # each rank its shards, to one process's numbers
                from worker.engine.runner.quant.tp_head import apply_sharded

                apply_sharded(model, scheme, tp)
    prepare_layers(model)
    shape = model_shape(hf_config, cfg.max_model_len)
    if tp.enabled:
        kv = kv_head_range(shape.num_kv_heads, tp.rank, tp.size)
        shape = replace(shape, num_kv_heads=kv[1] - kv[0])
    if mla.is_mla(hf_config):  # latent: every rank caches the whole latent
        shape = mla.mla_shape(shape, hf_config, latent=cfg.mla_latent_cache, ranks=tp.size)
        if cfg.mla_latent_cache:
            mla.use_latent_attention(model)
    model_check.probe_attention(model, path, shape, device)
    gemv_rows: dict[str, int] = {}
    if device.type == "cpu" and cfg.pack_weights and pack_linears(model):
        packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
        gemv_rows = set_gemv_rows(packed, cfg.packed_gemv_rows, serial_tokens(model))
    return LoadedModel(model, tokenizer, shape, device, dtype, _eos_ids(model, tokenizer),
                       gemv_rows)


def _load_sharded(path: str, tp: TPConfig, dtype: torch.dtype,
                  scheme: quant.QuantScheme | None, device: torch.device) -> Any:
    """Rank ``tp.rank``'s shards; a quantized checkpoint's layers read from their cut of
    the packed tensors (``quant/tp_checkpoint.py``), never a whole layer."""
    from worker.engine.distributed.sharded_load import load_sharded

    if scheme is None or scheme.source == "load":
        return load_sharded(path, tp, dtype, attention.ATTENTION_NAME)
    from worker.engine.runner.quant.tp_checkpoint import (
        apply_checkpoint_sharded,
        quantized_owners,
    )

    owners = quantized_owners(path, tp.size)
    model = load_sharded(path, tp, dtype, attention.ATTENTION_NAME, keep_meta=owners)
    with torch.no_grad():
        apply_checkpoint_sharded(model, scheme, tp, path, owners, device)
    return model


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
        hidden_size=text_cfg.hidden_size,
    )


class LogitsHead:
    """The causal-LM head applied outside the model's forward: ``lm_head`` and the scaling
    some architectures put after it (Cohere's ``logit_scale``, Granite's
    ``logits_scaling``, Gemma's final soft cap).

    Why: a CUDA graph that returned logits would pin a ``[bucket, vocab]`` tensor per batch
    bucket in its pool (4.3 GB at 512 rows of a 128k vocabulary); the graphs keep only
    hidden states and the logits are computed here for the rows that sample. Each captured
    bucket is compared with the model's own forward after capture, so an architecture with
    another head transformation is caught there (and runs eagerly).
    """

    def __init__(self, model: Any) -> None:
        self.lm_head = model.get_output_embeddings()
        if self.lm_head is None:
            raise ValueError(f"{type(model).__name__} has no output embeddings (lm_head)")
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") \
            else model.config
        scale = getattr(model, "logit_scale", None)
        divisor = getattr(cfg, "logits_scaling", None)
        self.multiplier = (float(scale) if isinstance(scale, int | float) else 1.0) / \
            (float(divisor) if isinstance(divisor, int | float) and divisor else 1.0)
        cap = getattr(cfg, "final_logit_softcapping", None)
        self.soft_cap = float(cap) if isinstance(cap, int | float) and cap > 0 else None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, vocab]."""
        logits = self.lm_head(hidden)
        if self.multiplier != 1.0:
            logits = logits * self.multiplier
        if self.soft_cap is not None:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        return logits  # type: ignore[no-any-return]


def _eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for value in (getattr(gen, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)
