"""Load-time refusals (worker/engine/runner/model_check.py): a checkpoint asking for a
feature Ferry does not implement is refused with the feature and the model named."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.family_checkpoints import build_family
from worker.engine.config import ModelConfig
from worker.engine.runner import model_check
from worker.engine.runner.attention import interface
from worker.engine.runner.model_loader import ModelShape, load_model


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return build_family("llama", tmp_path_factory.mktemp("check"))


def _copy_with_config(src: str, dst: Path, **changes: object) -> str:
    dst.mkdir()
    for f in Path(src).iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


def _load(path: str):  # type: ignore[no-untyped-def]
    return load_model(ModelConfig(model=path, device="cpu"))


def test_mla_outside_the_served_configs_is_refused_by_name(tmp_path):
    """DeepSeek-V2's MLA module (its own rope layout, not proven here): refused from the
    config, before any weight is read; DeepSeek-V3's is served (test_families.py)."""
    from transformers import DeepseekV2Config

    DeepseekV2Config(vocab_size=64, hidden_size=64, num_hidden_layers=2,
                     num_attention_heads=4, kv_lora_rank=16, q_lora_rank=32,
                     qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                     ).save_pretrained(tmp_path)
    with pytest.raises(model_check.UnservableModel,
                       match=r"multi-head latent attention \(MLA\).*DeepseekV2Config") as err:
        _load(str(tmp_path))
    assert str(tmp_path) in str(err.value)


@pytest.mark.parametrize("method", ["fp8", "bitsandbytes", "hqq", "eetq"])
def test_every_quantization_not_supported_is_refused(llama, tmp_path, method):
    path = _copy_with_config(llama, tmp_path / "q", quantization_config={
        "quant_method": method, "bits": 4})
    with pytest.raises(model_check.UnservableModel, match=rf"quantization \({method}\)"):
        _load(path)


@pytest.mark.parametrize("method", sorted(model_check.SUPPORTED_QUANT_METHODS))
def test_a_served_format_with_a_config_it_cannot_read_is_refused_by_name(llama, tmp_path,
                                                                        method):
    """The formats the quant package serves pass the check; a config of theirs that lacks
    what the format needs is still a clear refusal, never a silent load."""
    from worker.engine.runner.quant import QuantizationError

    path = _copy_with_config(llama, tmp_path / "q", quantization_config={
        "quant_method": method, "bits": 4})
    with pytest.raises(QuantizationError):
        _load(path)


def test_an_unknown_quant_method_is_refused(llama, tmp_path):
    path = _copy_with_config(llama, tmp_path / "q", quantization_config={
        "quant_method": "magic-int3"})
    with pytest.raises(model_check.UnservableModel, match="unknown quant_method 'magic-int3'"):
        _load(path)
    path = _copy_with_config(llama, tmp_path / "n", quantization_config={"bits": 4})
    with pytest.raises(model_check.UnservableModel, match="unknown quant_method None"):
        _load(path)


def test_a_supported_method_passes_the_config_check(monkeypatch):
    """The one list the quantized-serving code extends."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(quantization_config={"quant_method": "fp8"})
    with pytest.raises(model_check.UnservableModel):
        model_check.check_config(cfg, "m")
    assert "awq" in model_check.SUPPORTED_QUANT_METHODS  # the quant package's formats
    monkeypatch.setattr(model_check, "SUPPORTED_QUANT_METHODS", frozenset({"fp8"}))
    model_check.check_config(cfg, "m")


def test_fp8_weights_without_scales_are_refused(tmp_path):
    from safetensors.torch import save_file

    w = torch.zeros(4, 4).to(torch.float8_e4m3fn)
    save_file({"layers.0.q_proj.weight": w}, str(tmp_path / "model.safetensors"))
    with pytest.raises(model_check.UnservableModel,
                       match="fp8 weights without scales.*layers.0.q_proj.weight"):
        model_check.check_weights(str(tmp_path), "m")
    save_file({"layers.0.q_proj.weight": w, "layers.0.q_proj.weight_scale_inv": torch.ones(1)},
              str(tmp_path / "model.safetensors"))
    model_check.check_weights(str(tmp_path), "m")


def test_fp8_weights_without_scales_refuse_the_load(llama, tmp_path):
    """A checkpoint whose config lost its quantization section, weights still fp8."""
    from safetensors.torch import load_file, save_file

    path = _copy_with_config(llama, tmp_path / "f")
    weights = load_file(f"{path}/model.safetensors")
    name = next(k for k in weights if k.endswith("q_proj.weight"))
    weights[name] = weights[name].to(torch.float8_e4m3fn)
    save_file(weights, f"{path}/model.safetensors")
    with pytest.raises(model_check.UnservableModel, match="fp8 weights without scales"):
        _load(path)


def test_an_attention_keyword_ferry_drops_is_refused_at_load(llama, monkeypatch):
    """The probe forward: a keyword the attention function would ignore stops the load."""
    monkeypatch.setattr(interface, "IGNORED_KWARGS", interface.IGNORED_KWARGS - {"position_ids"})
    with pytest.raises(model_check.UnservableModel, match="position_ids") as err:
        _load(llama)
    assert llama in str(err.value) and "LlamaAttention" in str(err.value)


class _Layer(torch.nn.Module):
    layer_idx = 3


@pytest.mark.parametrize(("mask", "kwargs", "match"), [
    (torch.zeros(1, 1, 2, 2), {}, "attention mask tensor"),
    (None, {"is_causal": False}, "non-causal"),
    (None, {"sinks_v2": torch.zeros(2)}, "sinks_v2"),
])
def test_check_kwargs_refuses(mask, kwargs, match):
    with pytest.raises(interface.UnsupportedAttention, match=match):
        interface.check_kwargs(_Layer(), mask, kwargs)
    interface.check_kwargs(_Layer(), None, {"is_causal": True, "use_cache": False,
                                            "unused": None})


_SHAPE = ModelShape(num_layers=2, num_kv_heads=2, head_dim=16, vocab_size=64,
                    max_model_len=64)


@pytest.mark.parametrize(("calls", "match"), [
    ([((3, 4, 16), (3, 2, 16), (3, 2, 16))], "share or skip"),
    ([((3, 4, 24), (3, 2, 24), (3, 2, 16))] * 2, "head sizes"),
    ([((3, 4, 16), (3, 2, 16), (3, 2, 12))] * 2, "head sizes"),
    ([((3, 4, 16), (3, 1, 16), (3, 1, 16))] * 2, "layout of attention heads"),
])
def test_attention_calls_that_do_not_fit_the_cache_are_refused(calls, match):
    with pytest.raises(model_check.UnservableModel, match=match):
        model_check._check_calls(calls, "m", _SHAPE)
    model_check._check_calls([((3, 4, 16), (3, 2, 16), (3, 2, 16))] * 2, "m", _SHAPE)
    # values narrower than keys fit a cache built for them (MLA expanded per head)
    model_check._check_calls([((3, 4, 24), (3, 2, 24), (3, 2, 12))] * 2, "m",
                             replace(_SHAPE, head_dim=24, v_head_dim=12))
