"""Loading PEFT adapters: scaling, and a clear ``LoraError`` for every bad adapter.

Every refusal names the problem (and the tensor, where one is at fault) and never the
adapter's path on the server: ``_error`` checks that for each of them.
"""

from __future__ import annotations

import json
import math
import os
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
    message = str(info.value)
    assert str(Path(path).parent) not in message and "pytest-of" not in message, message
    assert len(message) < 400, message
    return message


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
    """A missing directory or file, or one that is not a regular file, is the same
    message: it tells nothing about the server's filesystem."""
    missing = "adapter files are missing or unreadable"
    assert missing in _error(tmp_path / "nowhere", base)
    path = Path(write_adapter(tmp_path / "a", base))
    assert missing in _error(path / "adapter_config.json", base)  # a file, not a directory
    blob = (path / "adapter_model.safetensors").read_bytes()
    (path / "adapter_model.safetensors").write_bytes(blob[: len(blob) // 2])
    assert "adapter_model.safetensors is corrupt or unreadable" in _error(path, base)
    (path / "adapter_model.safetensors").unlink()
    assert missing in _error(path, base)
    os.mkfifo(path / "adapter_model.safetensors")  # opening it would wait for a writer
    assert missing in _error(path, base)
    (path / "adapter_config.json").write_text("{not json")
    assert "not valid JSON (Expecting property name" in _error(path, base)
    (path / "adapter_config.json").unlink()
    assert missing in _error(path, base)
    (path / "adapter_config.json").mkdir()
    assert missing in _error(path, base)
    (path / "adapter_config.json").rmdir()
    os.mkfifo(path / "adapter_config.json")
    assert missing in _error(path, base)


def _config(path: str) -> dict:
    return json.loads(Path(path, "adapter_config.json").read_text())


def test_deep_large_and_non_finite_configs(tmp_path: Path, base: BaseTargets) -> None:
    """A config nested 100,000 deep is refused before it is parsed (no RecursionError);
    one over 1 MiB before it is read whole; NaN and Infinity are not JSON."""
    path = write_adapter(tmp_path / "a", base, targets=("q_proj",))
    config = Path(path, "adapter_config.json")
    good = config.read_text()
    config.write_text(good[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert "adapter_config.json nests deeper than 32 levels" in _error(path, base)
    config.write_text(good[:-1] + ', "x": ' + "{" * 100_000 + "}")  # not even closed
    assert "nests deeper" in _error(path, base)
    config.write_text(good[:-1] + ', "x": "' + "[" * 100_000 + '\\"]"}')  # in a string
    assert load_adapter("fine", path, base, max_rank=64).rank == 8
    config.write_text(good[:-1] + ', "x": "' + "a" * (1 << 20) + '"}')
    assert "adapter_config.json is larger than 1 MiB" in _error(path, base)
    config.write_text(good.replace('"lora_alpha": 16', '"lora_alpha": NaN'))
    assert "adapter_config.json is not valid JSON (NaN is not a JSON number)" in _error(path,
                                                                                        base)
    config.write_text(b"\xff\xfe{}".decode("latin-1"), encoding="latin-1")
    assert "adapter_config.json is not UTF-8 text" in _error(path, base)
    config.write_text("[1, 2]")
    assert "adapter_config.json is not a JSON object" in _error(path, base)


@pytest.mark.parametrize("alpha", ["0", "-16", "1e309", "100000", "true", '"16"'])
def test_alpha_is_a_sane_number(tmp_path: Path, base: BaseTargets, alpha: str) -> None:
    path = write_adapter(tmp_path / "a", base, targets=("q_proj",))
    config = Path(path, "adapter_config.json")
    config.write_text(config.read_text().replace('"lora_alpha": 16', f'"lora_alpha": {alpha}'))
    assert "lora_alpha must be" in _error(path, base)


def _rewrite(path: str, edit: dict[str, torch.Tensor | None]) -> None:
    """Replace (or, for None, drop) tensors of the adapter's weights file."""
    tensors = load_file(f"{path}/adapter_model.safetensors")
    for key, tensor in edit.items():
        if tensor is None:
            del tensors[key]
        else:
            tensors[key] = tensor
    save_file(tensors, f"{path}/adapter_model.safetensors")


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("half", ["A", "B"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_weights_that_are_not_finite(tmp_path: Path, base: BaseTargets, value: float,
                                     half: str, dtype: torch.dtype) -> None:
    """One NaN or Inf in one matrix refuses the adapter, naming that matrix."""
    path = write_adapter(tmp_path / "a", base, targets=("q_proj", "v_proj"))
    key = f"{Q0.replace('q_proj', 'v_proj')}.lora_{half}.weight"
    tensors = {k: t.to(dtype) for k, t in load_file(f"{path}/adapter_model.safetensors").items()}
    tensors[key][3, 1] = value
    save_file(tensors, f"{path}/adapter_model.safetensors")
    assert f"{key} holds values that are not finite (NaN or Inf)" in _error(path, base)


def test_finite_weights_of_every_float_dtype_load(tmp_path: Path, base: BaseTargets) -> None:
    """fp16 values whose sum overflows are still finite: the fast test's fallback."""
    path = write_adapter(tmp_path / "a", base, targets=("q_proj",))
    _rewrite(path, {f"{Q0}.lora_A.weight": torch.full((8, 32), 60000.0, dtype=torch.float16),
                    f"{Q0}.lora_B.weight": torch.ones(32, 8, dtype=torch.bfloat16)})
    adapter = load_adapter("big", path, base, max_rank=64)
    assert adapter.weights["model.layers.0.self_attn.q_proj"][0].dtype == torch.float16


def test_weights_of_the_wrong_kind(tmp_path: Path, base: BaseTargets) -> None:
    """Dtypes that are not a float, matrices that are not 2-D, a duplicated half, a key
    too long to quote: each refused, from the header, naming the tensor."""
    path = write_adapter(tmp_path / "a", base, targets=("q_proj",))
    _rewrite(path, {f"{Q0}.lora_A.weight": torch.zeros(8, 32, dtype=torch.int64)})
    assert f"{Q0}.lora_A.weight is I64; LoRA weights are float16, bfloat16, float32" in \
        _error(path, base)
    _rewrite(path, {f"{Q0}.lora_A.weight": torch.zeros(8, 32, dtype=torch.float64)})
    assert "is F64; LoRA weights are" in _error(path, base)
    _rewrite(path, {f"{Q0}.lora_A.weight": torch.zeros(8, 32, 1)})
    assert f"{Q0}.lora_A.weight is not a 2-D matrix (shape [8, 32, 1])" in _error(path, base)
    _rewrite(path, {f"{Q0}.lora_A.weight": torch.zeros(8, 32),
                    f"{Q0}.lora_A.default.weight": torch.zeros(8, 32)})
    assert "has two lora_A weights" in _error(path, base)
    _rewrite(path, {f"{Q0}.lora_A.default.weight": None, "x" * 10_000: torch.zeros(1, 1)})
    message = _error(path, base)
    assert "unexpected tensor xxx" in message and "..." in message


@pytest.mark.parametrize("half, shape, words", [
    ("A", (8, 48), "adapts a 48 -> 32 projection"),  # in features
    ("B", (40, 8), "adapts a 32 -> 40 projection"),  # out features
    ("A", (4, 32), "has rank 4/8 (lora_A/lora_B) but adapter_config.json says r=8"),
    ("B", (32, 4), "has rank 8/4"),
])
def test_weights_of_the_wrong_shape(tmp_path: Path, base: BaseTargets, half: str,
                                    shape: tuple[int, int], words: str) -> None:
    path = write_adapter(tmp_path / "a", base, targets=("q_proj",))
    _rewrite(path, {f"{Q0}.lora_{half}.weight": torch.zeros(shape)})
    assert words in _error(path, base)


@pytest.mark.parametrize("extra, words", [
    ({"use_dora": True}, "DoRA"), ({"bias": "all"}, "bias='all'"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"), ({"peft_type": "IA3"}, "IA3"),
    ({"r": 0}, "positive integer"), ({"lora_alpha": "x"}, "lora_alpha"),
])
def test_unsupported_config(tmp_path: Path, base: BaseTargets, extra: dict, words: str) -> None:
    path = write_adapter(tmp_path / "a", base, targets=("q_proj",), **extra)
    assert words in _error(path, base)


def _depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


def test_json_depth_skips_brackets_in_strings() -> None:
    """The depth measured without parsing equals the parsed document's, escapes and
    brackets inside strings included."""
    from worker.engine.lora.adapter_files import json_depth

    docs = [{}, [], {"a": [1, {"b": "[[{"}]}, ["\\", "\\\"[", {"k]": ["x\\\\", [[]]]}],
            {"r": 8, "target_modules": ["q_proj", "v_proj"], "s": "}}}]]]"}, "plain"]
    for doc in docs:
        text = json.dumps(doc).encode()
        assert json_depth(text) == _depth(doc), text
    assert json_depth(b"") == 0 and json_depth(b"[" * 50) == 50
