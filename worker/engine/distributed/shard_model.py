"""Shard a transformers decoder in place for one rank: our own plan, by module name.

Our own plan rather than transformers' ``tp_plan``: the paged path needs each rank's
attention to see whole local heads (and KV heads replicated when there are fewer than
ranks, which transformers' plans do not do), and the row-parallel outputs summed by our
collectives with the group's timeout. Llama-, Qwen3-, Mixtral- and gpt-oss-style modules:

- q_proj by query heads, k_proj/v_proj by KV heads (replicated below the size), o_proj
  by rows: one all-reduce per attention block;
- gate_proj/up_proj by columns, down_proj by rows: one all-reduce per MLP;
- fused experts (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I], or gpt-oss's
  transposed, interleaved and biased ones) by the intermediate size: one all-reduce per
  MoE block;
- attention sinks (gpt-oss, one per query head) with their heads; Cohere's per-head q/k
  norm weights ([heads, head_dim]) likewise;
- q/k norms over a projection's whole width (OLMo 2, OLMoE) with their heads' slice of
  the weight, the mean of squares all-reduced: one small all-reduce per norm per layer
  (per-head norms, Qwen3's, are left whole: each rank holds whole heads);
- multi-head latent attention (DeepSeek-V3) by query heads: q and the latent's
  up-projection ``kv_b_proj`` by heads, o_proj by rows, the latent itself replicated;
- unfused MLPs by their names (StarCoder2's c_fc/c_proj, GPT-NeoX's dense_h_to_4h/
  dense_4h_to_h), biases with their rows or added once after the all-reduce;
- fused projections part by part (Phi-3's qkv_proj, Phi-3's and GLM-4's gate_up_proj,
  GPT-NeoX's per-head query_key_value: ``fused.py``);
- embed_tokens (embed_in) and lm_head by vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from worker.engine.distributed.fused import (
    shard_fused_mlp,
    shard_neox_attention,
    shard_phi3_attention,
)
from worker.engine.distributed.group import all_reduce_sum
from worker.engine.distributed.layers import (
    ColumnParallelLinear,
    HeadLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    WidthParallelRMSNorm,
)
from worker.engine.distributed.sharding import ShardCut, even_range, kv_head_range
from worker.engine.distributed.tp_config import TensorParallelError, TPConfig, check_heads


def _transposed(experts: Any) -> bool:
    """Whether the experts hold ``[E, H, 2I]``/``[E, I, H]`` (gpt-oss's flag, or Llama 4's
    batched experts, which carry no flag) rather than ``[E, 2I, H]``/``[E, H, I]``."""
    return bool(getattr(experts, "is_transposed", False)
                or type(experts).__name__ == "Llama4TextExperts")


def _intermediate(experts: Any) -> int:
    """The experts' intermediate size (down_proj is [E, H, I], or [E, I, H] transposed)."""
    down = experts.down_proj
    return int(down.shape[1] if _transposed(experts) else down.shape[-1])


def _gate_up_index(experts: Any, start: int, end: int) -> torch.Tensor:
    """Positions along the gate/up axis of intermediate units ``[start, end)``: the gate
    and up halves of a concatenated layout, or the interleaved pairs of gpt-oss's."""
    inter = _intermediate(experts)
    if getattr(experts, "is_concatenated", True):
        return torch.cat([torch.arange(start, end), torch.arange(inter + start, inter + end)])
    return torch.arange(2 * start, 2 * end)  # gate at even, up at odd positions


class _ReducedExperts(nn.Module):
    """Fused experts holding one rank's intermediate slice; their sum is all-reduced.

    ``gate_up_proj`` is [E, 2I, H] ([E, H, 2I] transposed), ``down_proj`` [E, H, I]
    ([E, I, H] transposed); a down bias is kept by rank 0 alone (zeros elsewhere), so the
    all-reduce adds it once.
    """

    def __init__(self, experts: Any, rank: int, size: int) -> None:
        super().__init__()
        transposed = _transposed(experts)
        start, end = even_range(_intermediate(experts), rank, size)
        cols = _gate_up_index(experts, start, end)
        gate_up = experts.gate_up_proj.detach()
        shard = gate_up[:, :, cols] if transposed else gate_up[:, cols]
        experts.gate_up_proj = nn.Parameter(shard.contiguous(), requires_grad=False)
        down = experts.down_proj.detach()
        down = down[:, start:end] if transposed else down[..., start:end]
        experts.down_proj = nn.Parameter(down.contiguous(), requires_grad=False)
        if getattr(experts, "has_bias", False):
            experts.gate_up_proj_bias = nn.Parameter(
                experts.gate_up_proj_bias.detach()[:, cols].contiguous(), requires_grad=False)
            bias = experts.down_proj_bias.detach()
            experts.down_proj_bias = nn.Parameter(bias.clone() if rank == 0 else
                                                  torch.zeros_like(bias), requires_grad=False)
        for attr in ("intermediate_dim", "intermediate_size", "expert_dim"):
            if hasattr(experts, attr):
                setattr(experts, attr, end - start)
        self.inner = experts

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return all_reduce_sum(self.inner(*args, **kwargs))  # [tokens, hidden]


def _shard_attention(attn: Any, config: Any, tp: TPConfig) -> None:
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = attn.head_dim
    q_heads = even_range(heads, tp.rank, tp.size)
    kv = kv_head_range(kv_heads, tp.rank, tp.size)
    attn.q_proj = HeadLinear(attn.q_proj, head_dim, q_heads)
    attn.k_proj = HeadLinear(attn.k_proj, head_dim, kv)
    attn.v_proj = HeadLinear(attn.v_proj, head_dim, kv)
    attn.o_proj = RowParallelLinear(attn.o_proj, tp.rank, tp.size)
    attn.num_key_value_groups = (q_heads[1] - q_heads[0]) // (kv[1] - kv[0])
    for norm, span in (("q_norm", q_heads), ("k_norm", kv)):  # Cohere's: a weight per head
        weight = getattr(getattr(attn, norm, None), "weight", None)
        if isinstance(weight, nn.Parameter) and weight.dim() == 2:  # [heads, head_dim]
            getattr(attn, norm).weight = nn.Parameter(
                weight.detach()[span[0]:span[1]].clone(), requires_grad=False)
    if isinstance(getattr(attn, "sinks", None), nn.Parameter):  # gpt-oss: one per head
        attn.sinks = nn.Parameter(attn.sinks.detach()[q_heads[0]:q_heads[1]].clone(),
                                  requires_grad=False)
    replicas = max(1, tp.size // kv_heads)
    for name, proj, copies in (("q_norm", attn.q_proj, 1), ("k_norm", attn.k_proj, replicas)):
        _shard_width_norm(attn, name, proj.cut, copies, head_dim)


def _shard_mla(attn: Any, tp: TPConfig) -> None:
    """Multi-head latent attention cut by query heads: ``q_proj`` (or ``q_b_proj`` after
    the replicated ``q_a_proj`` and its norm) and the latent's up-projection ``kv_b_proj``
    keep the rank's heads, ``o_proj`` their rows; the latent ``kv_a_proj_with_mqa`` and
    ``kv_a_layernorm`` stay whole, so every rank computes (and caches) the same latent."""
    heads = even_range(attn.num_heads, tp.rank, tp.size)
    q_dim = attn.qk_nope_head_dim + attn.qk_rope_head_dim
    if attn.q_proj is not None:
        attn.q_proj = HeadLinear(attn.q_proj, q_dim, heads)
    else:
        attn.q_b_proj = HeadLinear(attn.q_b_proj, q_dim, heads)
    attn.kv_b_proj = HeadLinear(attn.kv_b_proj, attn.qk_nope_head_dim + attn.v_head_dim,
                                heads)
    attn.o_proj = RowParallelLinear(attn.o_proj, tp.rank, tp.size)
    attn.num_heads = heads[1] - heads[0]


def _shard_width_norm(attn: Any, name: str, cut: ShardCut, replicas: int,
                      head_dim: int) -> None:
    """Swap a norm over the projection's whole width for its width-parallel form; a
    per-head norm (one head's width: also a whole-width norm over a single KV head, which
    every rank holds whole) or none is left as it is."""
    norm: Any = getattr(attn, name, None)
    weight = getattr(norm, "weight", None)
    if (weight is None or weight.dim() != 1 or weight.shape[0] != cut.full
            or cut.full <= head_dim):
        return
    if not hasattr(norm, "variance_epsilon"):
        raise TensorParallelError(f"{type(norm).__name__}: a {name} over all heads that is "
                                  "not an RMSNorm is not implemented with tensor parallelism")
    setattr(attn, name, WidthParallelRMSNorm(
        norm, cut, replicas, weight_last=type(norm).__name__ == "OlmoeRMSNorm"))


# (column-parallel, row-parallel) linears of an unfused MLP: Llama's, StarCoder2's, NeoX's
_MLP_PAIRS = (("gate_proj", "down_proj"), ("c_fc", "c_proj"), ("dense_h_to_4h", "dense_4h_to_h"))


def _shard_module(module: Any, config: Any, tp: TPConfig,
                  materialise: Callable[[Any], None]) -> None:
    """Cut ``module``'s own projections if it is an attention, MLP, experts or embedding
    owner the plan knows, by the names that say its layout."""
    if hasattr(module, "kv_b_proj") and hasattr(module, "o_proj"):  # MLA
        materialise(module)
        _shard_mla(module, tp)
    elif hasattr(module, "q_proj") and hasattr(module, "o_proj"):
        materialise(module)
        _shard_attention(module, config, tp)
    elif isinstance(getattr(module, "qkv_proj", None), nn.Linear):  # Phi-3
        materialise(module)
        shard_phi3_attention(module, config, tp.rank, tp.size)
    elif isinstance(getattr(module, "query_key_value", None), nn.Linear):  # GPT-NeoX
        materialise(module)
        shard_neox_attention(module, config, tp.rank, tp.size)
    for column, row in _MLP_PAIRS:
        if isinstance(getattr(module, column, None), nn.Linear):
            materialise(module)
            setattr(module, column, ColumnParallelLinear(getattr(module, column), tp.rank,
                                                         tp.size))
            if column == "gate_proj":
                module.up_proj = ColumnParallelLinear(module.up_proj, tp.rank, tp.size)
            setattr(module, row, RowParallelLinear(getattr(module, row), tp.rank, tp.size))
    if isinstance(getattr(module, "gate_up_proj", None), nn.Linear):  # Phi-3's, GLM-4's
        materialise(module)
        shard_fused_mlp(module, tp.rank, tp.size)
    experts = getattr(module, "experts", None)
    if experts is not None and hasattr(experts, "gate_up_proj"):
        materialise(experts)
        module.experts = _ReducedExperts(experts, tp.rank, tp.size)
    for name in ("embed_tokens", "embed_in"):
        if isinstance(getattr(module, name, None), nn.Embedding):
            materialise(getattr(module, name))
            setattr(module, name, VocabParallelEmbedding(getattr(module, name), tp.rank,
                                                         tp.size))


def _noop(module: Any) -> None:
    return None


def shard_model(model: Any, tp: TPConfig, materialise: Callable[[Any], None] = _noop) -> Any:
    """Replace ``model``'s weights with rank ``tp.rank``'s shards (a no-op at size 1).

    ``materialise(module)`` runs on each module just before it is sharded: a loader that
    built the model on the meta device fills that one module's full weights there, so no
    more than one full weight exists at a time.
    """
    if not tp.enabled:
        return model
    config: Any = model.config
    heads = config.num_attention_heads
    check_heads(tp.size, heads, getattr(config, "num_key_value_heads", None) or heads)
    module: Any
    for module in list(model.modules()):
        _shard_module(module, config, tp, materialise)
    if isinstance(getattr(model, "lm_head", None), nn.Linear):
        embed = model.get_input_embeddings()
        tied = getattr(config, "tie_word_embeddings", False) and isinstance(
            embed, VocabParallelEmbedding)
        if not tied:
            materialise(model.lm_head)
        model.lm_head = ParallelLMHead(model.lm_head, tp.rank, tp.size,
                                       tied=embed if tied else None)
    return model
