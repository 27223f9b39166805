"""The quantized LM head and embedding under tensor parallelism, and the walk that swaps
a sharded model's layers for quantized ones (``tp_shard.py`` builds each layer).

The head and the embedding are split by vocabulary rows, and their scales are per row
(INT8) or per group along the hidden size (INT4), so each rank's rows quantize to one
process's numbers; the choice between INT4 and INT8 is made from the full vocabulary, as
one process makes it.
"""

from __future__ import annotations

from typing import Any

import structlog
import torch
from torch import nn
from torch.nn import functional as F

from worker.engine.distributed.fused import RowsLinear
from worker.engine.distributed.group import all_gather_last, all_reduce_sum
from worker.engine.distributed.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from worker.engine.distributed.shard_model import HeadLinear
from worker.engine.distributed.tp_config import TPConfig
from worker.engine.runner.quant.apply import HEAD_GROUP, ignored
from worker.engine.runner.quant.config import QuantizationError, QuantScheme
from worker.engine.runner.quant.int4 import Int4Embedding, Int4Linear, quantize_groups
from worker.engine.runner.quant.int8 import Int8Embedding, Int8Linear, quantize_rows
from worker.engine.runner.quant.tp_experts import quantize_sharded_experts
from worker.engine.runner.quant.tp_shard import ReducedQuant, quantized_shard

_log = structlog.get_logger("ferry.worker.quant")
_ROUTER = "*.mlp.gate"  # an MoE router stays in the model's dtype, as in one process


class _QuantLMHead(nn.Module):
    """This rank's vocabulary rows scored by a quantized table, gathered in order."""

    weight = None  # no float weight: what code looking for a tied weight sees

    def __init__(self, head: ParallelLMHead, table: nn.Module) -> None:
        super().__init__()
        self.vocab_size, self.part, self.table = head.vocab_size, head.part, table

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.table(hidden)  # [..., rows of this rank]
        logits = F.pad(logits, (0, self.part - logits.shape[-1]))  # [..., vocab / size]
        return all_gather_last(logits)[..., :self.vocab_size]  # [..., vocab]


class _QuantVocabEmbedding(nn.Module):
    """This rank's vocabulary rows from a quantized table, zeros elsewhere; one all-reduce."""

    weight = None

    def __init__(self, emb: VocabParallelEmbedding, inner: nn.Module) -> None:
        super().__init__()
        self.start, self.end, self.inner = emb.start, emb.end, inner

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.end)  # [...]
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        out = self.inner(local)  # [..., hidden]
        return all_reduce_sum(out * mine.unsqueeze(-1).to(out.dtype))


def _quantize_head(model: Any, scheme: QuantScheme, vocab: int) -> int:
    """One process's ``apply._quantize_head`` on this rank's vocabulary rows."""
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if type(head) is not ParallelLMHead or type(emb) is not VocabParallelEmbedding \
            or emb.embed_scale is not None:  # one process leaves a scaled embedding float
        return 0
    tied = head.weight is emb.weight
    k = head.weight.shape[1]
    group = next((g for g in (HEAD_GROUP, 32) if k % g == 0), 0)
    dtype = emb.weight.dtype
    table: nn.Module
    inner: nn.Module
    if scheme.method == "int4" and group and vocab % 64 == 0:
        table = Int4Linear(*quantize_groups(head.weight, group), group, None)
        emb4 = table if tied else Int4Linear(*quantize_groups(emb.weight, group), group, None)
        inner = Int4Embedding(emb4, dtype)  # type: ignore[arg-type]
    else:
        table = Int8Linear(*quantize_rows(head.weight), None)
        inner = Int8Embedding(table if tied else Int8Linear(*quantize_rows(emb.weight), None),
                              dtype)  # type: ignore[arg-type]
    model.set_output_embeddings(_QuantLMHead(head, table))
    model.set_input_embeddings(_QuantVocabEmbedding(emb, inner))
    return 2


def apply_sharded(model: nn.Module, scheme: QuantScheme, tp: TPConfig) -> int:
    """Quantize rank ``tp.rank``'s shards in place, as ``apply`` does one process's
    layers (quantized at load only); returns how many layers."""
    if scheme.source != "load":
        raise QuantizationError(f"a {scheme.source} checkpoint is not implemented with "
                                f"tensor-parallel size {tp.size}: quantize at load instead")
    count = quantize_sharded_experts(model, scheme, tp)
    head = model.get_output_embeddings()  # type: ignore[operator]
    vocab = int(getattr(head, "vocab_size", 0))
    for name, mod in list(model.named_modules()):
        if mod is head or ignored(name, scheme.ignore + (_ROUTER,)):
            continue
        layer: nn.Module
        if isinstance(mod, RowParallelLinear):
            layer = ReducedQuant(quantized_shard(scheme, name, mod.weight, None, tp.size,
                                                 cut=True), mod.bias)
        elif (isinstance(mod, (ColumnParallelLinear, HeadLinear, RowsLinear))  # whole rows
              or type(mod) is nn.Linear):
            layer = quantized_shard(scheme, name, mod.weight, mod.bias, tp.size, cut=False)
        else:
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
        count += 1
    if scheme.head:
        count += _quantize_head(model, scheme, vocab)
    _log.info("quantized", method=scheme.method, source=scheme.source, layers=count,
              tensor_parallel_rank=tp.rank)
    return count
