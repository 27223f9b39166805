"""Tiny seeded checkpoints of every model family Ferry serves, with the features that
set each family apart shrunk until they bite at test sizes: sliding windows of 16,
Llama 4's attention chunks of 16 and NoPE temperature floor of 4, gpt-oss's sinks drawn
N(0, 1), Gemma 2's soft caps small enough to bend the scores.

Every family: 2 layers, hidden 64, 4 query heads over 2 KV heads of 16 dims (where the
config lets the head size be set), MoE blocks of 4 experts choosing 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.checkpoints import build_tokenizer, save_seeded

_GQA: dict[str, Any] = dict(num_attention_heads=4, num_key_value_heads=2)
_MOE: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
_WINDOW = 16

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(cls="LlamaConfig", **_GQA, head_dim=16),  # the lean decode path's
    "llama_rope3": dict(cls="LlamaConfig", **_GQA, head_dim=16,
                  rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                                       low_freq_factor=1.0, high_freq_factor=4.0,
                                       original_max_position_embeddings=64)),
    "mistral": dict(cls="MistralConfig", **_GQA, head_dim=16, sliding_window=_WINDOW),
    "qwen2": dict(cls="Qwen2Config", **_GQA, tie_word_embeddings=True),
    "qwen3": dict(cls="Qwen3Config", **_GQA, head_dim=16,
                  rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                       original_max_position_embeddings=64)),
    "gemma2": dict(cls="Gemma2Config", **_GQA, head_dim=16, sliding_window=_WINDOW,
                   attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                   query_pre_attn_scalar=16),
    "gemma3": dict(cls="Gemma3TextConfig", **_GQA, head_dim=16, sliding_window=_WINDOW,
                   layer_types=["sliding_attention", "full_attention"],
                   query_pre_attn_scalar=16),
    "phi3": dict(cls="Phi3Config", **_GQA),
    "phi3_partial": dict(cls="Phi3Config", **_GQA,  # partial rotary: half the head dims
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                              partial_rotary_factor=0.5)),
    # the window on layer 1 only (the module's, not the config's)
    "qwen2_window": dict(cls="Qwen2Config", **_GQA, use_sliding_window=True,
                         sliding_window=_WINDOW, max_window_layers=1),
    "olmo2": dict(cls="Olmo2Config", **_GQA),
    "granite": dict(cls="GraniteConfig", **_GQA, embedding_multiplier=2.0,
                    residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0),
    "cohere": dict(cls="CohereConfig", **_GQA, logit_scale=0.5),
    "cohere2": dict(cls="Cohere2Config", **_GQA, sliding_window=_WINDOW,
                    layer_types=["sliding_attention", "full_attention"], logit_scale=0.5),
    "starcoder2": dict(cls="Starcoder2Config", **_GQA, sliding_window=_WINDOW),
    "gpt_neox": dict(cls="GPTNeoXConfig", num_attention_heads=4, rotary_pct=0.5),
    "smollm3": dict(cls="SmolLM3Config", **_GQA, no_rope_layer_interval=2),
    "glm4": dict(cls="Glm4Config", **_GQA, head_dim=16),
    "mixtral": dict(cls="MixtralConfig", **_GQA, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(cls="Qwen2MoeConfig", **_GQA, **_MOE, shared_expert_intermediate_size=64),
    "qwen3_moe": dict(cls="Qwen3MoeConfig", **_GQA, **_MOE, head_dim=16),
    "qwen3_moe_dense": dict(cls="Qwen3MoeConfig", **_GQA, **_MOE, head_dim=16,
                            mlp_only_layers=[0]),  # a dense layer, then an MoE one
    "olmoe": dict(cls="OlmoeConfig", **_GQA, num_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(cls="GptOssConfig", **_GQA, head_dim=16, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=_WINDOW,
                    layer_types=["sliding_attention", "full_attention"]),
    # layer 0 chunked with rope, layer 1 NoPE (global) with temperature tuning
    "llama4": dict(cls="Llama4TextConfig", **_GQA, head_dim=16, num_local_experts=4,
                   num_experts_per_tok=1, intermediate_size_mlp=128, attention_chunk_size=16,
                   no_rope_layers=[1, 0], floor_scale=4, attn_scale=0.5, use_qk_norm=True),
    # MLA: a compressed query (q_lora_rank) and a latent K/V of 20 plus a shared rope key
    # of 8 (28 wide, not a power of two); keys 16 + 8 wide and values 12; layer 0 dense,
    # layer 1 MoE with grouped routing and a shared expert
    "deepseek_v3": dict(cls="DeepseekV3Config", num_attention_heads=4, num_key_value_heads=4,
                        q_lora_rank=32, kv_lora_rank=20, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=2, topk_group=1),
    # DeepSeek-V2-Lite's shape in a V3 config: a full-rank query projection, rope on
    # halves (not interleaved pairs), YaRN with mscale folded into the softmax scale
    "deepseek_v3_lite": dict(cls="DeepseekV3Config", num_attention_heads=4,
                             num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=20,
                             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                             rope_interleave=False, n_routed_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, n_shared_experts=1,
                             first_k_dense_replace=1, n_group=1, topk_group=1,
                             rope_parameters=dict(rope_type="yarn", rope_theta=10000.0,
                                                  factor=4.0, mscale=1.0, mscale_all_dim=1.0,
                                                  original_max_position_embeddings=128)),
}


def build_family(name: str, root: Path, *, seed: int = 0, max_pos: int = 512,
                 hidden: int = 64, layers: int = 2) -> str:
    """Write family ``name``'s checkpoint plus tokenizer under ``root``; returns its path.
    ``hidden`` and ``layers`` grow it (benchmarks; the MLP is twice ``hidden`` wide)."""
    import transformers

    path = root / (name if (hidden, layers) == (64, 2) else f"{name}-h{hidden}-l{layers}")
    if (path / "config.json").exists():
        return str(path)
    spec = dict(FAMILIES[name])
    for key in ("layer_types", "no_rope_layers"):  # per-layer patterns, repeated
        if key in spec:
            spec[key] = [spec[key][i % len(spec[key])] for i in range(layers)]
    tokenizer = build_tokenizer()
    config = getattr(transformers, spec.pop("cls"))(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, max_position_embeddings=max_pos,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id, **spec,
    )
    return save_seeded(config, tokenizer, path, seed)
