"""``quantization=fp8|int8|int4`` quantizes a float checkpoint at load (the same setting as
``--quantization`` and ``FERRY_QUANTIZATION``), MoE experts included; greedy tokens agree
with a float model holding the dequantized weights under vLLM's top-5 rule, and the
weights (the experts' too) take the bytes the method promises."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

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
from worker.engine.config import EngineConfig


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("quant-at-load")


def _dequantized_copy(model: Any, src: str, out: Path) -> str:
    """``src`` with every quantized module's weight replaced by its dequantized value."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(Path(src) / "model.safetensors"))
    for name, module in model.named_modules():
        if hasattr(module, "dequantized") and f"{name}.weight" in state:  # linear layers
            state[f"{name}.weight"] = module.dequantized().contiguous()
    for name, module in model.named_modules():
        quantized = getattr(module, "ferry_quantized", None)
        if quantized is None:
            continue
        w13, w2 = quantized.dequantized()  # [E, 2I, H], [E, H, I]
        inter = w2.shape[2]
        for e, (gate, up, down) in enumerate(expert_weight_keys(state, name, w13.shape[0])):
            state[gate], state[up] = w13[e, :inter].clone(), w13[e, inter:].clone()
            state[down] = w2[e].clone()
    emb = model.get_input_embeddings()
    if hasattr(emb, "table"):  # int8 embedding (and the tied head's rows)
        state["model.embed_tokens.weight"] = emb.table.dequantized().contiguous()
    shutil.copytree(src, out)
    save_file(state, str(out / "model.safetensors"))
    return str(out)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mixtral", "qwen3_moe"])
@pytest.mark.parametrize("method", ["fp8", "int8", "int4"])
def test_quantized_at_load_serves_like_its_dequantized_weights(
        root: Path, arch: str, method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.engine.llm import LLM

    src = checkpoint(arch, root)
    llm = LLM(src, kv_cache_blocks=64, quantization=method)
    model = llm.engine.runner.model
    kinds = {type(m).__name__ for m in model.modules()}
    assert {"fp8": "Fp8Linear", "int8": "Int8Linear", "int4": "Int4Linear"}[method] in kinds
    assert "Linear" not in kinds or method == "fp8"  # fp8 keeps the head in float
    if "moe" in arch or arch == "mixtral":
        assert "QuantizedExperts" in kinds
        assert not any(hasattr(m, "gate_up_proj") for m in model.modules())  # freed
        assert llm.engine.runner.lean is not None  # the lean CPU decode runs them too
    got = [o.choices[0] for o in llm.generate(PROMPTS, GREEDY)]
    if method == "fp8":  # W8A8: the same layers in fp32 torch (agreement.py)
        from worker.engine.runner.quant.experts import QuantizedExperts
        from worker.engine.runner.quant.fp8 import Fp8Linear

        monkeypatch.setattr(Fp8Linear, "forward", fp8_reference_forward)
        monkeypatch.setattr(QuantizedExperts, "expert", dequantized_expert_reference)
        assert_top5_agreement(got, generate(src, quantization="fp8"))
        return
    reference = _dequantized_copy(model, src, root / f"{arch}-{method}-ref")
    assert_top5_agreement(got, generate(reference))


def test_the_setting_reaches_the_engine_config_from_the_environment() -> None:
    config = EngineConfig.from_env("some/model", {"FERRY_QUANTIZATION": "int8"})
    assert config.model.quantization == "int8"
    assert EngineConfig.from_env("some/model", {}).model.quantization is None


def test_int4_weights_are_packed_nibbles() -> None:
    from worker.engine.runner.quant.int4 import Int4Linear, quantize_groups

    weight = torch.randn(64, 128)
    q, scale, zero = quantize_groups(weight, 32)
    layer = Int4Linear(q, scale, zero, 32, None)
    assert layer.packed.numel() == 64 * 128 // 2 and layer.packed.dtype == torch.uint8
    want = ((q.view(64, 4, 32) - zero[..., None]) * scale[..., None]).view(64, 128)
    torch.testing.assert_close(layer.dequantized(), want, rtol=0, atol=2e-2)


@pytest.mark.parametrize(("rows", "group"), [(128, 32), (192, 64)])
def test_int4_embedding_rows_are_the_dequantized_table(rows: int, group: int) -> None:
    from worker.engine.runner.quant.int4 import Int4Embedding, Int4Linear, quantize_groups

    table = Int4Linear(*quantize_groups(torch.randn(rows, 128), group), group, None)
    ids = torch.tensor([[0, 31, 32, 63], [64, 100, rows - 1, 5]])  # both nibbles, blocks
    got = Int4Embedding(table, torch.float32)(ids)
    assert got.shape == (2, 4, 128)
    torch.testing.assert_close(got, table.dequantized()[ids], rtol=0, atol=0)


def test_int4_stores_the_head_and_embedding_in_int4(root: Path) -> None:
    from worker.engine.llm import LLM
    from worker.engine.runner.quant.int4 import Int4Embedding, Int4Linear

    model = LLM(checkpoint("qwen3", root), kv_cache_blocks=16,
                quantization="int4").engine.runner.model
    assert type(model.get_output_embeddings()) is Int4Linear  # vocab 384: 64-row blocks
    emb = model.get_input_embeddings()
    assert type(emb) is Int4Embedding and emb.table is model.get_output_embeddings()  # tied


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_quantized_experts_take_the_promised_bytes(root: Path, arch: str) -> None:
    """Experts' bytes, exactly: int8 and fp8 one byte a weight plus an fp32 scale a row;
    int4 half a byte a weight plus a bf16 scale and zero a group (128 columns, or the
    largest of 64 and 32 that divides the width). Against fp32 that is <= 0.28x and
    <= 0.16x at these tiny widths (a 32-column row pays its scale over 32 weights only)."""
    from worker.engine.config import ModelConfig
    from worker.engine.runner.model_loader import load_model
    from worker.engine.runner.quant.experts import experts_bytes

    src = checkpoint(arch, root)
    model = load_model(ModelConfig(src, pack_weights=False)).model
    full = experts_bytes(model)
    shapes = [(m.gate_up_proj.shape, m.down_proj.shape) for m in model.modules()
              if hasattr(m, "gate_up_proj") and hasattr(m, "has_gate")]
    weights = sum(a.numel() + b.numel() for a, b in shapes)
    rows = sum(a[0] * (a[1] + b[1]) for a, b in shapes)
    group = lambda k: next(g for g in (128, 64, 32) if k % g == 0)  # noqa: E731
    groups = sum(a.numel() // group(a[2]) + b.numel() // group(b[2]) for a, b in shapes)
    want = {"fp8": weights + 4 * rows, "int8": weights + 4 * rows,
            "int4": weights // 2 + 4 * groups}
    for method, nbytes in want.items():
        got = experts_bytes(load_model(ModelConfig(src, quantization=method)).model)
        assert got == nbytes, (method, got, nbytes)
        assert got / full <= (0.16 if method == "int4" else 0.28), (method, got / full)
    assert full == 4 * weights
