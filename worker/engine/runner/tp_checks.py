"""What a tensor-parallel engine refuses at start, by name, before any rank is spawned.

The sharded paged path covers the forward, the paged KV cache (each rank its heads, FP8
too), chunked prefill, preemption, the prefix cache and its host tier (rank 0's copies
replayed on every rank, ``kv/tier_mirror.py``), prompt logprobs, quantization at load
(each rank quantizes its shards, ``quant/tp_shard.py``), quantized checkpoints (FP8, INT8,
AWQ, GPTQ: each rank reads its cut of the packed tensors, ``quant/tp_checkpoint.py``; their
quantized MoE experts are refused there by name), everything sampled on rank 0
(seeded sampling, structured output), overlapped steps (the followers run the steps in
launch order, each step's placeholders already filled on rank 0), speculative decoding
(drafts proposed on rank 0, the verification an ordinary broadcast step) and multi-LoRA
(adapters cut like their layers, rank 0's slot writes replayed by the followers,
``lora/tp_sync.py``). What is not proven sharded is refused here rather than served
wrong: CUDA graphs, model types outside ``SHARDED_TYPES``, the CPU lean decode.
"""

from __future__ import annotations

from typing import Any

import torch

from worker.engine.config import EngineConfig
from worker.engine.distributed.tp_config import TensorParallelError, check_devices, check_heads

# The model types whose sharding is proven against one process on the paged engine
# (tests/worker/engine/distributed/test_tp_engine.py); any other is refused by name, not
# cut by a plan that may miss its own layout (a fused qkv, a norm over all heads).
SHARDED_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe",
                           "qwen3_moe", "gpt_oss", "gemma2"})
# dense families whose layouts the plan also cuts (fused q/k/v and gate/up by part, NeoX's
# per-head q/k/v, Cohere's per-head q/k norms, biased MLPs): proven the same way
SHARDED_TYPES |= frozenset({"gemma3_text", "granite", "smollm3", "starcoder2", "phi3", "glm4",
                            "cohere", "cohere2", "gpt_neox"})
# OLMo 2, OLMoE (q/k norms over all heads, squares all-reduced), Llama 4 text, DeepSeek-V3 (MLA)
SHARDED_TYPES |= frozenset({"olmo2", "olmoe", "llama4_text", "deepseek_v3"})


def _refuse(feature: str, fix: str, size: int) -> TensorParallelError:
    return TensorParallelError(
        f"{feature} is not supported with tensor-parallel size {size} yet; {fix}")


def tp_refusals(config: EngineConfig) -> list[TensorParallelError]:
    """The configured features a tensor-parallel engine does not serve yet."""
    size, model = config.tensor_parallel_size, config.model
    refused = []
    if _on_cuda(model.device) and not model.enforce_eager:
        refused.append(_refuse("CUDA graphs", "start with enforce_eager "
                               "(FERRY_ENFORCE_EAGER=1)", size))
    return refused


def _on_cuda(device: str) -> bool:
    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


def check_tensor_parallel(config: EngineConfig, hf_config: Any | None = None) -> None:
    """Refuse, before spawning any rank, a size this host, this model or these settings
    cannot serve; the message names the size and what it met."""
    size = config.tensor_parallel_size
    if size == 1:
        return
    if config.model.device.startswith("cuda:"):
        raise TensorParallelError(
            f"tensor-parallel size {size} takes devices cuda:0..cuda:{size - 1}; "
            f"device {config.model.device!r} names one (use device=cuda)")
    if _on_cuda(config.model.device):
        check_devices(size, "cuda", torch.cuda.device_count())
    refused = tp_refusals(config)
    if refused:
        raise refused[0]
    if hf_config is None:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(
            config.model.model, trust_remote_code=config.model.trust_remote_code)
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    kind = getattr(text, "model_type", None) or getattr(hf_config, "model_type", "?")
    if kind not in SHARDED_TYPES:
        raise _refuse(f"model type {kind!r}", "served sharded: "
                      f"{', '.join(sorted(SHARDED_TYPES))}", size)
    outer = getattr(hf_config, "model_type", kind)
    if text is not hf_config and outer not in SHARDED_TYPES:  # e.g. Llama 4 with vision
        raise _refuse(f"a multimodal checkpoint (model type {outer!r}, text {kind!r})",
                      "serve a text-only checkpoint of it", size)
    heads = text.num_attention_heads
    check_heads(size, heads, getattr(text, "num_key_value_heads", None) or heads)
