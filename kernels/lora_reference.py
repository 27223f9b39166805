"""Pure-torch batched LoRA shrink/expand: the oracle for ``kernels/lora.py`` and the CPU path.

A step's tokens each carry an adapter slot (``-1``: the base model alone). Tokens of one
slot are gathered and multiplied by that slot's matrices, one matmul pair per slot used
(the CPU path's cost grows with the adapters in the batch, not with its tokens). No token
meets another slot's matrices, so one adapter's NaN or Inf stays in its own rows:

    t[tok]  = x[tok] @ A[s]^T                       shrink: [n, in] -> [n, R], fp32
    y[tok] += scale[s] * (t[tok] @ B[s]^T)          expand: [n, R] -> [n, out], in place

``A`` [S, R, in] and ``B`` [S, out, R] are a slot pool's stacked buffers; an adapter of a
smaller rank than R sits there zero-padded, which adds exact zeros. As in the kernel,
``t`` stays fp32 through the expand and the sums are kept in fp32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# (slot, its tokens: indices [n] int64, or a slice of the batch when they are contiguous)
LoraGroups = list[tuple[int, torch.Tensor | slice]]


def lora_groups(token_slots: torch.Tensor) -> LoraGroups:  # [T] int, -1 = no adapter
    """The tokens of each slot in use, in slot order (reads the slots on the host)."""
    groups = []
    for slot in torch.unique(token_slots).tolist():
        if slot >= 0:
            groups.append((int(slot), (token_slots == slot).nonzero().squeeze(1)))
    return groups


def lora_shrink(
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [S, R, in]
    groups: LoraGroups,
    ranks: Sequence[int] | None = None,  # [S] each slot's rank: columns past it are zero
) -> torch.Tensor:  # [T, R] fp32; rows of tokens with no adapter are zero
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for slot, tokens in groups:
        r = a.shape[1] if ranks is None else ranks[slot]
        out[tokens, :r] = x[tokens].float() @ a[slot, :r].float().T
    return out


def lora_expand(
    t: torch.Tensor,  # [T, R] fp32, from lora_shrink
    b: torch.Tensor,  # [S, out, R]
    scale: torch.Tensor,  # [S] fp32
    groups: LoraGroups,
    y: torch.Tensor,  # [T, out], updated in place
    ranks: Sequence[int] | None = None,  # [S] each slot's rank: columns past it are zero
) -> None:
    for slot, tokens in groups:
        r = b.shape[2] if ranks is None else ranks[slot]
        delta = t[tokens, :r] @ b[slot, :, :r].float().T  # [n, out]
        y[tokens] = (y[tokens].float() + scale[slot].float() * delta).to(y.dtype)
