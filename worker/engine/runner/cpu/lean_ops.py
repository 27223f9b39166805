"""The ops of the lean CPU path, each the one a transformers module runs, op for op.

A family's modules differ in a few formulas: the RMSNorm (Llama's ``w * x.to(dtype)``
or Gemma's ``(x * (1 + w)).type_as(x)``), the MLP (separate gate and up projections, or
Phi-3's fused ``gate_up_proj``, or a sparse MoE block) and partial rotary. Each is built
here once per module at load, as a closure over the module's weights and bound forwards,
so the layer loop calls plain functions. Every closure repeats its module's ops in the
module's order, which is what makes the lean path's logits bit-for-bit the module path's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kernels.moe.grouped import grouped_moe
from worker.engine.runner.moe import (
    IMPLEMENTATION,
    expert_count,
    is_experts_module,
    module_expert,
)

Fn = Callable[[torch.Tensor], torch.Tensor]
# RMSNorm classes by formula: Llama's (``variance_epsilon``) and Gemma's 1 + w (``eps``)
RMS_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm",
                       "Phi3RMSNorm", "MixtralRMSNorm", "Qwen3MoeRMSNorm"})
GEMMA_NORMS = frozenset({"Gemma2RMSNorm", "Gemma3RMSNorm"})
# sparse MoE blocks whose forward is: flatten, router, experts (no shared expert, no noise
# at inference)
MOE_BLOCKS = frozenset({"MixtralSparseMoeBlock", "Qwen3MoeSparseMoeBlock"})


class NotReproduced(ValueError):
    """A module the lean path has no op-for-op copy of (the model keeps the module path)."""


def norm_fn(module: Any, kind: str) -> Fn:
    """The closure of an RMSNorm module of formula ``kind`` (``rms`` or ``rms_1p``)."""
    name = type(module).__name__
    if kind == "rms" and name in RMS_NORMS:
        return _rms_norm(module.weight, float(module.variance_epsilon))
    if kind == "rms_1p" and name in GEMMA_NORMS:
        return _rms_norm_1p(module.weight, float(module.eps))
    raise NotReproduced(f"norm {name} is not a {kind} norm the lean path reproduces")


def _rms_norm(weight: torch.Tensor, eps: float) -> Fn:
    def norm(x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H], LlamaRMSNorm
        dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + eps)
        return weight * x.to(dtype)
    return norm


def _rms_norm_1p(weight: torch.Tensor, eps: float) -> Fn:
    scale = 1.0 + weight.float()  # the module computes this very sum each call

    def norm(x: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., H], Gemma's RMSNorm
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + eps)
        return (out * scale).type_as(x)
    return norm


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [T, H, D] by cos/sin [T, 1, R]: the first R dims rotate, the
    rest pass (R < D is partial rotary, as Phi-3's ``apply_rotary_pos_emb``)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return (x * cos) + (_rotate_half(x) * sin)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat([(x_rot * cos) + (_rotate_half(x_rot) * sin), x_pass], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def mlp_fn(mlp: Any) -> Fn:
    """The closure of a decoder layer's feed-forward module ([T, H] -> [T, H])."""
    if type(mlp).__name__ in MOE_BLOCKS:
        return _moe(mlp)
    if hasattr(mlp, "experts") or hasattr(mlp, "router"):
        raise NotReproduced(f"MoE block {type(mlp).__name__}")
    if hasattr(mlp, "gate_up_proj"):  # Phi-3: one projection, gate half first
        gate_up, down = mlp.gate_up_proj.forward, mlp.down_proj.forward
        act = mlp.activation_fn.forward

        def fused(x: torch.Tensor) -> torch.Tensor:
            up = gate_up(x)  # [T, 2I]
            gate, up = up.chunk(2, dim=-1)
            return down(up * act(gate))  # type: ignore[no-any-return]
        return fused
    if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        raise NotReproduced(f"feed-forward {type(mlp).__name__}")
    gate, up, down, act = (mlp.gate_proj.forward, mlp.up_proj.forward,
                           mlp.down_proj.forward, mlp.act_fn.forward)

    def gated(x: torch.Tensor) -> torch.Tensor:
        return down(act(gate(x)) * up(x))  # type: ignore[no-any-return]
    return gated


def _moe(block: Any) -> Fn:
    """A sparse MoE block as its forward runs it: the router module, then the experts
    through Ferry's grouped path (what ``moe.experts_forward`` runs on the CPU)."""
    experts = block.experts
    if not is_experts_module(experts) or getattr(
            experts.config, "_experts_implementation", None) != IMPLEMENTATION:
        raise NotReproduced(f"{type(block).__name__}'s experts do not take Ferry's grouped path")
    router = block.gate.forward
    expert = module_expert(experts)
    num_experts = expert_count(experts)

    def moe(x: torch.Tensor) -> torch.Tensor:  # [T, H]
        _, weights, index = router(x)  # [T, K] each
        return grouped_moe(x, index, weights, expert, num_experts)
    return moe
