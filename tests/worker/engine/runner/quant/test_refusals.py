"""What Ferry does not implement is refused at load with its name: the scheme, the group
size, the bit width, the layer type, a shape the kernel cannot take, and a second
quantization over an already quantized checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from protocol.sampling import SamplingParams
from tests.checkpoints import build_checkpoint
from tests.worker.engine.runner.quant.agreement import build_moe
from tests.worker.engine.runner.quant.quantizers import quantization_config, write_quantized
from worker.engine.runner.quant import (
    SUPPORTED_CHECKPOINT_METHODS,
    QuantizationError,
    QuantScheme,
)
from worker.engine.runner.quant.checkpoint_config import scheme_from_checkpoint
from worker.engine.runner.quant.config import scheme_at_load


def _ct(**changes: Any) -> dict[str, Any]:
    config = quantization_config("ct-fp8-channel", 32, ["lm_head"])
    group = config["config_groups"]["group_0"]
    for key, value in changes.items():
        if key in ("weights", "input_activations"):
            group[key] = None if value is None else {**(group[key] or {}), **value}
        else:
            config[key] = value
    return config


REFUSED = [
    ({"quant_method": "bitsandbytes"}, "'bitsandbytes' is not implemented"),
    ({"quant_method": "awq", "bits": 8, "group_size": 128}, "8-bit weights"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "'gemv'"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3-bit weights"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 48}, "group size 48"),
    ({"quant_method": "gptq", "bits": 4, "group_size": -1}, "group size -1"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True}, "desc_act"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128,
      "checkpoint_format": "marlin"}, "'marlin'"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "'NVFP4'"),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"},
     "kv_cache_quant_algo"),
    (_ct(input_activations=None), "W8A16"),
    (_ct(weights={"strategy": "group", "group_size": 128}), "'group'"),
    (_ct(input_activations={"strategy": "tensor", "dynamic": True}), "'tensor'"),
    (_ct(weights={"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
         input_activations=None, format="pack-quantized"), "format pack-quantized"),
    (_ct(kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"}), "KV cache"),
]


@pytest.mark.parametrize(("config", "named"), REFUSED)
def test_an_unimplemented_checkpoint_scheme_is_refused_by_name(config: dict[str, Any],
                                                                named: str) -> None:
    with pytest.raises(QuantizationError, match=named.replace("(", r"\(")):
        scheme_from_checkpoint(config)


def test_the_supported_methods_are_one_constant() -> None:
    assert {"compressed-tensors", "modelopt", "awq", "gptq"} == SUPPORTED_CHECKPOINT_METHODS
    assert issubclass(QuantizationError, ValueError)  # the loader's clear-error type


@pytest.mark.parametrize("method", ["int3", "nf4", "fp4", ""])
def test_an_unknown_method_at_load_is_refused(method: str) -> None:
    with pytest.raises(QuantizationError, match="fp8, int8, int4"):
        scheme_at_load(method) if method else QuantScheme("bf16")  # type: ignore[arg-type]


def test_fp8_refuses_a_shape_scaled_mm_cannot_take(tmp_path: Path) -> None:
    from worker.engine.llm import LLM

    src = build_checkpoint("llama", tmp_path, hidden=40)  # 40 is no multiple of 16
    with pytest.raises(QuantizationError, match=r"q_proj has shape \[40, 40\].*16"):
        LLM(src, kv_cache_blocks=16, quantization="fp8")


def test_partly_quantized_experts_are_refused_by_name(tmp_path: Path) -> None:
    """One expert's gate half written (no zeros, no scales, no up or down), the rest
    float: refused, naming the first missing tensor."""
    from worker.engine.llm import LLM

    quantized, _ = write_quantized(build_moe(tmp_path), "awq", tmp_path, experts=False)
    state = load_file(str(Path(quantized) / "model.safetensors"))
    state["model.layers.0.block_sparse_moe.experts.0.w1.qweight"] = torch.zeros(
        64, 16, dtype=torch.int32)
    save_file(state, str(Path(quantized) / "model.safetensors"))
    with pytest.raises(QuantizationError, match="no tensor .*experts.0.w1.qzeros"):
        LLM(quantized, kv_cache_blocks=16)


def test_a_quantized_router_is_refused_by_its_layer_type(tmp_path: Path) -> None:
    from worker.engine.llm import LLM

    quantized, _ = write_quantized(build_moe(tmp_path), "awq", tmp_path)
    state = load_file(str(Path(quantized) / "model.safetensors"))
    state["model.layers.0.block_sparse_moe.gate.qweight"] = torch.zeros(64, 1,
                                                                        dtype=torch.int32)
    save_file(state, str(Path(quantized) / "model.safetensors"))
    with pytest.raises(QuantizationError, match=r"block_sparse_moe.gate \(MixtralTopKRouter\)"):
        LLM(quantized, kv_cache_blocks=16)


def test_gptq_groups_out_of_order_are_refused(tmp_path: Path) -> None:
    from worker.engine.llm import LLM

    quantized, _ = write_quantized(build_checkpoint("llama", tmp_path), "gptq", tmp_path)
    state = load_file(str(Path(quantized) / "model.safetensors"))
    key = "model.layers.0.self_attn.q_proj.g_idx"
    state[key] = state[key].flip(0).contiguous()
    save_file(state, str(Path(quantized) / "model.safetensors"))
    with pytest.raises(QuantizationError, match="desc_act"):
        LLM(quantized, kv_cache_blocks=16)


def test_a_quantized_checkpoint_is_not_quantized_again(tmp_path: Path) -> None:
    from worker.engine.llm import LLM

    quantized, _ = write_quantized(build_checkpoint("llama", tmp_path), "awq", tmp_path)
    with pytest.raises(QuantizationError, match="already quantized \\(awq int4\\)"):
        LLM(quantized, kv_cache_blocks=16, quantization="int8")
    config = json.loads((Path(quantized) / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "awq"  # the file is untouched


def test_gpt_oss_experts_stay_float_under_quantization(tmp_path: Path) -> None:
    """gpt-oss's biased, transposed, clamped experts are not quantized at load: they stay
    in the model's dtype (the attention layers are quantized) and the model serves."""
    from tests.family_checkpoints import build_family
    from worker.engine.llm import LLM
    from worker.engine.runner.moe import is_experts_module

    llm = LLM(build_family("gpt_oss", tmp_path), kv_cache_blocks=16, quantization="int8")
    experts = [m for m in llm.engine.runner.model.modules() if is_experts_module(m)]
    assert experts and all(not hasattr(m, "ferry_quantized") for m in experts)
    assert all(m.gate_up_proj.dtype == torch.float32 for m in experts)
    out = llm.generate(["def f(x):"], SamplingParams(max_tokens=4, temperature=0.0,
                                                     ignore_eos=True))
    assert len(out[0].choices[0].token_ids) == 4
