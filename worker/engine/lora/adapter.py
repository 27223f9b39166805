"""Load one PEFT LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``).

Everything an adapter can get wrong is found here, at load, with a ``LoraError`` that
names the problem: a missing or corrupt file, a rank over the limit, a target this engine
cannot adapt, or weights shaped for another base model. The shapes are the authority on
"another base model": ``base_model_name_or_path`` is often a hub id while the worker
serves a local copy of the same weights, so a differing name alone only goes into the
message of a shape error (vLLM does not compare it either).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from worker.engine.lora.targets import SUPPORTED, BaseTargets

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's saved key: base_model.model.<module>.lora_A.weight (an adapter-name segment
# before ``.weight`` appears in some versions' files)
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
# Features of the PEFT format this engine does not run: refused rather than ignored
_UNSUPPORTED = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out (Conv1D) weights"}


class LoraError(ValueError):
    """An adapter that cannot be served on this base model; the message says why."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter's weights on the host: per module A [r, in] and B [out, r]."""

    name: str
    path: str
    rank: int
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # module -> (A, B)
    # the prefix cache's key for this adapter: name, path and registration number
    # (AdapterCache), so a name registered again with other weights never reuses KV
    cache_key: str = ""

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_adapter(name: str, path: str | Path, base: BaseTargets, max_rank: int) -> LoraAdapter:
    """Read and check the adapter at ``path`` against ``base``; raises ``LoraError``."""
    root = Path(path)
    if not root.is_dir():
        raise LoraError(f"LoRA adapter {name!r}: {str(root)!r} is not a directory")
    cfg = _read_config(name, root)
    rank, scale = _rank_and_scale(name, cfg, max_rank)
    tensors = _read_weights(name, root)
    weights = _pair_weights(name, tensors)
    _check_targets(name, cfg, weights, base)
    for module, (a, b) in weights.items():
        _check_shapes(name, cfg, module, a, b, rank, base)
    return LoraAdapter(name, str(root), rank, scale, weights)


def _read_config(name: str, root: Path) -> dict[str, Any]:
    file = root / CONFIG_FILE
    if not file.is_file():
        raise LoraError(f"LoRA adapter {name!r}: no {CONFIG_FILE} in {str(root)!r}")
    try:
        cfg = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise LoraError(f"LoRA adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoraError(f"LoRA adapter {name!r}: peft_type {peft_type} is not LORA")
    for key, what in _UNSUPPORTED.items():
        if cfg.get(key):
            raise LoraError(f"LoRA adapter {name!r}: {what} is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoraError(f"LoRA adapter {name!r}: bias={cfg['bias']!r} is not supported "
                        "(only bias='none')")
    if cfg.get("modules_to_save"):
        raise LoraError(f"LoRA adapter {name!r}: modules_to_save {cfg['modules_to_save']} "
                        "(fully trained modules) is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise LoraError(f"LoRA adapter {name!r}: a per-module {key} is not supported")
    return cfg


def _rank_and_scale(name: str, cfg: dict[str, Any], max_rank: int) -> tuple[int, float]:
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoraError(f"LoRA adapter {name!r}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoraError(f"LoRA adapter {name!r}: rank {rank} is over this worker's limit "
                        f"max_lora_rank={max_rank}")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise LoraError(f"LoRA adapter {name!r}: lora_alpha must be a number, got {alpha!r}")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return rank, float(scale)


def _read_weights(name: str, root: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = root / WEIGHTS_FILE
    if not file.is_file():
        raise LoraError(f"LoRA adapter {name!r}: no {WEIGHTS_FILE} in {str(root)!r}")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise LoraError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} is corrupt or unreadable: "
                        f"{exc}") from exc


def _pair_weights(name: str, tensors: dict[str, torch.Tensor]
                  ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoraError(f"LoRA adapter {name!r}: unexpected tensor {key!r} (only "
                            "lora_A/lora_B weights are supported)")
        if tensor.dim() != 2 or not tensor.is_floating_point():
            raise LoraError(f"LoRA adapter {name!r}: {key} is not a 2-D float matrix")
        halves.setdefault(match["module"], {})[match["ab"]] = tensor
    if not halves:
        raise LoraError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    pairs = {}
    for module, ab in halves.items():
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise LoraError(f"LoRA adapter {name!r}: module {module} has no {missing} weight")
        pairs[module] = (ab["A"], ab["B"])
    return pairs


def _check_targets(name: str, cfg: dict[str, Any],
                   weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
                   base: BaseTargets) -> None:
    """Every adapted module is one the base has and we support; every listed target has
    weights."""
    for module in weights:
        leaf = module.rpartition(".")[2]
        if leaf not in SUPPORTED:
            raise LoraError(f"LoRA adapter {name!r}: target module {leaf} ({module}) is not "
                            f"supported; only {', '.join(SUPPORTED)}")
        if module not in base.shapes:
            raise LoraError(f"LoRA adapter {name!r}: the base model {base.name!r} has no "
                            f"module {module}{_trained_on(cfg, base)}")
    listed = cfg.get("target_modules")
    if isinstance(listed, list | tuple):
        leaves = {m.rpartition(".")[2] for m in weights}
        for target in listed:
            leaf = str(target).rpartition(".")[2]
            if leaf not in SUPPORTED:
                raise LoraError(f"LoRA adapter {name!r}: target module {target} is not "
                                f"supported; only {', '.join(SUPPORTED)}")
            if leaf not in leaves:
                raise LoraError(f"LoRA adapter {name!r}: target module {target} is listed "
                                f"in {CONFIG_FILE} but has no weights in {WEIGHTS_FILE}")


def _check_shapes(name: str, cfg: dict[str, Any], module: str, a: torch.Tensor,
                  b: torch.Tensor, rank: int, base: BaseTargets) -> None:
    want = base.shapes[module]
    if a.shape[0] != rank or b.shape[1] != rank:
        raise LoraError(f"LoRA adapter {name!r}: {module} has rank {a.shape[0]}/{b.shape[1]} "
                        f"(lora_A/lora_B) but adapter_config.json says r={rank}")
    if a.shape[1] != want.in_features or b.shape[0] != want.out_features:
        raise LoraError(
            f"LoRA adapter {name!r}: {module} adapts a {a.shape[1]} -> {b.shape[0]} "
            f"projection, the base model's is {want.in_features} -> {want.out_features}: "
            f"an adapter for another base model{_trained_on(cfg, base)}")


def _trained_on(cfg: dict[str, Any], base: BaseTargets) -> str:
    trained = cfg.get("base_model_name_or_path")
    if trained and str(trained) != base.name:
        return f" (it was trained on {trained!r}; this worker serves {base.name!r})"
    return ""
