"""Quantized checkpoints in every format Ferry reads (compressed-tensors FP8 with per-channel
weights and dynamic per-token activations, compressed-tensors FP8 per-tensor with static
activations, ModelOpt FP8, compressed-tensors INT8, AWQ, GPTQ), built here by the reference
quantizer for a Llama, a Qwen3 and two MoEs (Mixtral's ``w1/w3/w2`` experts, Qwen3-MoE's
``gate_proj/up_proj/down_proj`` ones, quantized like the dense layers), load and serve; their
greedy tokens agree under vLLM's top-5 rule with the dequantized fp32 checkpoint's
(weight-only) or with the same layers computed in fp32 torch (FP8 W8A8, whose activation
rounding is part of the scheme; the experts run FP8 weights on unquantized activations),
and the layers and experts hold the dequantized weights (int4: up to the kernel's bf16
scales)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.worker.engine.runner.quant.agreement import (
    GREEDY,
    PROMPTS,
    assert_top5_agreement,
    checkpoint,
    dequantized_expert_reference,
    expert_weight_keys,
    fp8_reference_forward,
    generate,
)
from tests.worker.engine.runner.quant.quantizers import write_quantized

FORMATS = ["ct-fp8-channel", "ct-fp8-static", "modelopt", "ct-int8", "awq", "gptq"]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("quant-checkpoints")


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mixtral", "qwen3_moe"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_checkpoint_serves_like_its_dequantized_reference(
        root: Path, arch: str, fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    quantized, reference = write_quantized(checkpoint(arch, root), fmt, root)
    got = generate(quantized)
    if "fp8" in fmt or fmt == "modelopt":  # the same layers in fp32 torch (agreement.py)
        from worker.engine.runner.quant.experts import QuantizedExperts
        from worker.engine.runner.quant.fp8 import Fp8Linear

        monkeypatch.setattr(Fp8Linear, "forward", fp8_reference_forward)
        monkeypatch.setattr(QuantizedExperts, "expert", dequantized_expert_reference)
        assert_top5_agreement(got, generate(quantized))
    else:
        assert_top5_agreement(got, generate(reference))


@pytest.mark.parametrize("fmt", FORMATS)
def test_layers_hold_the_dequantized_weights(root: Path, fmt: str) -> None:
    from safetensors.torch import load_file

    from worker.engine.config import ModelConfig
    from worker.engine.runner.model_loader import load_model

    quantized, reference = write_quantized(checkpoint("llama", root), fmt, root)
    model = load_model(ModelConfig(quantized, pack_weights=False)).model
    want = load_file(str(Path(reference) / "model.safetensors"))
    layers = [(n, m) for n, m in model.named_modules() if hasattr(m, "dequantized")]
    assert len(layers) == 14  # q, k, v, o, gate, up, down in two layers
    for name, module in layers:
        torch.testing.assert_close(module.dequantized(), want[f"{name}.weight"],
                                   rtol=0, atol=1e-2 if fmt in ("awq", "gptq") else 1e-6)
    assert model.lm_head.weight is not None  # lm_head stays unquantized


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_experts_hold_the_dequantized_weights(root: Path, arch: str, fmt: str) -> None:
    from safetensors.torch import load_file

    from worker.engine.config import ModelConfig
    from worker.engine.runner.model_loader import load_model

    quantized, reference = write_quantized(checkpoint(arch, root), fmt, root)
    model = load_model(ModelConfig(quantized, pack_weights=False)).model
    want = load_file(str(Path(reference) / "model.safetensors"))
    layers = [(n, m.ferry_quantized) for n, m in model.named_modules()
              if hasattr(m, "ferry_quantized")]
    assert len(layers) == 2
    atol = 1e-2 if fmt in ("awq", "gptq") else 1e-6
    for name, experts in layers:
        w13, w2 = experts.dequantized()
        inter = w2.shape[2]
        for e, (gate, up, down) in enumerate(expert_weight_keys(want, name, w13.shape[0])):
            torch.testing.assert_close(w13[e, :inter], want[gate], rtol=0, atol=atol)
            torch.testing.assert_close(w13[e, inter:], want[up], rtol=0, atol=atol)
            torch.testing.assert_close(w2[e], want[down], rtol=0, atol=atol)


def test_a_checkpoint_with_float_experts_keeps_them_float(root: Path) -> None:
    """Experts a checkpoint left unquantized load as the float experts they are."""
    from worker.engine.llm import LLM

    quantized, reference = write_quantized(checkpoint("mixtral", root), "awq", root,
                                           experts=False)

    llm = LLM(quantized, kv_cache_blocks=64)
    experts = [m for m in llm.engine.runner.model.modules() if hasattr(m, "has_gate")]
    assert experts and all(not hasattr(m, "ferry_quantized") for m in experts)
    assert all(m.gate_up_proj.dtype == torch.float32 for m in experts)

    got = [o.choices[0] for o in llm.generate(PROMPTS, GREEDY)]
    assert_top5_agreement(got, generate(reference))
