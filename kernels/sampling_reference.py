"""The sampling pass in plain torch: the CPU path and the oracle of ``kernels.sampling``.

One call turns a step's logits into tokens, row by row with the row's own parameters:
logit bias, then greedy rows take the argmax, sampled rows divide by their temperature,
drop what min-p, top-k and top-p exclude (in that order; top-p's mass is renormalised
over what min-p and top-k kept, as vLLM) and draw with the exponential race
``argmax(p / E)``, ``E`` the counter-based noise of the row's key
(``worker.engine.sampling_noise``).

Each filter is a threshold on the row's scaled logits: a token is kept when its value is
at least the row's threshold, so tokens tied *at* a boundary are all kept (vLLM's
threshold top-k does the same). Away from ties this keeps exactly the tokens the
sort-based filter kept before, and draws the same tokens; the Triton kernel finds the
same thresholds without sorting (see ``kernels/sampling.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.engine.sampling_noise import exponential


@dataclass(frozen=True)
class SamplingTensors:
    """A step's per-row sampling parameters, on the logits' device.

    ``params[:, 0]`` temperature (0: greedy), ``[:, 1]`` top-p (1: off), ``[:, 2]`` min-p
    (0: off), ``[:, 3]`` top-k as a float (>= vocab: off; exact below 2**24). The logit
    bias is a CSR list: row r's entries are ``bias_tokens/values[bias_offsets[r]:
    bias_offsets[r + 1]]`` (one entry per token and row)."""

    params: torch.Tensor  # [R, 4] float32
    keys: torch.Tensor  # [R] int64, the noise keys (any value in greedy rows)
    bias_offsets: torch.Tensor  # [R + 1] int32
    bias_tokens: torch.Tensor  # [N] int32
    bias_values: torch.Tensor  # [N] float32

    @property
    def num_bias(self) -> int:
        return int(self.bias_tokens.shape[0])


def biased(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """[R, V] float32 logits plus each row's bias (a copy only when there is one)."""
    logits = logits.float()
    if t.num_bias == 0:
        return logits
    counts = t.bias_offsets[1:] - t.bias_offsets[:-1]  # [R]
    rows = torch.repeat_interleave(torch.arange(logits.shape[0], device=logits.device),
                                   counts.long())  # [N]
    return logits.index_put((rows, t.bias_tokens.long()), t.bias_values, accumulate=True)


def kept(scaled: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
         top_k: torch.Tensor) -> torch.Tensor:
    """scaled [R, V] -> [R, V] bool: the tokens min-p, top-k and top-p keep, in that order.

    Each is a threshold on the row's values; top-p's is the smallest sorted value whose
    better tokens hold less than ``top_p`` of the mass left by min-p and top-k."""
    vocab = scaled.shape[1]
    probs = torch.softmax(scaled, dim=-1)
    dropped = probs < probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
    scaled = scaled.masked_fill(dropped, float("-inf"))  # min-p first
    ordered = scaled.sort(dim=-1, descending=True).values  # [R, V]
    k_value = ordered.gather(1, (top_k.long().clamp(1, vocab) - 1).unsqueeze(1))  # [R, 1]
    ordered = ordered.masked_fill(ordered < k_value, float("-inf"))  # top-k, ties kept
    mass = torch.softmax(ordered, dim=-1)
    before = mass.cumsum(dim=-1) - mass  # mass of the better tokens
    last = (before < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True)  # [R, 1]
    last = torch.where(top_p.unsqueeze(1) >= 1.0, torch.full_like(last, vocab), last)
    threshold = ordered.gather(1, last.clamp(1, vocab) - 1)  # the top token always survives
    return (scaled >= threshold) & (scaled >= k_value) & (scaled > float("-inf"))


def sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """logits [R, V] (any float dtype) -> tokens [R] int64.

    A row whose logits are all -inf gets token 0, as the argmax of the old path did."""
    x = biased(logits, t)  # [R, V]
    tokens = x.argmax(dim=-1)  # greedy rows' answer
    temperature, top_p, min_p, top_k = t.params.unbind(1)
    sampled = temperature > 0
    if not bool(sampled.any()):
        return tokens
    index = sampled.nonzero().squeeze(1)  # [S]
    scaled = x.index_select(0, index) / temperature[index].unsqueeze(1)  # [S, V]
    keep = kept(scaled, top_p[index], min_p[index], top_k[index])  # [S, V]
    probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)
    drawn = (probs / exponential(t.keys[index], x.shape[1])).argmax(dim=-1)  # [S]
    return tokens.index_copy(0, index, drawn)
