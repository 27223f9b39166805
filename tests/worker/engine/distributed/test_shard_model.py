"""A tiny Llama, Qwen3, Mixtral, gpt-oss, OLMo 2 and OLMoE sharded over two gloo ranks (OLMo 2
also over four, its KV heads replicated) score every token as the unsharded model does:
logits within 1e-5, greedy tokens equal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    GptOssConfig,
    LlamaConfig,
    MixtralConfig,
    Olmo2Config,
    OlmoeConfig,
    Qwen3Config,
)

from worker.engine.distributed.group import GroupSpec, close_group, init_group
from worker.engine.distributed.shard_model import shard_model
from worker.engine.distributed.tp_config import TensorParallelError, TPConfig

SIZE = 2
COMMON: dict[str, Any] = dict(vocab_size=61, hidden_size=32, intermediate_size=48,
                              num_hidden_layers=2, max_position_embeddings=64,
                              attn_implementation="eager")
CONFIGS = {
    "llama_gqa": lambda: LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **COMMON),
    "llama_kv_replicated": lambda: LlamaConfig(num_attention_heads=4, num_key_value_heads=1,
                                               **COMMON),
    "qwen3": lambda: Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 tie_word_embeddings=True, **COMMON),
    "mixtral": lambda: MixtralConfig(num_attention_heads=4, num_key_value_heads=2,
                                     num_local_experts=4, num_experts_per_tok=2, **COMMON),
    # sinks per head, biased interleaved experts, a sliding window under the sequence
    "gpt_oss": lambda: GptOssConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                    num_local_experts=4, num_experts_per_tok=2,
                                    sliding_window=4, attention_bias=True,
                                    layer_types=["sliding_attention", "full_attention"],
                                    **COMMON),
    # q/k norms over all heads' width (OLMoE casts before its weight, OLMo 2 after)
    "olmo2": lambda: Olmo2Config(num_attention_heads=4, num_key_value_heads=2, **COMMON),
    "olmoe": lambda: OlmoeConfig(num_attention_heads=4, num_key_value_heads=2,
                                 num_experts=4, num_experts_per_tok=2, **COMMON),
    # MLA cut by query heads (q, or q_b after the replicated q_a; kv_b_proj), the latent
    # whole; grouped routing over experts cut by their intermediate size, a shared expert
    "deepseek_v3": lambda: DeepseekV3Config(
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4,
        num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=16,
        n_shared_experts=1, first_k_dense_replace=1, **COMMON),
    "deepseek_v3_full_q": lambda: DeepseekV3Config(
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=16,
        **COMMON),
}


def _model(family: str) -> Any:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[family]())
    with torch.no_grad():  # drawn, not left at their zero/empty init: the split must show
        for name, param in model.named_parameters():
            if "sinks" in name or name.endswith("_bias"):
                param.normal_()
            if "q_norm" in name or "k_norm" in name:  # each rank's slice must show
                param.uniform_(0.5, 1.5)
        for name, buffer in model.named_buffers():  # DeepSeek's routing score bias
            if name.endswith("e_score_correction_bias"):
                buffer.normal_()
    return model.eval()


def _rank(rank: int, family: str, init_method: str, size: int = SIZE) -> None:
    torch.set_num_threads(1)
    init_group(TPConfig(size=size, rank=rank), GroupSpec(init_method, 30.0), "cpu")
    try:
        ids = torch.tensor([[5, 17, 3, 60, 9, 44, 2, 31]])
        with torch.no_grad():
            want = _model(family)(ids, use_cache=False).logits  # [1, T, vocab]
            sharded = shard_model(_model(family), TPConfig(size=size, rank=rank))
            got = sharded(ids, use_cache=False).logits
        full_numel = sum(p.numel() for p in _model(family).parameters())
        assert sum(p.numel() for p in sharded.parameters()) < (1.2 / size) * full_numel
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    finally:
        close_group()


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_two_ranks_equal_one(family: str, tmp_path: Path) -> None:
    mp.spawn(_rank, args=(family, f"file://{tmp_path}/rendezvous"), nprocs=SIZE, join=True)


def test_width_norms_over_replicated_kv_heads_on_four_ranks(tmp_path: Path) -> None:
    """Four ranks over OLMo 2's two KV heads: each KV head is held by two ranks, so the
    summed squares of its k_norm count it twice and are halved."""
    from worker.engine.distributed.layers import WidthParallelRMSNorm

    attn = shard_model(_model("olmo2"), TPConfig(size=4, rank=3)).model.layers[0].self_attn
    assert isinstance(attn.k_norm, WidthParallelRMSNorm) and attn.k_norm.replicas == 2
    mp.spawn(_rank, args=("olmo2", f"file://{tmp_path}/rendezvous", 4), nprocs=4, join=True)


def test_heads_that_do_not_divide_are_refused_before_any_weight_moves() -> None:
    model = _model("llama_gqa")
    with pytest.raises(TensorParallelError, match="size 3 does not divide the model's 4"):
        shard_model(model, TPConfig(size=3, rank=0))


def _loaded_rank(rank: int, ckpt: str, init_method: str, result: str) -> None:
    torch.set_num_threads(1)
    from worker.engine.distributed.sharded_load import load_sharded
    tp = TPConfig(size=SIZE, rank=rank)
    init_group(tp, GroupSpec(init_method, 30.0), "cpu")
    try:
        ids = torch.tensor([[5, 17, 3, 60, 9, 44, 2, 31]])
        model = load_sharded(ckpt, tp)
        full = AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="eager").eval()
        with torch.no_grad():
            got = model(ids, use_cache=False).logits
            want = full(ids, use_cache=False).logits
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        mine = sum(p.numel() * p.element_size() for p in model.parameters())
        whole = sum(p.numel() * p.element_size() for p in full.parameters())
        Path(f"{result}.{rank}").write_text(f"{mine / whole:.4f}")
    finally:
        close_group()


@pytest.mark.parametrize("family", ["llama_gqa", "qwen3", "gpt_oss", "deepseek_v3"])
def test_each_rank_loads_only_its_shards(family: str, tmp_path: Path) -> None:
    _model(family).save_pretrained(tmp_path / "ckpt")
    result = tmp_path / "ratio"
    mp.spawn(_loaded_rank, args=(str(tmp_path / "ckpt"), f"file://{tmp_path}/rdv",
                                 str(result)), nprocs=SIZE, join=True)
    limit = 0.6 if family.startswith("deepseek") else 0.55  # MLA's latent is replicated
    for rank in range(SIZE):
        assert float(Path(f"{result}.{rank}").read_text()) <= limit


@pytest.mark.parametrize("family", ["llama_gqa", "llama_kv_replicated"])
def test_lora_targets_see_the_unsharded_shapes_and_each_cut(family: str) -> None:
    """A sharded model offers LoRA the unsharded projections' shapes (an adapter is
    checked against them) and the slice each rank holds: q/k/v by heads (a replicated KV
    head whole on both ranks), gate/up by output, o/down by input."""
    from worker.engine.distributed.sharding import ShardCut
    from worker.engine.lora.targets import base_targets, check_all_cut

    full = base_targets(_model(family), "m")
    kv_heads = CONFIGS[family]().num_key_value_heads
    for rank in range(SIZE):
        got = base_targets(shard_model(_model(family), TPConfig(size=SIZE, rank=rank)), "m")
        assert got.shapes == full.shapes and set(got.cuts) == set(full.shapes)
        layer = "model.layers.1."
        kv = (0, 8) if kv_heads == 1 else (8 * rank, 8 * rank + 8)
        assert got.cuts[layer + "self_attn.q_proj"] == ShardCut("out", 16 * rank,
                                                                16 * rank + 16, 32)
        assert got.cuts[layer + "self_attn.k_proj"] == ShardCut("out", *kv, 8 * kv_heads)
        assert got.cuts[layer + "self_attn.o_proj"] == ShardCut("in", 16 * rank,
                                                                16 * rank + 16, 32)
        assert got.cuts[layer + "mlp.up_proj"] == ShardCut("out", 24 * rank, 24 * rank + 24,
                                                           48)
        assert got.cuts[layer + "mlp.down_proj"] == ShardCut("in", 24 * rank, 24 * rank + 24,
                                                             48)
        assert got.local_shape(layer + "mlp.down_proj").in_features == 24
        check_all_cut(got)


def test_lora_refuses_a_sharded_model_with_a_projection_that_has_no_cut() -> None:
    from worker.engine.lora.targets import base_targets, check_all_cut

    model = shard_model(_model("llama_gqa"), TPConfig(size=SIZE, rank=0))
    model.model.layers[0].mlp.up_proj = torch.nn.Linear(32, 24)  # e.g. a quantized shard
    with pytest.raises(ValueError, match="'model.layers.0.mlp.up_proj' does not say which"):
        check_all_cut(base_targets(model, "m"))
