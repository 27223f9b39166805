"""MoE layers through Ferry's kernels: the fused Triton kernel on CUDA, the grouped path on CPU.

Transformers stores every MoE family's experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
gpt-oss, ...) as one module of 3-D weights whose forward takes the router's choice
(``hidden [T, H], top_k_index [T, K], top_k_weights [T, K]``) and dispatches through its
``ExpertsInterface`` by ``config._experts_implementation``. Ferry registers its own entry
there and selects it at load, so the router, shared experts and everything around the
experts stay transformers' code; only the expert products change.

A module of the layout the fused kernel takes (concatenated gate/up rows, not transposed,
no biases, SiLU, no post-expert norm) on a CUDA device goes to ``kernels.moe.fused``;
every other module (the CPU, or gpt-oss's biased, transposed, clamped experts) goes to
``kernels.moe.grouped``, with the module's own gate function. Either way the result is the
module's eager forward up to fp32 summation order.

A module whose experts were quantized (``runner/quant/experts.py`` attaches them as
``ferry_quantized`` and deletes the float parameters) runs from its quantized weights:
FP8 and INT8 experts through the fused kernel on CUDA (with their per-feature scales),
every method through the grouped path with the quantized expert otherwise.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kernels.moe.grouped import Expert, grouped_moe

IMPLEMENTATION = "ferry_moe"


def is_experts_module(module: Any) -> bool:
    """True for a transformers experts module that dispatches through ``ExpertsInterface``
    (its float experts, or quantized ones in their place)."""
    return all(hasattr(module, a) for a in ("has_gate", "is_transposed", "has_bias",
                                            "_is_expert_parallel")) \
        and (hasattr(module, "down_proj") or hasattr(module, "ferry_quantized"))


def fused_layout(module: Any) -> bool:
    """Whether ``module``'s experts are the SiLU-gated ``w13 [E, 2I, H]``, ``w2 [E, H, I]``."""
    from transformers.activations import SiLUActivation
    from transformers.integrations.moe import _default_apply_gate

    return bool(module.has_gate and module.is_concatenated and not module.is_transposed
                and not module.has_bias and not module.has_post_expert_norm
                and isinstance(getattr(module, "act_fn", None), SiLUActivation | torch.nn.SiLU)
                and getattr(type(module)._apply_gate, "__wrapped__", type(module)._apply_gate)
                is _default_apply_gate)


def quantized_experts(module: Any) -> Any | None:
    """The module's ``QuantizedExperts`` (``runner/quant/experts.py``), or None: float."""
    return getattr(module, "ferry_quantized", None)


def expert_count(module: Any) -> int:
    quantized = quantized_experts(module)
    return int(quantized.num_experts if quantized is not None else module.down_proj.shape[0])


def module_expert(module: Any) -> Expert:
    """Expert ``e`` of ``module`` on ``rows`` [n, H], in the module's own layout and gate."""
    quantized = quantized_experts(module)
    if quantized is not None:
        return quantized.expert  # type: ignore[no-any-return]
    up = module.gate_up_proj if module.has_gate else module.up_proj
    up_bias = (module.gate_up_proj_bias if module.has_gate else module.up_proj_bias) \
        if module.has_bias else None
    down, down_bias = module.down_proj, module.down_proj_bias if module.has_bias else None

    def project(rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return rows @ w if module.is_transposed else F.linear(rows, w)

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        h = project(rows, up[e])  # [n, 2I] or [n, I]
        if up_bias is not None:
            h = h + up_bias[e]
        h = module._apply_gate(h) if module.has_gate else module.act_fn(h)  # [n, I]
        y = project(h, down[e])  # [n, H]
        if down_bias is not None:
            y = y + down_bias[e]
        return module.post_expert_norm(y) if module.has_post_expert_norm else y

    return expert


def takes_fused_kernel(hidden: torch.Tensor, module: Any) -> bool:
    """Whether this call goes to the Triton kernel: CUDA and the kernel's layout."""
    return hidden.is_cuda and fused_layout(module)


def experts_forward(
    module: Any,
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, K]
    top_k_weights: torch.Tensor,  # [T, K]
) -> torch.Tensor:
    """The ``ExpertsInterface`` entry: [T, H] in hidden_states' dtype."""
    if takes_fused_kernel(hidden_states, module):
        from kernels.moe.fused import fused_moe

        quantized = quantized_experts(module)
        if quantized is None:
            return fused_moe(hidden_states, module.gate_up_proj, module.down_proj,
                             top_k_index, top_k_weights)
        weights = quantized.fused_weights()  # None: int4, the grouped path
        if weights is not None:
            w13, w2, w13_scale, w2_scale = weights
            return fused_moe(hidden_states, w13, w2, top_k_index, top_k_weights,
                             w13_scale, w2_scale)
    return grouped_moe(hidden_states, top_k_index, top_k_weights, module_expert(module),
                       expert_count(module))


def register() -> None:
    """Make ``IMPLEMENTATION`` a valid ``experts_implementation`` (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, experts_forward)


def use_ferry_experts(model: Any) -> int:
    """Route every experts module of ``model`` through Ferry's kernels; returns their count."""
    count = sum(1 for m in model.modules() if is_experts_module(m))
    if count:
        register()
        model.set_experts_implementation(IMPLEMENTATION)
    return count
