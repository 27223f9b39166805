"""Quantized experts of real MoE modules (tiny Mixtral and Qwen3-MoE), through
``runner/moe.experts_forward``, equal the naive per-expert loop of ``kernels.reference`` on
their dequantized weights: the grouped CPU path for fp8, int8 and int4, and the fused
Triton kernel (interpreted on the CPU) for fp8 and int8, fp32 and bf16 activations, on a
batch, one token, and a routing that leaves experts unchosen."""

from __future__ import annotations

import os

import pytest
import torch

from kernels import reference
from tests.checkpoints import build_checkpoint
from worker.engine.runner import moe
from worker.engine.runner.quant.experts import QuantizedExperts, attach, quantize_projection

# (atol, rtol): fp32 rows through fp8/int8 experts are the dequantized product up to fp32
# rounding; int4's CPU kernel takes bf16 activations; bf16 activations round everywhere
TOL = {"fp32": (1e-4, 1e-4), "int4": (3e-2, 3e-2), "bf16": (2e-2, 2e-2)}


def _quantized_module(arch: str, method: str, root) -> tuple[object, int, int]:
    """The first experts module of ``arch``, its experts quantized by ``method``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_checkpoint(arch, root),
                                                 dtype=torch.float32).eval()
    module = next(m for m in model.modules() if moe.is_experts_module(m))
    w13, w2 = module.gate_up_proj.detach(), module.down_proj.detach()
    group = 32 if method == "int4" else 0
    attach(module, QuantizedExperts(method, quantize_projection(method, w13, group),
                                    quantize_projection(method, w2, group),
                                    w13.shape[0], w2.shape[2]))
    return module, model.config.num_experts_per_tok, model.config.hidden_size


def _routings(experts: int, top_k: int):
    gen = torch.Generator().manual_seed(experts + top_k)

    def pick(tokens: int, pool: int) -> torch.Tensor:
        return torch.stack([torch.randperm(pool, generator=gen)[:top_k] for _ in range(tokens)])
    for name, ids in (("batch", pick(11, experts)), ("one_token", pick(1, experts)),
                      ("empty_experts", pick(6, max(top_k, experts // 2)))):
        x = torch.randn(ids.shape[0], 64, generator=gen) / 4  # outputs of order 1: the
        # test models' weights are N(0, 0.2), and bf16's absolute error grows with them
        yield name, x, ids, torch.softmax(torch.randn(ids.shape, generator=gen), -1)


def _check(module, top_k: int, dtype: torch.dtype, tol: tuple[float, float]) -> None:
    quantized = module.ferry_quantized
    w13, w2 = quantized.dequantized()
    for name, x, ids, w in _routings(quantized.num_experts, top_k):
        x, w = x.to(dtype), w.to(dtype)
        with torch.no_grad():
            got = moe.experts_forward(module, x, ids, w)
        want = reference.moe_experts(x, w13, w2, ids, w)
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, atol=tol[0], rtol=tol[1],
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("method", ["fp8", "int8", "int4"])
def test_grouped_path_runs_the_quantized_experts(arch, method, tmp_path_factory) -> None:
    module, top_k, _ = _quantized_module(arch, method, tmp_path_factory.mktemp(arch))
    assert not hasattr(module, "gate_up_proj")  # the float experts are gone
    _check(module, top_k, torch.float32, TOL["int4" if method == "int4" else "fp32"])


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("method", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_kernel_runs_the_quantized_experts(arch, method, dtype, tmp_path_factory,
                                                 monkeypatch) -> None:
    if os.environ.get("TRITON_INTERPRET", "") in ("", "0"):
        pytest.skip("the Triton kernel needs a GPU or TRITON_INTERPRET=1 (ops/test.sh sets it)")
    from kernels.moe import fused

    calls, kernel = [], fused.fused_moe
    monkeypatch.setattr(moe, "takes_fused_kernel", lambda hidden, module: moe.fused_layout(module))
    monkeypatch.setattr(fused, "fused_moe", lambda *a: calls.append(a) or kernel(*a))
    module, top_k, _ = _quantized_module(arch, method, tmp_path_factory.mktemp(arch))
    _check(module, top_k, dtype, TOL["fp32" if dtype == torch.float32 else "bf16"])
    assert calls and all(a[5] is not None for a in calls)  # with the per-feature scales
