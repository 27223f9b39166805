"""A base projection plus its rows' LoRA: ``y = base(x)``, then ``y += scale·(x Aᵀ) Bᵀ`` per row.

The wrapper calls the base module as it is (an ``nn.Linear``, or on a CPU the oneDNN
``PackedLinear`` that ``pack_linears`` swapped in at load), so packing and LoRA compose:
the base weights are never merged or copied. It reads the step's token-to-slot metadata
from the ``LoraStep`` it holds; with none (no row of the step uses an adapter) the
forward is the base call alone.

Under tensor parallelism a column-parallel base yields this rank's output features and
the slots hold B's matching rows; a row-parallel base (one with ``partial`` and
``reduce``) sees this rank's input features, the slots hold A's matching columns, and
the LoRA delta is added to the partial output before the base's one all-reduce: the
sum over the ranks of ``(x_r A_rᵀ) Bᵀ`` is ``(x Aᵀ) Bᵀ``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kernels import lora_reference
from worker.engine.lora.metadata import LoraMetadata, LoraStep
from worker.engine.lora.slots import LoraSlots


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Module, module: str, slots: LoraSlots, step: LoraStep) -> None:
        super().__init__()
        self.base = base
        self.module_name = module
        # plain attributes, not buffers: the slot pool owns them and the model's
        # state dict stays the base model's
        self._a = slots.a[module]  # [S, R, in]
        self._b = slots.b[module]  # [S, out, R], a view of b_flat's storage
        self._a_flat = slots.a_flat[module]  # [S*R, in]
        self._b_flat = slots.b_flat[module]  # [out, S*R]
        self._scale = slots.scale  # [S] fp32
        self._max_rank = slots.max_rank
        self._finite = slots.finite  # [S] host, the pool's own list: current at every step
        self._step = step
        # row parallel (tensor parallelism): (partial, reduce), the delta joins the
        # partial output before the reduction
        partial, reduce = getattr(base, "partial", None), getattr(base, "reduce", None)
        self._split: tuple[Callable[[torch.Tensor], torch.Tensor],
                           Callable[[torch.Tensor], torch.Tensor]] | None = (
            (partial, reduce) if callable(partial) and callable(reduce) else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        meta = self._step.meta
        if meta is None:
            return self.base(x)  # type: ignore[no-any-return]
        split = self._split
        y = self.base(x) if split is None else split[0](x)
        flat_x = x.reshape(-1, x.shape[-1])  # [T, in]
        flat_y = y.view(-1, y.shape[-1])  # [T, out], written in place
        if meta.wide is not None and flat_x.dtype == torch.float32:
            cols = meta.wide_cols
            finite = all(self._finite[cols.start // self._max_rank:
                                      cols.stop // self._max_rank])
            _apply_wide(flat_x, flat_y, self._a_flat, self._b_flat, meta, finite)
        elif meta.groups is not None and flat_x.dtype == torch.float32:
            _apply_groups(flat_x, flat_y, self._a, self._b, meta)
        elif meta.groups is not None:
            t = lora_reference.lora_shrink(flat_x, self._a, meta.groups, meta.ranks)
            lora_reference.lora_expand(t, self._b, self._scale, meta.groups, flat_y,
                                       meta.ranks)
        else:
            _apply_triton(flat_x, flat_y, self._a, self._b, self._scale, meta)
        if split is not None:
            y = split[1](y)
        return y  # type: ignore[no-any-return]


def _apply_wide(x: torch.Tensor, y: torch.Tensor, a_flat: torch.Tensor,
                b_flat: torch.Tensor, meta: LoraMetadata, finite: bool) -> None:
    """Small fp32 CPU steps, every slot in use at once: ``t = x A_flatᵀ`` [T, n·R], each
    token keeps its own slot's columns (scaled) and the rest are set to 0, then
    ``y += t B_flatᵀ``.

    Isolation: the other slots' columns of ``t`` are *selected away* (``where``), never
    multiplied by a 0 (0·NaN is NaN: a NaN or Inf an adapter put there, or that a finite
    one overflowed to, would reach every row). In the expand a row's exact 0s meet the
    other slots' B; that adds exact 0s when those B are finite, so where a slot in range
    holds a non-finite number (``finite`` False: an adapter installed past the load
    check, or left in a freed slot) that range of B is read through a copy with those
    numbers set to 0, which changes nothing but that slot's own rows."""
    assert meta.wide is not None and meta.wide_own is not None
    cols = meta.wide_cols
    t = torch.mm(x, a_flat[cols].T)  # [T, n*R]
    t = torch.where(meta.wide_own, t, 0.0).mul_(meta.wide)
    b = b_flat[:, cols]  # [out, n*R]
    if not finite:
        b = torch.nan_to_num(b, nan=0.0, posinf=0.0, neginf=0.0)
    y.addmm_(t, b.T)


def _apply_groups(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  meta: LoraMetadata) -> None:
    """Large fp32 CPU steps: per adapter, ``y[tokens] += scale·(x[tokens] A[:r]ᵀ) B[:, :r]ᵀ``
    as one shrink and one accumulating product, in place: a prefill chunk's tokens are a
    slice, so nothing is gathered, zero-filled or copied back (the reference's
    ``lora_expand`` rebuilt ``y[tokens]`` through three [n, out] temporaries)."""
    assert meta.groups is not None
    for slot, tokens in meta.groups:
        r = meta.ranks[slot]
        t = torch.mm(x[tokens], a[slot, :r].T)  # [n, r]
        if isinstance(tokens, slice):
            y[tokens].addmm_(t, b[slot, :, :r].T, alpha=meta.scales[slot])
        else:
            y.index_add_(0, tokens, torch.mm(t, b[slot, :, :r].T), alpha=meta.scales[slot])


def _apply_triton(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  scale: torch.Tensor, meta: LoraMetadata) -> None:
    from kernels.lora import lora_expand, lora_shrink

    assert meta.sorted_tokens is not None and meta.starts is not None
    t = torch.empty(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)  # [T, R]
    lora_shrink(x, a, meta.sorted_tokens, meta.starts, t)
    lora_expand(t, b, scale, meta.sorted_tokens, meta.starts, y)


def wrap_projections(model: nn.Module, slots: LoraSlots, step: LoraStep) -> int:
    """Replace each projection the slot pool has buffers for by a ``LoraLinear``."""
    count = 0
    for name in slots.a:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        current = getattr(owner, child)
        if isinstance(current, LoraLinear):
            continue
        setattr(owner, child, LoraLinear(current, name, slots, step))
        count += 1
    return count
