"""Loading PEFT adapters: scaling, and a clear ``LoraError`` for every bad adapter."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.worker.engine.lora_adapters import ATTN, write_adapter
from worker.engine.lora.adapter import LoraError, load_adapter
from worker.engine.lora.targets import BaseTargets, base_targets


def _tiny(hidden: int = 32, layers: int = 2) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=hidden * 2,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg)


@pytest.fixture(scope="module")
def base() -> BaseTargets:
    return base_targets(_tiny(), "tiny-llama")


def test_base_targets_lists_every_projection(base: BaseTargets) -> None:
    assert len(base.shapes) == 2 * 7
    assert base.shapes["model.layers.0.self_attn.k_proj"].out_features == 16  # 2 kv heads
    assert base.shapes["model.layers.1.mlp.down_proj"].in_features == 64


@pytest.mark.parametrize("rslora", [False, True])
def test_loads_weights_and_scale(tmp_path: Path, base: BaseTargets, rslora: bool) -> None:
    path = write_adapter(tmp_path / "a", base, rank=16, alpha=32, targets=ATTN, rslora=rslora)
    adapter = load_adapter("a", path, base, max_rank=64)
    assert adapter.rank == 16
    assert adapter.scale == pytest.approx(32 / math.sqrt(16) if rslora else 2.0)
    assert set(adapter.weights) == {m for m in base.shapes if m.endswith(ATTN)}
    a, b = adapter.weights["model.layers.1.self_attn.v_proj"]
    assert a.shape == (16, 32) and b.shape == (16, 16)


def _error(path: str | Path, base: BaseTargets, max_rank: int = 64) -> str:
    with pytest.raises(LoraError) as info:
        load_adapter("bad", path, base, max_rank=max_rank)
    return str(info.value)


def test_rank_over_the_limit(tmp_path: Path, base: BaseTargets) -> None:
    path = write_adapter(tmp_path / "a", base, rank=16)
    assert "rank 16 is over this worker's limit max_lora_rank=8" in _error(path, base, 8)


def test_adapter_of_another_base_model(tmp_path: Path, base: BaseTargets) -> None:
    other = base_targets(_tiny(hidden=48), "other-llama")
    path = write_adapter(tmp_path / "a", other)
    message = _error(path, base)
    assert "another base model" in message and "'other-llama'" in message
    deeper = base_targets(_tiny(layers=3), "deep-llama")
    assert "has no module model.layers.2" in _error(write_adapter(tmp_path / "b", deeper), base)


def test_missing_and_unsupported_targets(tmp_path: Path, base: BaseTargets) -> None:
    path = write_adapter(tmp_path / "a", base, targets=("q_proj",),
                         target_modules=["q_proj", "v_proj"])
    assert "target module v_proj is listed" in _error(path, base)
    path = write_adapter(tmp_path / "b", base, targets=("q_proj",),
                         target_modules=["q_proj", "lm_head"])
    assert "target module lm_head is not supported" in _error(path, base)
    path = write_adapter(tmp_path / "c", base, targets=("q_proj",))
    tensors = load_file(f"{path}/adapter_model.safetensors")
    tensors["base_model.model.model.embed_tokens.lora_A.weight"] = torch.zeros(8, 64)
    tensors["base_model.model.model.embed_tokens.lora_B.weight"] = torch.zeros(32, 8)
    save_file(tensors, f"{path}/adapter_model.safetensors")
    assert "target module embed_tokens" in _error(path, base)


def test_missing_half_or_wrong_rank(tmp_path: Path, base: BaseTargets) -> None:
    path = write_adapter(tmp_path / "a", base, targets=("q_proj",))
    tensors = load_file(f"{path}/adapter_model.safetensors")
    del tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    save_file(tensors, f"{path}/adapter_model.safetensors")
    assert "has no lora_B weight" in _error(path, base)
    path = write_adapter(tmp_path / "b", base, rank=8, targets=("q_proj",))
    cfg = json.loads(Path(f"{path}/adapter_config.json").read_text())
    Path(f"{path}/adapter_config.json").write_text(json.dumps({**cfg, "r": 4}))
    assert "says r=4" in _error(path, base)


def test_corrupt_and_missing_files(tmp_path: Path, base: BaseTargets) -> None:
    assert "is not a directory" in _error(tmp_path / "nowhere", base)
    path = Path(write_adapter(tmp_path / "a", base))
    blob = (path / "adapter_model.safetensors").read_bytes()
    (path / "adapter_model.safetensors").write_bytes(blob[: len(blob) // 2])
    assert "corrupt or unreadable" in _error(path, base)
    (path / "adapter_model.safetensors").unlink()
    assert "no adapter_model.safetensors" in _error(path, base)
    (path / "adapter_config.json").write_text("{not json")
    assert "not valid JSON" in _error(path, base)
    (path / "adapter_config.json").unlink()
    assert "no adapter_config.json" in _error(path, base)


@pytest.mark.parametrize("extra, words", [
    ({"use_dora": True}, "DoRA"), ({"bias": "all"}, "bias='all'"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"), ({"peft_type": "IA3"}, "IA3"),
    ({"r": 0}, "positive integer"), ({"lora_alpha": "x"}, "lora_alpha"),
])
def test_unsupported_config(tmp_path: Path, base: BaseTargets, extra: dict, words: str) -> None:
    path = write_adapter(tmp_path / "a", base, targets=("q_proj",), **extra)
    assert words in _error(path, base)
