"""MoE experts quantized at load under tensor parallelism, to one process's numbers.

A rank holds every expert's slice of the intermediate size: ``gate_up_proj``
[E, 2I/size, H] (its gate rows, then its up rows) and ``down_proj`` [E, H, I/size]. FP8
and INT8 scale each (expert, output feature) row by its absolute maximum:

- gate/up rows are whole on a rank, so their scales are the ones one process computes;
- a down row is cut across the ranks, so its scale is the maximum over every rank's
  columns (one max all-reduce per layer at load), and each rank quantizes its columns
  with it. The partial outputs are summed by the experts' own all-reduce
  (``shard_model``'s reduced wrapper), as float experts are.

INT4 is refused: its CPU kernel rounds every expert's output to bf16, which one process
does once per expert on the whole sum, and a rank's partial cannot be rounded that way
before the experts' single all-reduce (a per-expert all-reduce would cost E collectives
per layer).
"""

from __future__ import annotations

import torch
from torch import nn

from worker.engine.distributed.tp_config import TPConfig
from worker.engine.runner.moe import fused_layout, is_experts_module
from worker.engine.runner.quant.apply import ignored
from worker.engine.runner.quant.config import QuantizationError, QuantScheme
from worker.engine.runner.quant.experts import (
    QuantizedExperts,
    ScaledExperts,
    attach,
    quantize_projection,
)
from worker.engine.runner.quant.tp_shard import quantize_rows_cut


def _cut_down(method: str, down: torch.Tensor) -> ScaledExperts:
    """down [E, H, I/size] float -> its quantized projection, each row scaled by its
    maximum over every rank's columns."""
    experts, hidden, inter = down.shape
    q, scale = quantize_rows_cut(method, down.reshape(experts * hidden, inter), cut=True)
    return ScaledExperts(q.view(experts, hidden, inter), scale.view(experts, hidden))


def quantize_sharded_experts(model: nn.Module, scheme: QuantScheme, tp: TPConfig) -> int:
    """Quantize this rank's slice of every SiLU-gated experts module one process would
    quantize (not ``ignored``); returns how many. Every rank walks the modules in the
    same order, so their max all-reduces pair up."""
    count = 0
    for name, mod in model.named_modules():
        name = name.removesuffix(".inner")  # the experts inside their reduced wrapper
        if not (is_experts_module(mod) and fused_layout(mod)) or ignored(name, scheme.ignore):
            continue
        if scheme.method not in ("int8", "fp8"):
            raise QuantizationError(
                f"{scheme.method} MoE experts ({name}) are not implemented with "
                f"tensor-parallel size {tp.size}: serve them at size 1, or unquantized")
        w13, w2 = mod.gate_up_proj, mod.down_proj  # [E, 2I/size, H], [E, H, I/size]
        quantized = QuantizedExperts(scheme.method, quantize_projection(scheme.method, w13, 0),
                                     _cut_down(scheme.method, w2), int(w13.shape[0]),
                                     int(w2.shape[2]))
        attach(mod, quantized)
        count += 1
    return count
