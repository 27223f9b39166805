"""A quantized checkpoint's per-expert linear layers, read into ``QuantizedExperts``.

Checkpoints store an MoE layer's experts as separate linear layers, each quantized like a
dense one (``formats.py`` reads its tensors): Mixtral's ``block_sparse_moe.experts.{e}.w1``
(gate), ``w3`` (up), ``w2`` (down), or Qwen2/Qwen3-MoE's, OLMoE's and DeepSeek's
``mlp.experts.{e}.gate_proj``, ``up_proj``, ``down_proj``. Transformers renames
``block_sparse_moe`` to ``mlp`` and fuses the float experts into 3-D parameters; here the
quantized ones are gathered the same way: gate rows then up rows per expert (``w13``),
stacked over experts. A per-tensor FP8 scale becomes one scale per output feature (the
same weight): gate and up rows of one expert may carry different scales.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from worker.engine.runner.quant.config import QuantizationError, QuantScheme
from worker.engine.runner.quant.experts import (
    Int4Experts,
    Projection,
    QuantizedExperts,
    ScaledExperts,
)
from worker.engine.runner.quant.formats import TensorSource, read_int4, read_scaled
from worker.engine.runner.quant.int4 import Int4Linear


class ExpertTensors(TensorSource, Protocol):
    """What ``read_experts`` reads (the whole checkpoint's ``CheckpointTensors``, or one
    rank's cut of it): a tensor source that also says what it holds."""

    def has(self, key: str) -> bool: ...


# (gate, up, down) names of one expert's linear layers
EXPERT_LINEARS = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))


def checkpoint_prefixes(module_name: str) -> list[str]:
    """Where the experts of model module ``module_name`` may sit in a checkpoint."""
    names = [module_name]
    if module_name.endswith(".mlp.experts"):  # Mixtral's original name
        names.append(module_name[: -len(".mlp.experts")] + ".block_sparse_moe.experts")
    return names


def _layout(scheme: QuantScheme, module_name: str,
            tensors: ExpertTensors) -> tuple[str, tuple[str, str, str]] | None:
    probe = "qweight" if scheme.method == "int4" else "weight_scale"
    for prefix in checkpoint_prefixes(module_name):
        for names in EXPERT_LINEARS:
            if tensors.has(f"{prefix}.0.{names[0]}.{probe}"):
                return prefix, names
    return None


def read_experts(scheme: QuantScheme, module_name: str, module: Any,
                 tensors: ExpertTensors,
                 device: torch.device | None = None,
                 ) -> tuple[QuantizedExperts, list[str]] | None:
    """The quantized experts of ``module`` (a transformers experts module named
    ``module_name``; shaped as this process holds them, a rank's slice under tensor
    parallelism) and the checkpoint's linear names they take; None when the checkpoint
    holds them unquantized. ``device``: where they go (default: the module's)."""
    found = _layout(scheme, module_name, tensors)
    if found is None:
        return None
    prefix, (gate, up, down) = found
    experts, two_i, hidden = module.gate_up_proj.shape
    inter = two_i // 2
    device = device or module.gate_up_proj.device
    shapes = {gate: (inter, hidden), up: (inter, hidden), down: (hidden, inter)}
    names = [[f"{prefix}.{e}.{p}" for p in (gate, up, down)] for e in range(experts)]
    if scheme.method == "int4":
        w13: Projection = Int4Experts([_int4(scheme, (g, u), shapes, tensors, device)
                                       for g, u, _ in names])
        w2: Projection = Int4Experts([_int4(scheme, (d,), shapes, tensors, device)
                                      for _, _, d in names])
    else:
        w13 = _scaled(scheme, [(g, u) for g, u, _ in names], shapes, tensors, device)
        w2 = _scaled(scheme, [(d,) for _, _, d in names], shapes, tensors, device)
    quantized = QuantizedExperts(scheme.method, w13, w2, experts, inter)
    return quantized, [n for row in names for n in row]


def _check(name: str, got: tuple[int, ...], shapes: dict[str, tuple[int, int]]) -> None:
    want = shapes[name.rpartition(".")[2]]
    if tuple(got) != want:
        raise QuantizationError(f"{name}: quantized expert of shape {list(got)}, the model "
                                f"expects {list(want)}")


def _scaled(scheme: QuantScheme, experts: list[tuple[str, ...]],
            shapes: dict[str, tuple[int, int]], tensors: TensorSource,
            device: torch.device) -> ScaledExperts:
    """fp8/int8: per expert, its layers' rows concatenated; one fp32 scale per row."""
    weights, scales = [], []
    for layers in experts:
        rows, row_scales = [], []
        for name in layers:
            w, s, _ = read_scaled(scheme, name, tensors)  # static input scales: unused
            _check(name, tuple(w.shape), shapes)
            s = s.reshape(-1)
            if s.numel() not in (1, w.shape[0]):
                raise QuantizationError(f"{name}.weight_scale has {s.numel()} values for "
                                        f"{w.shape[0]} rows")
            rows.append(w)
            row_scales.append(s.expand(w.shape[0]))
        weights.append(torch.cat(rows))
        scales.append(torch.cat(row_scales))
    return ScaledExperts(torch.stack(weights).to(device), torch.stack(scales).to(device))


def _int4(scheme: QuantScheme, layers: tuple[str, ...], shapes: dict[str, tuple[int, int]],
          tensors: TensorSource, device: torch.device) -> Int4Linear:
    """int4: one expert's layers' rows concatenated (q, scale, zero), on ``device``."""
    parts = []
    for name in layers:
        q, scale, zero = read_int4(scheme, name, tensors)
        _check(name, tuple(q.shape), shapes)
        parts.append((q, scale, zero))
    q, scale, zero = (torch.cat([p[i] for p in parts]).to(device) for i in range(3))
    return Int4Linear(q, scale, zero, scheme.group_size, None)
