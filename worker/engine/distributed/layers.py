"""The tensor-parallel layers: each holds one rank's shard and does one collective.

Column-parallel linears (q/k/v, gate/up) keep their output split and need no collective;
row-parallel linears (o, down) sum partial outputs with one all-reduce; the embedding and
LM head split the vocabulary; an RMSNorm over a whole projection's width (OLMo's q/k
norms across all heads) sums its squares over the ranks with one small all-reduce.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker.engine.distributed.group import all_gather_last, all_reduce_sum
from worker.engine.distributed.sharding import (
    ShardCut,
    column_shard,
    even_range,
    head_shard,
    row_shard,
    vocab_range,
)


class ColumnParallelLinear(nn.Module):
    """``y[..., shard] = x @ W[shard].T``: the output features of this rank, no collective."""

    def __init__(self, full: nn.Linear, rank: int, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(column_shard(full.weight.detach(), rank, size).clone(),
                                   requires_grad=False)
        self.in_features, self.out_features = self.weight.shape[1], self.weight.shape[0]
        self.cut = ShardCut("out", *even_range(full.out_features, rank, size), full.out_features)
        bias = full.bias
        self.bias = (None if bias is None else
                     nn.Parameter(column_shard(bias.detach(), rank, size).clone(),
                                  requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)  # [..., out / size]


class RowParallelLinear(nn.Module):
    """``y = sum over ranks of x[..., shard] @ W[:, shard].T``, plus the bias once.

    ``partial`` and ``reduce`` are its two halves, for a wrapper that adds to the partial
    sums before the one all-reduce (a LoRA delta from this rank's input shard)."""

    def __init__(self, full: nn.Linear, rank: int, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(row_shard(full.weight.detach(), rank, size).clone(),
                                   requires_grad=False)
        self.bias = (None if full.bias is None else
                     nn.Parameter(full.bias.detach().clone(), requires_grad=False))
        self.in_features, self.out_features = self.weight.shape[1], self.weight.shape[0]
        self.cut = ShardCut("in", *even_range(full.in_features, rank, size), full.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.partial(x))  # [..., out]

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, before the sum: [..., out]."""
        return F.linear(x, self.weight)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The ranks' partial outputs summed (in place), plus the bias: [..., out]."""
        y = all_reduce_sum(y)
        return y if self.bias is None else y + self.bias


class HeadLinear(nn.Module):
    """A q/k/v projection cut to heads ``[start, end)``."""

    def __init__(self, full: nn.Linear, head_dim: int, heads: tuple[int, int]) -> None:
        super().__init__()
        self.weight = nn.Parameter(head_shard(full.weight.detach(), head_dim, heads).clone(),
                                   requires_grad=False)
        self.bias = (None if full.bias is None else nn.Parameter(
            head_shard(full.bias.detach(), head_dim, heads).clone(), requires_grad=False))
        self.in_features, self.out_features = self.weight.shape[1], self.weight.shape[0]
        self.cut = ShardCut("out", heads[0] * head_dim, heads[1] * head_dim,
                            full.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)  # [..., local heads * d]


class VocabParallelEmbedding(nn.Module):
    """Each rank embeds the ids in its vocabulary range, zeros elsewhere; one all-reduce.

    A scaled embedding (Gemma's ``*ScaledWordEmbedding``: rows times ``sqrt(hidden)``
    inside the embedding's own forward) keeps its factor, applied as it does.
    """

    def __init__(self, full: nn.Embedding, rank: int, size: int) -> None:
        super().__init__()
        self.start, self.end = vocab_range(full.num_embeddings, rank, size)
        self.weight = nn.Parameter(full.weight.detach()[self.start:self.end].clone(),
                                   requires_grad=False)
        self.embed_scale: float | None = getattr(full, "scalar_embed_scale", None)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.end)  # [...]
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        if self.embed_scale is not None:  # one rank's row, zeros elsewhere: scaled alike
            out = out * torch.tensor(self.embed_scale, dtype=self.weight.dtype)
        return all_reduce_sum(out)  # [..., hidden]


class ParallelLMHead(nn.Module):
    """Each rank scores its vocabulary rows; the logits are gathered in vocabulary order.

    A short last share is padded on the logits (not the weight) so the gather has one
    shape; the padding is cut off after it. With tied embeddings the head reuses the
    embedding's shard rather than holding a second copy.
    """

    def __init__(self, full: nn.Linear, rank: int, size: int,
                 tied: VocabParallelEmbedding | None = None) -> None:
        super().__init__()
        self.vocab_size = full.out_features
        self.part = -(-self.vocab_size // size)
        start, end = vocab_range(self.vocab_size, rank, size)
        self.weight = (tied.weight if tied is not None else
                       nn.Parameter(full.weight.detach()[start:end].clone(),
                                    requires_grad=False))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)  # [..., rows of this rank]
        logits = F.pad(logits, (0, self.part - logits.shape[-1]))  # [..., vocab / size]
        return all_gather_last(logits)[..., :self.vocab_size]  # [..., vocab]


class WidthParallelRMSNorm(nn.Module):
    """An RMSNorm over a projection's full width (all heads) applied to this rank's slice.

    The mean of squares needs every head: each rank sums its slice's squares per row in
    fp32, one all-reduce adds them (divided by ``replicas``, the ranks holding each head
    when KV heads are replicated), and each rank scales its slice by its slice of the
    weight. ``weight_last``: the weight multiplies after the cast back to the input dtype
    (OLMoE's order) rather than before it (OLMo 2's).
    """

    def __init__(self, full: Any, cut: ShardCut, replicas: int, weight_last: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(full.weight.detach()[cut.start:cut.end].clone(),
                                   requires_grad=False)
        self.eps = float(full.variance_epsilon)
        self.full_width, self.replicas, self.weight_last = cut.full, replicas, weight_last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)  # [..., width / size]
        squares = all_reduce_sum(h.pow(2).sum(-1, keepdim=True))  # [..., 1]
        if self.replicas > 1:
            squares = squares / self.replicas
        h = h * torch.rsqrt(squares / self.full_width + self.eps)
        if self.weight_last:
            return self.weight * h.to(dtype)
        return (self.weight * h).to(dtype)
